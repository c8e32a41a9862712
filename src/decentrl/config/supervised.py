"""The `supervised` section: learning from the environment's own demonstrations."""

from __future__ import annotations

from pydantic import Field

from decentrl.config.base import Section


class SupervisedConfig(Section):
    """Supervised learning on the environment's own demonstrations (envs/base.py
    `Demonstrating`: a scripted solver plays train problems and writes the ideal transcript),
    through the same training chain as RL: a supervised row's loss is the negative
    log-likelihood of its assistant tokens, the environment's tokens carry none."""

    steps: int = Field(0, ge=0, le=100_000, description="supervised steps before RL (0: none); "
                       "they are the run's first versions and count in train.steps")
    rows_per_step: int = Field(16, ge=1, le=4096, description="demonstrations per supervised "
                               "step")
    interleave_rows: int = Field(0, ge=0, le=4096, description="demonstrations added to every "
                                 "RL step after the supervised steps, trained beside the "
                                 "rollouts (0: none)")
    lr: float | None = Field(None, gt=0, lt=1, description="the learning rate of the "
                             "supervised steps (None: train.lr); RL steps use train.lr")
    coef: float = Field(1.0, ge=0, le=100, allow_inf_nan=False, description="the weight of a "
                        "demonstration's mean token negative log-likelihood beside the policy "
                        "loss")
