"""The `curriculum` section: which problems of the seeded stream are handed out
(coordinator/curriculum.py)."""

from __future__ import annotations

from pydantic import Field

from decentrl.config.base import Section


class CurriculumConfig(Section):
    """Difficulty-aware scheduling (coordinator/curriculum.py): the coordinator estimates, per
    difficulty bucket of the task and per problem, how likely a group is to have reward spread,
    and hands out the seeded stream's problems with a chance that grows with it (at least
    `floor`)."""

    enabled: bool = Field(False, description="skip seeded problems whose groups are unlikely to "
                          "have reward spread; off, every problem of the stream is handed out "
                          "(the estimates are kept and reported either way)")
    floor: float = Field(0.1, gt=0, le=1, description="the least chance a problem is handed out "
                         "with, however sure the estimate is that its group will teach nothing: "
                         "no bucket is starved and the estimates keep following the policy")
    sharpness: float = Field(2.0, gt=0, le=16, allow_inf_nan=False, description="a problem is "
                             "handed out with chance (its chance of spread / the best bucket's) "
                             "to this power, at least `floor`: 1 follows the estimates "
                             "proportionally, higher keeps closer to the best buckets (on the "
                             "demo's base model, 1: 57% of groups without spread, 2: 49%, 4: "
                             "44%, against 74% without; bench/curriculum.py)")
    half_life_groups: float = Field(128.0, gt=0, allow_inf_nan=False, description="accepted "
                                    "groups after which an observation counts half: the "
                                    "estimates follow the policy as it improves")
    replay_share: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False, description="the share of "
                                "scheduled problems that may be problems handed out before whose "
                                "own groups say the next one will likely have reward spread "
                                "(0: none); the rest come from the seeded stream")
    max_replays: int = Field(3, ge=1, le=64, description="how many times a problem may be handed "
                             "out again after its first group")
    min_level_share: float = Field(0.0, ge=0, le=0.5, allow_inf_nan=False, description="the "
                                   "least share of the accepted groups (decayed as the "
                                   "estimates) each difficulty bucket keeps, whatever its chance "
                                   "of spread: while a bucket is below it, all its candidates "
                                   "are handed out and the other buckets' candidates and "
                                   "replays wait (0: none; it can hold for every bucket up to 1 "
                                   "/ their number)")
