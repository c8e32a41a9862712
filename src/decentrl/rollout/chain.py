"""The inference side of a chain of stages. A session holds one KV cache per stage for a batch of
sequences; hidden states hop stage to stage and the last stage samples, so only token ids, their
behaviour log-probs and the weight versions that computed them come back (never a [batch, vocab]
logits tensor). `LocalChain` runs every stage in this process; the swarm's chain
(client/sessions.py) runs the same protocol over the network."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from decentrl.model.stages import StageCache, StageModule
from decentrl.rollout.sampling import SamplingConfig, sample


def step_generator(seed: int | None) -> torch.Generator | None:
    """The generator of one decoding step. Seeded per step, not per session, so a session that
    moves to another replica mid-generation keeps drawing the same samples. Always on the CPU:
    the sampling noise is drawn there whatever device computes the logits, so a seed gives the
    same draw on any hardware and a verifier can re-derive it."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed % 2**63)


class StepResult(NamedTuple):
    tokens: torch.Tensor  # [B], the sampled next token of every row
    logprobs: torch.Tensor  # [B], their behaviour log-probs
    versions: tuple[int, ...]  # the weight version of every stage that computed this step
    # A mixture of experts' routing of the step's new positions, [B, T, every sparse layer of
    # the model, top_k]; None: a dense model, or a chain that does not record it.
    routing: torch.Tensor | None = None


class InferenceSession(Protocol):
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        """Feed new positions [B, T]; sample the next token of every row from the last new
        position. A stage's weights may change between two steps of a session (the step after
        the change attends to keys and values the old weights cached): each step reports the
        versions that computed it."""
        ...

    def close(self) -> None: ...


class InferenceChain(Protocol):
    @property
    def device(self) -> torch.device: ...

    def versions(self) -> tuple[int, ...]:
        """The weight version of every stage, in stage order."""
        ...

    def open_session(self, batch: int, max_length: int) -> InferenceSession: ...


def last_position(inputs: torch.Tensor) -> torch.Tensor:
    """The head-position mask [B, T] selecting the last new position of every row."""
    last = torch.zeros(inputs.shape[:2], dtype=torch.bool, device=inputs.device)
    last[:, -1] = True
    return last


class LocalSession:
    def __init__(self, stages: list[StageModule], batch: int, max_length: int) -> None:
        self.stages = stages
        self.caches: list[StageCache] | None = [s.new_cache(batch, max_length) for s in stages]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        if self.caches is None:
            raise RuntimeError("session is closed")
        x, records = tokens, []
        for stage, cache in zip(self.stages, self.caches):
            x, experts = stage.forward_routed(
                x, positions, key_valid, cache,
                head_positions=last_position(tokens) if stage.is_last else None)
            if experts is not None:
                records.append(experts)
        return StepResult(*sample(x, sampling, step_generator(seed)),
                          tuple(stage.version for stage in self.stages),
                          torch.cat(records, dim=2) if records else None)

    def close(self) -> None:
        self.caches = None


class LocalChain:
    """All stages in this process (the inference replicas of a single-machine run)."""

    def __init__(self, stages: list[StageModule]) -> None:
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ValueError("a chain needs every stage from the first to the last, in order")
        self.stages = stages

    @property
    def device(self) -> torch.device:
        return next(self.stages[0].parameters()).device

    def versions(self) -> tuple[int, ...]:
        return tuple(stage.version for stage in self.stages)

    def open_session(self, batch: int, max_length: int) -> LocalSession:
        return LocalSession(self.stages, batch, max_length)

    def load_stage(self, index: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Replace one stage's weights and record their version. Open sessions carry on: their
        next step runs with the new weights and reports their version. Call it between steps,
        never while a step runs (sessions on other threads share these weights unlocked, so that
        their forward passes run side by side)."""
        stage = self.stages[index]
        with torch.no_grad():
            for name, param in stage.state_dict().items():
                param.copy_(tensors[name])
        stage.version = version
