"""The `eval` section: the run's own held-out evaluation."""

from __future__ import annotations

from pydantic import Field

from decentrl.config.base import Section
from decentrl.config.task import TaskConfig


class EvalConfig(Section):
    """The run's own held-out evaluation: before training, every `every` steps, after the
    supervised steps and after training."""

    task: TaskConfig = Field(TaskConfig(name="sums", options={"min_digits": 2, "max_digits": 2}),
                             description="what the run is evaluated on, a table with name and "
                             "options as [task] has (held-out problems: never handed out for "
                             "training)")
    problems: int = Field(200, ge=1, description="held-out problems per evaluation")
    pass_k: int = Field(4, ge=1, description="samples per problem for pass@k (1 disables)")
    every: int = Field(0, ge=0, description="evaluate every N steps during training (0: only "
                                              "before and after)")
    max_new_tokens: int = Field(24, ge=1, le=4096, description="the completion budget of an "
                                "evaluated problem, as rollout.max_new_tokens is of a training "
                                "one")
    batch_size: int = Field(64, ge=1, description="problems generated at once")
    greedy: bool = Field(True, description="a run's own evaluation adds greedy pass@1 beside the "
                         "sampled one: one greedy generation per problem, about 1/group_size "
                         "more generation; its sessions (temperature 0) tell the peers they are "
                         "evaluation, so they are spot-checked like the rest")
