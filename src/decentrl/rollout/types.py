"""What a rollout is. Typed msgspec structs: the same objects cross the in-process transport, the
network (msgpack, strictly decoded) and the durable store."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

# The bytes of one recorded expert index, by the dtype's name (model/moe.py routing_dtype).
ROUTING_ITEMSIZE = {"int8": 1, "int16": 2}


class RoutingRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The experts each completion token went to in every sparse mixture-of-experts layer of the
    model, as its sampler's forward chose them (rollout/routing.py): `experts` holds
    [tokens, layers, top_k] little-endian indices of `dtype`, row-major, -1 (FREE_ROUTE) where
    none was recorded (a row's last token, which no forward has read)."""

    layers: int
    top_k: int
    dtype: str  # a key of ROUTING_ITEMSIZE
    experts: bytes

    def check(self, tokens: int) -> None:
        """Raise ValueError unless the record is well formed for `tokens` completion tokens."""
        if self.dtype not in ROUTING_ITEMSIZE:
            raise ValueError(f"routing dtype {self.dtype!r} is not one of "
                             f"{sorted(ROUTING_ITEMSIZE)}")
        if self.layers < 1 or self.top_k < 1:
            raise ValueError(f"a routing record needs layers and top_k >= 1, got {self.layers} "
                             f"and {self.top_k}")
        expected = tokens * self.layers * self.top_k * ROUTING_ITEMSIZE[self.dtype]
        if len(self.experts) != expected:
            raise ValueError(f"the routing record holds {len(self.experts)} bytes; {tokens} "
                             f"tokens x {self.layers} layers x {self.top_k} experts of "
                             f"{self.dtype} take {expected}")


class Rollout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sampled completion of one prompt."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    behaviour_logprobs: list[float]  # one per completion token (0.0 where not generated)
    finished: bool  # ended with a stop token (not cut at the length limit)
    # Per completion token: sampled by the model (True) or an environment's, fed in by the
    # episode (False: no behaviour log-prob, no gradient). None: every token was sampled.
    generated: list[bool] | None = None
    # A mixture of experts' routing of the completion tokens, recorded for the learner to replay
    # (train.routing_replay); None: not recorded.
    routing: RoutingRecord | None = None

    def check_lengths(self) -> None:
        """Raise ValueError naming the problem unless the per-token lists agree: a non-empty
        prompt and completion, one behaviour log-prob per completion token, and a generated
        mask (if any) that covers the completion and marks at least one sampled token, and a
        routing record (if any) of one entry per completion token. Ingestion
        runs it on every rollout a peer sends; whatever reads a rollout after that relies on it."""
        if not self.prompt_tokens or not self.completion_tokens:
            raise ValueError("a rollout needs a prompt and a completion")
        if len(self.behaviour_logprobs) != len(self.completion_tokens):
            raise ValueError(f"{len(self.completion_tokens)} completion tokens but "
                             f"{len(self.behaviour_logprobs)} behaviour log-probs")
        if self.generated is not None and (len(self.generated) != len(self.completion_tokens)
                                           or not any(self.generated)):
            raise ValueError(f"the generated mask has {len(self.generated)} entries for "
                             f"{len(self.completion_tokens)} completion tokens, and must mark "
                             "at least one sampled")
        if self.routing is not None:
            self.routing.check(len(self.completion_tokens))

    def generated_mask(self) -> list[bool]:
        """Per completion token, whether the model sampled it (lengths checked by
        `check_lengths`)."""
        return [True] * len(self.completion_tokens) if self.generated is None else self.generated


class VersionSpan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The weights that sampled a run of completion tokens: every token from index `start` up to
    the next span's start (or the end) was sampled by a forward step in which stage i ran weight
    version `versions[i]`. The prefill step samples completion token 0."""

    start: int
    versions: list[int]  # one per stage, in stage order


class RolloutGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """G samples of the same prompt: the unit of group-relative advantages. Its rows were
    generated together, one forward step per token index, so `version_spans` covers the same
    token indices of every rollout."""

    group_id: str
    task: str
    problem_index: int
    stage_versions: list[int]  # per stage, the oldest version in version_spans (for staleness)
    version_spans: list[VersionSpan]  # which weights sampled which completion tokens
    sampling_seed: int  # seed of the generator the samples were drawn with (for re-execution)
    rollouts: list[Rollout]

    @property
    def oldest_version(self) -> int:
        return min(self.stage_versions)


class ScoredGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A group after the coordinator recomputed every reward itself (a peer's claim never counts)."""

    group: RolloutGroup
    rewards: list[float]
    correct: list[float]


def oldest_versions(spans: Sequence[VersionSpan]) -> list[int]:
    """Per stage, the smallest version over `spans` (a group's `stage_versions`)."""
    return [min(stage) for stage in zip(*(span.versions for span in spans), strict=True)]


def check_version_spans(group: RolloutGroup, num_stages: int) -> None:
    """Raise ValueError naming the problem unless `group.version_spans` is well formed (starts at
    token 0, strictly increasing starts, `num_stages` non-negative versions each, consecutive
    spans differ, every span covers a token of some rollout) and `group.stage_versions` is its
    per-stage minimum."""
    spans = group.version_spans
    if not spans:
        raise ValueError("version_spans is empty")
    if spans[0].start != 0:
        raise ValueError(f"version_spans must start at token 0, the first starts at "
                         f"{spans[0].start}")
    for before, span in zip(spans, spans[1:]):
        if span.start <= before.start:
            raise ValueError(f"version_spans starts must increase: {span.start} follows "
                             f"{before.start}")
        if span.versions == before.versions:
            raise ValueError(f"version_spans at {before.start} and {span.start} have the same "
                             f"versions {span.versions}; they should be one span")
    for span in spans:
        if len(span.versions) != num_stages:
            raise ValueError(f"version span at {span.start} has {len(span.versions)} versions, "
                             f"the run has {num_stages} stages")
        if any(version < 0 for version in span.versions):
            raise ValueError(f"version span at {span.start} has a negative version "
                             f"{span.versions}")
    longest = max((len(r.completion_tokens) for r in group.rollouts), default=0)
    if spans[-1].start >= longest:
        raise ValueError(f"version span at {spans[-1].start} covers no token (the longest "
                         f"completion has {longest})")
    if group.stage_versions != oldest_versions(spans):
        raise ValueError(f"stage_versions {group.stage_versions} is not the per-stage minimum "
                         f"of version_spans, {oldest_versions(spans)}")
