"""Turning scored rollouts into the padded tensors a training step consumes.

Layout: each distinct prompt once ([Np, P], left-padded), every completion once ([B, C],
right-padded) with `prompt_of` naming its prompt. The G samples of a group share one prompt, so
the trainer runs it once per group (see model/prefix.py). Completion token j is predicted by the
last prompt position (j = 0) or by completion position j - 1; every real completion token is a
target.

A supervised row (`supervised`) is a demonstration, not a sample: its loss is the negative
log-likelihood of its generated-mask tokens (the assistant's), and it has no behaviour log-probs,
advantage or staleness (zeros).

Each field of TrainBatch is declared once, with its dtype, its shape and the range of its values
(`BatchField`, in the field's metadata; `BATCH_FIELDS` lists them). What a training peer is sent
(net/protocol.py: the tensors of a forward and the request's size limit) and what it checks in
what it receives (stage/inbound.py) are derived from these declarations, so a new field is one
line here (and its value in `build_batch`).

One field is not declared: `routing`, the experts each completion token of a mixture of experts
went to when it was sampled, which the learner replays (train.routing_replay). Its shape is the
model's, not a BatchField layout: a swarm's training peer is sent only its stage's part, as the
optional `routing` tensor of train_forward (net/protocol.py; checked in stage/inbound.py
InboundChecks.routing, which lays it out as a whole record again)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from decentrl.model.blocks import positions_from_valid
from decentrl.model.moe import FREE_ROUTE
from decentrl.rollout.routing import routing_tensor
from decentrl.rollout.types import Rollout

# What a field holds one value of: each token position of the prompts ([Np, P]), each token
# position of the completions ([B, C]), or each completion ([B]).
Layout = Literal["prompt tokens", "completion tokens", "completions"]
# The exclusive upper bound of a field's values (the lower one is 0): the model's vocabulary (token
# ids), its positions, or the batch's prompt rows (a completion's prompt).
Bound = Literal["vocabulary", "positions", "prompt rows"]
_DECLARATION = "batch field"  # the key of a field's BatchField in its metadata


@dataclass(frozen=True)
class BatchField:
    """The declaration of one TrainBatch tensor."""

    dtype: torch.dtype
    layout: Layout
    below: Bound | None = None  # values in [0, that bound); None: any value of the dtype
    within: str | None = None  # a mask true only where this other mask of the batch is

    def shape(self, prompts: torch.Size, completions: torch.Size) -> torch.Size:
        """The shape of this field in a batch whose prompts and completions have these shapes."""
        if self.layout == "prompt tokens":
            return prompts
        return completions if self.layout == "completion tokens" else completions[:1]


def declare(dtype: torch.dtype, layout: Layout, below: Bound | None = None,
            within: str | None = None) -> dict[str, BatchField]:
    """The metadata of a TrainBatch field: its declaration."""
    return {_DECLARATION: BatchField(dtype, layout, below, within)}


@dataclass
class TrainBatch:
    """A training batch, laid out as the module docstring says; each field declares its dtype,
    its layout and the range of its values (BatchField)."""

    # Left-padded.
    prompts: torch.Tensor = field(metadata=declare(torch.long, "prompt tokens", "vocabulary"))
    prompt_valid: torch.Tensor = field(metadata=declare(torch.bool, "prompt tokens"))
    prompt_positions: torch.Tensor = field(
        metadata=declare(torch.long, "prompt tokens", "positions"))
    # Right-padded: the targets.
    completions: torch.Tensor = field(
        metadata=declare(torch.long, "completion tokens", "vocabulary"))
    # The real completion tokens (all are context).
    completion_valid: torch.Tensor = field(metadata=declare(torch.bool, "completion tokens"))
    # Those the model sampled (the loss mask).
    completion_generated: torch.Tensor = field(
        metadata=declare(torch.bool, "completion tokens", within="completion_valid"))
    # Continuing after the prompt.
    completion_positions: torch.Tensor = field(
        metadata=declare(torch.long, "completion tokens", "positions"))
    # The row of each completion's prompt in `prompts`.
    prompt_of: torch.Tensor = field(metadata=declare(torch.long, "completions", "prompt rows"))
    behaviour_logprobs: torch.Tensor = field(
        metadata=declare(torch.float32, "completion tokens"))
    advantages: torch.Tensor = field(metadata=declare(torch.float32, "completions"))
    # The learner version minus the oldest stage version.
    staleness: torch.Tensor = field(metadata=declare(torch.long, "completions"))
    # A demonstration, trained by likelihood (see above).
    supervised: torch.Tensor = field(metadata=declare(torch.bool, "completions"))
    # [B, C, sparse layers, top_k]: each completion token's recorded experts, FREE_ROUTE where
    # none was recorded (padding, a row's last token, a demonstration); None: no replay.
    routing: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> TrainBatch:
        """The batch of the fields in `tensors` (which may hold other tensors too)."""
        return cls(**{name: tensors[name] for name in BATCH_FIELDS})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every field by name, in the order they are declared."""
        return {name: getattr(self, name) for name in BATCH_FIELDS}

    @property
    def num_sequences(self) -> int:
        return self.completions.shape[0]

    @property
    def num_target_tokens(self) -> int:
        """The policy loss's tokens: the sampled ones of the rows that are not supervised."""
        return int((self.completion_generated & ~self.supervised[:, None]).sum())

    @property
    def num_policy_sequences(self) -> int:
        return int((~self.supervised).sum())

    @property
    def num_supervised_tokens(self) -> int:
        return int((self.completion_generated & self.supervised[:, None]).sum())

    def select(self, rows: slice) -> TrainBatch:
        """Completion rows `rows` and just the prompts they use."""
        used, prompt_of = torch.unique(self.prompt_of[rows], return_inverse=True)
        values = {name: tensor[used] if BATCH_FIELDS[name].layout == "prompt tokens"
                  else tensor[rows] for name, tensor in self.tensors().items()}
        values["prompt_of"] = prompt_of
        return TrainBatch(**values, routing=None if self.routing is None else self.routing[rows])

    def split(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, self.num_sequences, size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{name: tensor.to(device) for name, tensor in self.tensors().items()},
                          routing=None if self.routing is None else self.routing.to(device))


