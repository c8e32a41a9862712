"""Turning scored rollouts into the padded tensors a training step consumes.

Layout: each distinct prompt once ([Np, P], left-padded), every completion once ([B, C],
right-padded) with `prompt_of` naming its prompt. The G samples of a group share one prompt, so
the trainer runs it once per group (see model/prefix.py). Completion token j is predicted by the
last prompt position (j = 0) or by completion position j - 1; every real completion token is a
target.

A supervised row (`supervised`) is a demonstration, not a sample: its loss is the negative
log-likelihood of its generated-mask tokens (the assistant's), and it has no behaviour log-probs,
advantage or staleness (zeros)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import torch

from decentrl.model.blocks import positions_from_valid
from decentrl.rollout.types import Rollout


@dataclass
class TrainBatch:
    prompts: torch.Tensor  # [Np, P] long, left-padded
    prompt_valid: torch.Tensor  # [Np, P] bool
    prompt_positions: torch.Tensor  # [Np, P] long
    completions: torch.Tensor  # [B, C] long, right-padded: the targets
    completion_valid: torch.Tensor  # [B, C] bool: real completion tokens (all are context)
    completion_generated: torch.Tensor  # [B, C] bool: those the model sampled (the loss mask)
    completion_positions: torch.Tensor  # [B, C] long, continuing after the prompt
    prompt_of: torch.Tensor  # [B] long: row of each completion's prompt in `prompts`
    behaviour_logprobs: torch.Tensor  # [B, C] float
    advantages: torch.Tensor  # [B] float
    staleness: torch.Tensor  # [B] long: learner version minus the oldest stage version
    supervised: torch.Tensor  # [B] bool: a demonstration, trained by likelihood (see above)

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
        per_prompt = {"prompts", "prompt_valid", "prompt_positions"}
        values = {}
        for f in fields(self):
            tensor = getattr(self, f.name)
            values[f.name] = tensor[used] if f.name in per_prompt else tensor[rows]
        values["prompt_of"] = prompt_of
        return TrainBatch(**values)

    def split(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, self.num_sequences, size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def build_batch(rollouts: list[Rollout], advantages: list[float], staleness: list[int],
                pad_id: int, demonstrations: Sequence[Rollout] = ()) -> TrainBatch:
    """A training batch of checked rollouts (Rollout.check_lengths: ingestion ran it), followed
    by `demonstrations` as supervised rows."""
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
    )
