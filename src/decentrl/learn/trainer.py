"""Training a chain of stages. The `PipelineTrainer` drives any `StageWorker`s (a local
`StageTrainer`, or a training peer behind the network; learn/stage_trainer.py): forward through
the chain, the loss at the last stage (learn/stage_loss.py), backward back through the chain,
micro-batch by micro-batch, then one global gradient-norm clip and a step on every stage; a
batch may take several such steps (minibatches, epochs) against proximal log-probs fixed by a
forward-only pass first. Nothing crossing a stage boundary keeps a graph, so the same driver
works over a network."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from decentrl.config import SupervisedConfig, TrainConfig
from decentrl.learn.batch import TrainBatch, minibatch_rows
from decentrl.learn.checkpoints import read_checkpoint, write_checkpoint
from decentrl.learn.entropy import AdaptiveEntropy, covariance_selection
from decentrl.learn.losses import LossConfig, flagged_rows
from decentrl.learn.stage_loss import LossInputs, RowStats, completion_logprobs
from decentrl.learn.stage_trainer import (
    Activations,
    StageTrainer,
    StageWorker,
    routing_replay_needs_experts,
    stage_forward,
)
from decentrl.model.stages import StageModule
from decentrl.rollout.sampling import SamplingConfig

# Clip-Cov's draw: a generator seeded with this plus the learner's version.
SELECTION_SEED = 0x5E1EC7


class MicroBatchChain(Protocol):
    """Micro-batches run through every stage by the stages themselves (a chain of remote
    training peers that push activations to each other, client/training_push.py), instead of
    stage by stage from here."""

    def run(self, micro_batches: Sequence[tuple[int, TrainBatch, LossInputs]]
            ) -> list[tuple[dict[str, float], RowStats]]:
        """Forward and backward of each (micro id, micro-batch, the loss's inputs) through
        every stage, gradients accumulated there: each one's metrics and RowStats, in order."""
        ...

    def logprobs(self, micro_batches: Sequence[tuple[int, TrainBatch]]) -> list[torch.Tensor]:
        """Forward only of each (micro id, micro-batch) through every stage at the learner's
        version, nothing kept and nothing changed there: the last stage's
        `completion_logprobs` [rows, C] of each, in order."""
        ...


class PipelineTrainer:
    def __init__(self, workers: Sequence[StageWorker], train: TrainConfig, loss: LossConfig,
                 sampling: SamplingConfig, device: torch.device,
                 reference_stages: list[StageModule] | None = None,
                 chain: MicroBatchChain | None = None) -> None:
        """`device` is where the driver keeps batch-wide tensors (proximal/reference log-probs).
        The KL reference runs the whole chain here, so it needs local stages (see `local`).
        `chain`: where the micro-batches' forward and backward (and forward-only passes) run
        (None: through `workers`, stage by stage); gradient norms and steps go to `workers`."""
        if loss.kl_coef > 0 and reference_stages is None:
            raise ValueError("kl_coef > 0 needs reference stages")
        self.workers = list(workers)
        self.train, self.loss, self.sampling = train, loss, sampling
        self.reference_stages = reference_stages
        self.device = device
        self.chain = chain
        # The adaptive entropy bonus (train.entropy.target), whose coefficient a checkpoint keeps.
        target = train.entropy.target
        self.entropy_bonus = AdaptiveEntropy(target, train.entropy.coef_step,
                                             train.entropy.max_coef) \
            if target is not None else None
        # The last batch's RowStats of every row, in batch order, from its first pass.
        self.row_stats: RowStats | None = None

    @property
    def flagged(self) -> torch.Tensor | None:
        """Rows of the last step the trust flags caught (they did not count in the loss)."""
        return None if self.row_stats is None else flagged_rows(*self.row_stats, self.loss)

    @classmethod
    def local(cls, stages: list[StageModule], train: TrainConfig, loss: LossConfig,
              sampling: SamplingConfig, autocast_dtype: torch.dtype,
              reference_stages: list[StageModule] | None = None,
              supervised: SupervisedConfig | None = None) -> PipelineTrainer:
        """Every stage trained in this process."""
        routing_replay_needs_experts(stages[0].spec, train)
        workers = [StageTrainer(stage, train, loss, sampling, autocast_dtype, supervised)
                   for stage in stages]
        return cls(workers, train, loss, sampling, workers[0].device, reference_stages)

    @property
    def stage_trainers(self) -> list[StageTrainer]:
        """The local stage trainers (checkpoints and weight access need them)."""
        if not all(isinstance(w, StageTrainer) for w in self.workers):
            raise TypeError("this pipeline trains remote stages; only their peers hold weights")
        return self.workers  # type: ignore[return-value]

    @property
    def version(self) -> int:
        """All stages step together, so the learner's version is any stage's version."""
        return self.workers[0].version

    def _chain_logprobs(self, stages: list[StageModule], batch: TrainBatch) -> torch.Tensor:
        """Sampling-transformed log-probs of the targets [B, C] under `stages`, without gradient."""
        out = torch.zeros(batch.completions.shape, dtype=torch.float32, device=self.device)
        size = self.train.micro_batch_size
        with torch.no_grad(), self.stage_trainers[0].autocast():
            for start in range(0, batch.num_sequences, size):
                micro = batch.select(slice(start, start + size))
                x: Activations | torch.Tensor = (micro.prompts, micro.completions)
                for stage in stages:
                    x = stage_forward(stage, x, micro)  # type: ignore[arg-type]
                assert isinstance(x, torch.Tensor)
                out[start:start + size] = completion_logprobs(x, micro, self.sampling)
        return out

    @property
    def needs_proximal(self) -> bool:
        """Whether a batch's loss needs proximal log-probs fixed before its first update (a
        forward-only pass, `proximal_logprobs`): with one optimizer step per batch the proximal
        policy is the current one, and the loss takes its detached log-probs; with several the
        policy moves between them. Clip-Cov and KL-Cov select their tokens from them too, over
        the whole batch (learn/entropy.py)."""
        return self.train.optimizer_steps_per_batch > 1 or self.loss.covariance_method != "none"

    def _split(self, batch: TrainBatch, minibatches: int
               ) -> list[tuple[slice, TrainBatch, list[tuple[slice, TrainBatch]]]]:
        """Each of the `minibatches` minibatches (`minibatch_rows`) of `batch`: its rows, itself,
        and its micro-batches (their rows of it, each one). The forward-only pass runs the first
        update's micro-batches, so its log-probs come from the same computation."""
        split = []
        size = self.train.micro_batch_size
        for rows in minibatch_rows(batch.num_sequences, minibatches):
            minibatch = batch.select(rows)
            micros = [(slice(start, start + size), minibatch.select(slice(start, start + size)))
                      for start in range(0, minibatch.num_sequences, size)]
            split.append((rows, minibatch, micros))
        return split

    def proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, C] float32 on `device`: the `completion_logprobs` of every row of `batch` under the
        learner as it is now, forward only, through whatever runs the stages (the pushed chain,
        or each worker in turn: local stages, or training peers the coordinator relays for).
        Nothing is kept anywhere and no weight or optimizer state changes."""
        batch = batch.to(self.device)
        micro_batches = [(micro_id, micro) for micro_id, micro in enumerate(
            micro for _, _, micros in self._split(batch, self.train.minibatches_per_batch)
            for _, micro in micros)]
        parts = self.chain.logprobs(micro_batches) if self.chain is not None \
            else [self._forward_only(*micro) for micro in micro_batches]
        if [tuple(p.shape) for p in parts] != [tuple(m.completions.shape)
                                                for _, m in micro_batches]:
            raise RuntimeError(f"the forward-only pass answered log-probs of shapes "
                               f"{[tuple(p.shape) for p in parts]} for micro-batches of "
                               f"{[tuple(m.completions.shape) for _, m in micro_batches]}")
        return torch.cat([p.to(self.device, torch.float32) for p in parts])

    def _forward_only(self, micro_id: int, micro: TrainBatch) -> torch.Tensor:
        x: Activations | torch.Tensor = (micro.prompts, micro.completions)
        for worker in self.workers:
            if isinstance(x, torch.Tensor):
                raise RuntimeError("a stage before the last answered log-probs")
            x = worker.forward_only(micro_id, x, micro)
        if not isinstance(x, torch.Tensor):
            raise RuntimeError("the last stage answered hidden states, not log-probs")
        return x

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One batch: `epochs_per_batch` passes over its `minibatches_per_batch` minibatches, one
        optimizer step (a version) each. Each metric is the mean over every micro-batch of every
        update that reports it (ratio_mean and clip_fraction too: the first update's ratios are
        1, the later ones' show how far the policy moved within the batch); `grad_norm` is the
        mean over the updates. `row_stats` (the trust flags) come from the first pass, whose
        every row was scored by a policy at most minibatches_per_batch - 1 updates past the
        batch's start, not by one trained on that row already. A batch of demonstrations only
        (the supervised warm-up's) takes one optimizer step: its versions count the warm-up's
        steps (supervised.steps: their learning rate, the keyframe after them), and without a
        sampled row no ratio needs a proximal policy."""
        batch = batch.to(self.device)
        reference = (self._chain_logprobs(self.reference_stages, batch)
                     if self.reference_stages is not None and self.loss.kl_coef > 0 else None)
        sampled = batch.num_policy_sequences > 0
        # With one optimizer step per batch the proximal policy is the current one, so its
        # log-probs are the detached current log-probs; with several, fix them before the first.
        proximal = self.proximal_logprobs(batch) if self.needs_proximal and sampled else None
        selected = self._covariance_selection(batch, proximal)
        split = self._split(batch, self.train.minibatches_per_batch if sampled else 1)
        totals: dict[str, float] = {}
        reported: dict[str, int] = {}
        grad_norm = 0.0
        updates = 0
        micro_count = 0  # unique within the step: a peer keeps a step's micro-batches by id
        rows_seen: list[RowStats] = []
        coefs: list[float] = []
        for epoch in range(self.train.epochs_per_batch if sampled else 1):
            for rows, minibatch, micros in split:
                coef = self.entropy_bonus.applied if self.entropy_bonus is not None else 0.0
                counts = LossInputs(None, None, minibatch.num_policy_sequences,
                                    minibatch.num_target_tokens, minibatch.num_supervised_tokens,
                                    entropy_coef=coef)
                micro_batches = []
                for micro_slice, micro in micros:
                    micro_batches.append((micro_count, micro, replace(
                        counts, proximal=_rows(proximal, rows, micro_slice),
                        reference=_rows(reference, rows, micro_slice),
                        selected=_rows(selected, rows, micro_slice))))
                    micro_count += 1
                results = self.chain.run(micro_batches) if self.chain is not None \
                    else [self._micro_step(*micro) for micro in micro_batches]
                for metrics, row_stats in results:
                    if epoch == 0:
                        rows_seen.append(row_stats)
                    # A metric is the mean over the micro-batches that report it (sft_* only
                    # come from micro-batches with supervised rows, the policy's from the others).
                    for key, value in metrics.items():
                        totals[key] = totals.get(key, 0.0) + value
                        reported[key] = reported.get(key, 0) + 1
                grad_norm += self._step()
                updates += 1
                entropies = [m["entropy"] for m, _ in results if "entropy" in m]
                if self.entropy_bonus is not None and entropies:
                    coefs.append(coef)
                    self.entropy_bonus.update(statistics.fmean(entropies))
        # Minibatches are disjoint slices in order: the first pass's micro-batches' rows are the
        # batch's.
        self.row_stats = (torch.cat([r[0].float().cpu() for r in rows_seen]),
                          torch.cat([r[1].float().cpu() for r in rows_seen]))
        result = {key: value / reported[key] for key, value in totals.items()}
        result["grad_norm"] = grad_norm / updates
        if coefs:
            result["entropy_coef"] = statistics.fmean(coefs)
        return result

    def _covariance_selection(self, batch: TrainBatch, proximal: torch.Tensor | None
                              ) -> torch.Tensor | None:
        """[B, C] bool: the tokens train.entropy.method acts on, selected over the batch's
        sampled tokens from its proximal log-probs; None without a method (or a sampled row).
        Clip-Cov's draw is seeded by the learner's version: a retried step draws the same."""
        if self.loss.covariance_method == "none" or proximal is None:
            return None
        entropy = self.train.entropy
        counted = batch.completion_generated & ~batch.supervised[:, None]
        return covariance_selection(
            proximal, batch.advantages, counted, self.loss.covariance_method, entropy.fraction,
            entropy.clip_cov_bounds, torch.Generator().manual_seed(SELECTION_SEED + self.version))

    def _micro_step(self, micro_id: int, micro: TrainBatch, loss_inputs: LossInputs
                    ) -> tuple[dict[str, float], RowStats]:
        x: Activations = (micro.prompts, micro.completions)
        metrics: dict[str, float] = {}
        last = len(self.workers) - 1
        for i, worker in enumerate(self.workers):
            x, metrics = worker.forward(micro_id, x, micro,
                                        loss_inputs=loss_inputs if i == last else None)
        grad: Activations | None = None
        for worker in reversed(self.workers):
            grad = worker.backward(micro_id, grad)
        return metrics, x

    def _step(self) -> float:
        norm = math.sqrt(sum(w.grad_square_norm() for w in self.workers))
        if not math.isfinite(norm):
            for w in self.workers:
                w.discard()
            raise FloatingPointError(f"gradient norm is {norm}; the update was discarded")
        max_norm = self.train.max_grad_norm
        scale = min(1.0, max_norm / (norm + 1e-6)) if max_norm is not None else 1.0
        for w in self.workers:
            w.step(scale)
        return norm

    def driver_state(self) -> dict[str, float | bool]:
        """What this driver learns across steps, which a checkpoint keeps beside the stages':
        the adaptive entropy bonus's coefficient (nothing without one)."""
        if self.entropy_bonus is None:
            return {}
        return {"entropy_coef": self.entropy_bonus.coef,
                "entropy_below_target": self.entropy_bonus.below_target}

    def load_driver_state(self, saved: Mapping[str, Any]) -> None:
        """Take back `driver_state` from a checkpoint's bookkeeping (one saved without it, or by
        a run without the bonus, leaves the coefficient as it is)."""
        if self.entropy_bonus is None or "entropy_coef" not in saved:
            return
        coef = saved["entropy_coef"]
        limit = self.entropy_bonus.max_coef
        if not isinstance(coef, (int, float)) or not 0 <= coef <= limit:
            raise ValueError(f"a checkpoint's entropy_coef must be a number in [0, {limit}] "
                             f"(train.entropy.max_coef), got {coef!r}")
        self.entropy_bonus.coef = float(coef)
        self.entropy_bonus.below_target = bool(saved.get("entropy_below_target", False))

    def save(self, root: Path, extra: dict) -> Path:
        """Write a checkpoint of every stage at this version under `root` (a CheckpointLayout),
        with `extra` and the driver's own state, then put it in charge."""
        return write_checkpoint(root, self.version, {t.stage.index: t.state()
                                                     for t in self.stage_trainers},
                                {**extra, **self.driver_state()})

    def load(self, root: Path) -> dict:
        """Load the checkpoint in charge under `root`; a bad checkpoint changes nothing."""
        info, states = read_checkpoint(root, [t.stage.index for t in self.stage_trainers],
                                       self.device)
        self.load_driver_state(info)
        for trainer, state in zip(self.stage_trainers, states, strict=True):
            trainer.load_state(state)
        return info


def _rows(per_token: torch.Tensor | None, minibatch: slice, micro: slice) -> torch.Tensor | None:
    """The rows of a whole-batch [B, C] tensor that belong to one micro-batch of a minibatch."""
    return None if per_token is None else per_token[minibatch][micro]