def minibatch_rows(rows: int, minibatches: int) -> list[slice]:
    """The rows of each minibatch of a batch of `rows`: `minibatches` runs of consecutive rows
    whose sizes are within one of each other (one a row when the batch has fewer): every
    minibatch, so every optimizer step, gets its share of the batch."""
    count = min(minibatches, max(rows, 1))
    bounds = [rows * i // count for i in range(count + 1)]
    return [slice(low, high) for low, high in zip(bounds, bounds[1:], strict=False)]


BATCH_FIELDS: dict[str, BatchField] = {f.name: f.metadata[_DECLARATION]
                                       for f in fields(TrainBatch) if _DECLARATION in f.metadata}


def batch_routing(rollouts: Sequence[Rollout], completion_length: int) -> torch.Tensor | None:
    """The `routing` of a batch of `rollouts` (right-padded to `completion_length`): each
    rollout's record, FREE_ROUTE where it has none; None when no rollout has one. Records of
    different shapes (layers, experts per token) are a ValueError."""
    records = [(row, routing_tensor(r.routing)) for row, r in enumerate(rollouts)
               if r.routing is not None]
    if not records:
        return None
    shapes = {tuple(record.shape[1:]) for _, record in records}
    dtypes = {record.dtype for _, record in records}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise ValueError(f"the rollouts' routing records disagree: [layers, top_k] {shapes}, "
                         f"dtypes {dtypes}")
    (shape,), (dtype,) = shapes, dtypes
    routing = torch.full((len(rollouts), completion_length, *shape), FREE_ROUTE, dtype=dtype)
    for row, record in records:
        routing[row, :record.shape[0]] = record
    return routing


def build_batch(rollouts: list[Rollout], advantages: list[float], staleness: list[int],
                pad_id: int, demonstrations: Sequence[Rollout] = (),
                routing: bool = False) -> TrainBatch:
    """A training batch of checked rollouts (Rollout.check_lengths: ingestion ran it), followed
    by `demonstrations` as supervised rows; with `routing`, the rollouts' routing records
    (`batch_routing`) for the learner to replay."""
    if not rollouts and not demonstrations:
        raise ValueError("cannot build a training batch from no rollouts")
    if not len(rollouts) == len(advantages) == len(staleness):
        raise ValueError(f"{len(rollouts)} rollouts but {len(advantages)} advantages and "
                         f"{len(staleness)} staleness values")
    supervised = [False] * len(rollouts) + [True] * len(demonstrations)
    advantages = [*advantages, *[0.0] * len(demonstrations)]
    staleness = [*staleness, *[0] * len(demonstrations)]
    rollouts = [*rollouts, *demonstrations]
    prompt_rows: dict[tuple[int, ...], int] = {}
    prompt_of = []
    for rollout in rollouts:
        prompt_of.append(prompt_rows.setdefault(tuple(rollout.prompt_tokens), len(prompt_rows)))
    prompt_length = max(len(p) for p in prompt_rows)
    prompts = torch.full((len(prompt_rows), prompt_length), pad_id, dtype=torch.long)
    prompt_valid = torch.zeros(prompts.shape, dtype=torch.bool)
    for prompt, row in prompt_rows.items():
        prompts[row, prompt_length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_valid[row, prompt_length - len(prompt):] = True
    completion_length = max(len(r.completion_tokens) for r in rollouts)
    completions = torch.full((len(rollouts), completion_length), pad_id, dtype=torch.long)
    completion_valid = torch.zeros(completions.shape, dtype=torch.bool)
    completion_generated = torch.zeros(completions.shape, dtype=torch.bool)
    behaviour = torch.zeros(completions.shape, dtype=torch.float32)
    for row, rollout in enumerate(rollouts):
        n = len(rollout.completion_tokens)
        completions[row, :n] = torch.tensor(rollout.completion_tokens, dtype=torch.long)
        completion_valid[row, :n] = True
        completion_generated[row, :n] = torch.tensor(rollout.generated_mask(), dtype=torch.bool)
        behaviour[row, :n] = torch.tensor(rollout.behaviour_logprobs, dtype=torch.float32)
    prompt_of_tensor = torch.tensor(prompt_of, dtype=torch.long)
    prompt_lengths = prompt_valid.sum(1)[prompt_of_tensor]
    completion_positions = prompt_lengths[:, None] + torch.arange(completion_length)[None, :]
    return TrainBatch(
        prompts=prompts, prompt_valid=prompt_valid,
        prompt_positions=positions_from_valid(prompt_valid),
        completions=completions, completion_valid=completion_valid,
        completion_generated=completion_generated, completion_positions=completion_positions,
        prompt_of=prompt_of_tensor,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor(advantages, dtype=torch.float32),
        staleness=torch.tensor(staleness, dtype=torch.long),
        supervised=torch.tensor(supervised, dtype=torch.bool),
        routing=batch_routing(rollouts, completion_length) if routing else None,
    )
