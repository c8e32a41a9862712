"""The `rollout` section: how completions are sampled for training."""

from __future__ import annotations

from pydantic import Field

from decentrl.config.base import Section


class RolloutConfig(Section):
    """How completions are sampled for training: groups of samples per prompt."""

    group_size: int = Field(8, ge=2, description="samples per prompt (G): a prompt's rewards "
                            "are compared within its group")
    prompts_per_step: int = Field(8, ge=1, description="prompts per training batch")
    max_new_tokens: int = Field(24, ge=1, le=4096, description="the most tokens a completion "
                                "may have, cut there (an episode's whole transcript after the "
                                "prompt, the environment's tokens included: an episode that "
                                "runs out is unfinished and earns no reward)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts "
                               "(1: the policy's own distribution)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: tokens outside the "
                         "smallest set holding this much probability are never sampled (1: off)")
    top_k: int = Field(0, ge=0, description="only the k most likely tokens are sampled (0: off)")
