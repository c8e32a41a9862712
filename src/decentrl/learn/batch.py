"""Turning scored rollout groups into the padded tensors a training step consumes.

Layout: prompts left-padded to P, completions right-padded to C, so every row is [P + C] and the
logits at position t predict token t + 1; `target_mask` marks the positions that predict a
completion token (the only ones that carry loss)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from decentrl.model.blocks import positions_from_valid
from decentrl.rollout.types import Rollout


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [B, L] long
    valid: torch.Tensor  # [B, L] bool: real tokens
    positions: torch.Tensor  # [B, L] long
    target_mask: torch.Tensor  # [B, L] bool: position predicts a completion token
    targets: torch.Tensor  # [B, L] long: the token that position predicts (0 elsewhere)
    behaviour_logprobs: torch.Tensor  # [B, L] float, aligned with targets
    advantages: torch.Tensor  # [B] float
    staleness: torch.Tensor  # [B] long: learner version minus the oldest stage version

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_target_tokens(self) -> int:
        return int(self.target_mask.sum())

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def split(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, self.num_sequences, size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def build_batch(rollouts: list[Rollout], advantages: list[float], staleness: list[int],
                pad_id: int) -> TrainBatch:
    if not rollouts:
        raise ValueError("cannot build a training batch from no rollouts")
    if not len(rollouts) == len(advantages) == len(staleness):
        raise ValueError(f"{len(rollouts)} rollouts but {len(advantages)} advantages and "
                         f"{len(staleness)} staleness values")
    prompt_length = max(len(r.prompt_tokens) for r in rollouts)
    completion_length = max(len(r.completion_tokens) for r in rollouts)
    batch, length = len(rollouts), prompt_length + completion_length
    tokens = torch.full((batch, length), pad_id, dtype=torch.long)
    valid = torch.zeros((batch, length), dtype=torch.bool)
    target_mask = torch.zeros((batch, length), dtype=torch.bool)
    targets = torch.zeros((batch, length), dtype=torch.long)
    behaviour = torch.zeros((batch, length), dtype=torch.float32)
    for row, rollout in enumerate(rollouts):
        prompt, completion = rollout.prompt_tokens, rollout.completion_tokens
        if not prompt:
            # The first completion token would be "predicted" from padding (or from index -1).
            raise ValueError(f"rollout {row} has an empty prompt")
        if len(rollout.behaviour_logprobs) != len(completion):
            raise ValueError(f"rollout {row} has {len(completion)} completion tokens but "
                             f"{len(rollout.behaviour_logprobs)} behaviour log-probs")
        start = prompt_length - len(prompt)
        end = prompt_length + len(completion)
        tokens[row, start:end] = torch.tensor(prompt + completion, dtype=torch.long)
        valid[row, start:end] = True
        predicting = slice(prompt_length - 1, end - 1)
        target_mask[row, predicting] = True
        targets[row, predicting] = torch.tensor(completion, dtype=torch.long)
        behaviour[row, predicting] = torch.tensor(rollout.behaviour_logprobs, dtype=torch.float32)
    return TrainBatch(
        tokens=tokens, valid=valid, positions=positions_from_valid(valid),
        target_mask=target_mask, targets=targets, behaviour_logprobs=behaviour,
        advantages=torch.tensor(advantages, dtype=torch.float32),
        staleness=torch.tensor(staleness, dtype=torch.long),
    )
