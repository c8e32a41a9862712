"""What a rollout is. Typed msgspec structs: the same objects cross the in-process transport, the
network (msgpack, strictly decoded) and the durable store."""

from __future__ import annotations

import msgspec


class Rollout(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled completion of one prompt."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    behaviour_logprobs: list[float]  # one per completion token
    finished: bool  # ended with a stop token (not cut at the length limit)
    completion_text: str


class RolloutGroup(msgspec.Struct, frozen=True, kw_only=True):
    """G samples of the same prompt: the unit of group-relative advantages."""

    group_id: str
    task: str
    problem_index: int
    stage_versions: list[int]  # weight version of every stage that generated the group
    sampling_seed: int  # seed of the generator the samples were drawn with (for re-execution)
    rollouts: list[Rollout]

    @property
    def oldest_version(self) -> int:
        return min(self.stage_versions)


class ScoredGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A group after the coordinator recomputed every reward itself (a peer's claim never counts)."""

    group: RolloutGroup
    rewards: list[float]
    correct: list[float]
