"""Training a chain of stages. Each `StageTrainer` owns one stage's fp32 master weights and its own
optimizer, and only ever sees activations in and gradients back, as a training peer does. The
`PipelineTrainer` drives any `StageWorker`s (a local `StageTrainer`, or a training peer behind the
network): forward through the chain, the loss at the last stage, backward back through the chain,
micro-batch by micro-batch, then one global gradient-norm clip and a step on every stage. Nothing
crossing a stage boundary keeps a graph, so the same driver works over a network."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from decentrl.config import SupervisedConfig, TrainConfig, TrustConfig
from decentrl.learn.batch import TrainBatch, minibatch_rows
from decentrl.learn.checkpoints import read_checkpoint, write_checkpoint
from decentrl.learn.losses import LossConfig, flagged_rows, policy_loss
from decentrl.model.prefix import predicting_hidden, shared_prompt_body
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StageModule
from decentrl.rollout.sampling import (
    SamplingConfig,
    sampling_logprobs,
    sampling_logprobs_and_entropy,
)


def loss_config_from(train: TrainConfig, max_new_tokens: int,
                     trust: TrustConfig | None = None,
                     supervised: SupervisedConfig | None = None) -> LossConfig:
    """The loss of a run; with `trust`, rollouts its flags catch stay out of the loss; with
    `supervised`, demonstrations weigh its `coef`."""
    return LossConfig(
        name=train.loss, clip_low=train.clip_low, clip_high=train.clip_high,
        kl_coef=train.kl_coef, tis_cap=train.tis_cap, mis_low=train.mis_low,
        mis_high=train.mis_high, dr_grpo_max_tokens=max_new_tokens, decoupled=train.decoupled,
        m2_threshold=train.m2_threshold, off_policy_correction=train.off_policy_correction,
        flag_log_ratio=trust.flag_log_ratio if trust else None,
        flag_surprise=trust.flag_surprise if trust else None,
        supervised_coef=supervised.coef if supervised else 1.0,
        covariance_method=train.entropy.method, kl_cov_coef=train.entropy.kl_cov_coef,
    )


Activations = tuple[torch.Tensor, torch.Tensor]  # (prompt part, completion part)
# What the last stage returns per micro-batch row: the mean over its completion tokens of
# log pi + H(pi) (how much less likely than typical they are) and of log pi - log mu
# (flagged_rows turns them into poison flags).
RowStats = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LossInputs:
    """What the last stage needs besides the micro-batch and its logits to compute the loss."""

    proximal: torch.Tensor | None  # [B, C] fixed proximal log-probs, None: the current policy's
    reference: torch.Tensor | None  # [B, C] reference log-probs for the KL term
    # Counts of the minibatch the micro-batch belongs to (loss normalisation): the policy
    # loss's sequences and tokens (TrainBatch.num_policy_sequences, num_target_tokens), and the
    # supervised rows' tokens.
    total_sequences: int
    total_tokens: int
    total_supervised_tokens: int = 0
    # Entropy control (learn/entropy.py): [B, C] bool, the tokens train.entropy.method acts on,
    # selected over the whole batch (None: no method); the adaptive entropy bonus's weight.
    selected: torch.Tensor | None = None
    entropy_coef: float = 0.0


def micro_batch_loss(logits: torch.Tensor, batch: TrainBatch, inputs: LossInputs,
                     loss: LossConfig, sampling: SamplingConfig
                     ) -> tuple[torch.Tensor, dict[str, float], RowStats]:
    """The loss of one micro-batch from the last stage's logits [N, vocab] of its targets, its
    metrics, and every row's statistics. Sampled rows get the policy loss, except those
    `flagged_rows` catches (the normalisers keep the batch's totals, so the other rows' weights
    do not change); supervised rows get `loss.supervised_coef` x their tokens' negative
    log-likelihood, summed over the minibatch's supervised tokens and divided by their count
    (`sft_nll` is the micro-batch's mean per token). A supervised row's statistics are zeros
    and it is never flagged: it is the coordinator's own demonstration."""
    valid = batch.completion_valid
    picked, entropy = sampling_logprobs_and_entropy(logits, batch.completions[valid], sampling,
                                                    entropy_gradient=inputs.entropy_coef > 0)
    logprobs = torch.zeros(valid.shape, dtype=torch.float32, device=logits.device)
    logprobs = logprobs.masked_scatter(valid, picked)
    # Only the tokens the model sampled count: an environment's tokens are context (they were
    # scored above with the rest, one forward pass) with no behaviour log-prob to compare with.
    supervised = batch.supervised
    mask = batch.completion_generated
    policy_mask = mask & ~supervised[:, None]
    with torch.no_grad():
        lengths = mask.sum(1).clamp(min=1)
        surprise = torch.zeros(valid.shape, device=logits.device).masked_scatter(
            valid, picked + entropy)
        row_surprise = (surprise * policy_mask).sum(1) / lengths
        row_log_ratio = ((logprobs - batch.behaviour_logprobs) * policy_mask).sum(1) / lengths
        flagged = flagged_rows(row_surprise, row_log_ratio, loss) & ~supervised
    value = logprobs.new_zeros(())
    metrics: dict[str, float] = {}
    policy = ~supervised
    if bool(policy.any()):
        counted = (policy_mask & ~flagged[:, None])[policy]
        value, metrics = policy_loss(
            logprobs[policy],
            (inputs.proximal if inputs.proximal is not None else logprobs.detach())[policy],
            batch.behaviour_logprobs[policy], batch.advantages[policy], counted, loss,
            reference_logprobs=None if inputs.reference is None else inputs.reference[policy],
            total_sequences=inputs.total_sequences, total_tokens=inputs.total_tokens,
            selected=None if inputs.selected is None else inputs.selected[policy])
        metrics["entropy"] = float(entropy[policy_mask[valid]].mean())
        if inputs.entropy_coef > 0:
            # The adaptive bonus: -coef x the counted tokens' entropy, a token mean over the
            # minibatch's policy tokens whatever the loss (learn/entropy.py).
            counted_entropy = entropy[(policy_mask & ~flagged[:, None])[valid]].sum()
            value = value - inputs.entropy_coef * counted_entropy / inputs.total_tokens
        metrics["flagged_fraction"] = float(flagged[policy].float().mean())
    if bool(supervised.any()):
        supervised_mask = mask & supervised[:, None]
        tokens = int(supervised_mask.sum())
        if not tokens <= inputs.total_supervised_tokens:
            raise ValueError(f"total_supervised_tokens must be at least this micro-batch's "
                             f"{tokens} supervised tokens, got {inputs.total_supervised_tokens}")
        nll = -(logprobs * supervised_mask).sum()
        value = value + loss.supervised_coef * nll / inputs.total_supervised_tokens
        metrics["sft_nll"] = float(nll.detach()) / max(tokens, 1)
        metrics["sft_token_accuracy"] = float(
            (logits.detach().argmax(-1) == batch.completions[valid])[supervised_mask[valid]]
            .float().mean())
    return value, metrics, (row_surprise, row_log_ratio)


def routing_replay_needs_experts(spec: ModelSpec, train: TrainConfig) -> None:
    """A ValueError when train.routing_replay is on for a model without a mixture of experts:
    there is no routing to record or replay."""
    if train.routing_replay and spec.moe is None:
        raise ValueError(f"train.routing_replay needs a mixture-of-experts model (qwen3_moe, "
                         f"mixtral); {spec.model_type} is dense: turn it off")


def stage_forward(stage: StageModule, inputs: Activations, batch: TrainBatch
                  ) -> Activations | torch.Tensor:
    """One stage on one batch: the hidden states of prompts and completions, or at the last
    stage the logits [N, vocab] of every completion token (the targets, in row-major order).
    A batch's `routing` (train.routing_replay) is replayed in the completions' forward."""
    replay = None if batch.routing is None else stage.stage_routing(batch.routing)
    prompt_hidden, completion_hidden = shared_prompt_body(
        stage, inputs[0], batch.prompt_positions, batch.prompt_valid, inputs[1],
        batch.completion_positions, batch.completion_valid, batch.prompt_of, replay)
    if not stage.is_last:
        return prompt_hidden, completion_hidden
    hidden = predicting_hidden(prompt_hidden, completion_hidden, batch.prompt_of)
    return stage.head(hidden[batch.completion_valid])


def completion_logprobs(logits: torch.Tensor, batch: TrainBatch, sampling: SamplingConfig
                        ) -> torch.Tensor:
    """[B, C] float32: the sampling-transformed log-prob of every completion target from the last
    stage's `logits` [N, vocab] (stage_forward's), 0 past a row's end: what `micro_batch_loss`
    scores as the current policy's log-probs, computed the same way."""
    valid = batch.completion_valid
    picked = sampling_logprobs(logits, batch.completions[valid], sampling)
    out = torch.zeros(valid.shape, dtype=torch.float32, device=logits.device)
    return out.masked_scatter(valid, picked.float())


class StageWorker(Protocol):
    """One stage of the training chain, local or remote."""

    @property
    def version(self) -> int: ...

    def forward(self, micro: int, inputs: Activations, batch: TrainBatch,
                loss_inputs: LossInputs | None = None
                ) -> tuple[Activations, dict[str, float]]:
        """The stage's outputs for the next stage, or at the last stage (given `loss_inputs`)
        its RowStats and the loss metrics."""
        ...

    def backward(self, micro: int, grad_outputs: Activations | None) -> Activations | None: ...

    def forward_only(self, micro: int, inputs: Activations, batch: TrainBatch
                     ) -> Activations | torch.Tensor:
        """The stage's outputs for the next stage without gradient, or at the last stage the
        `completion_logprobs` [rows, C] of micro-batch `micro`: nothing is kept, no weight or
        optimizer state changes (the proximal log-probs, `PipelineTrainer.proximal_logprobs`)."""
        ...

    def grad_square_norm(self) -> float: ...

    def step(self, grad_scale: float) -> None: ...

    def discard(self) -> None: ...


class StageTrainer:
    """One stage's optimizer and the activations it keeps between forward and backward."""

    def __init__(self, stage: StageModule, train: TrainConfig, loss: LossConfig,
                 sampling: SamplingConfig, autocast_dtype: torch.dtype,
                 supervised: SupervisedConfig | None = None) -> None:
        """With `supervised`, the versions up to its warm-up steps step at its `lr`."""
        self.stage = stage
        self.loss, self.sampling = loss, sampling
        self.device = next(stage.parameters()).device
        self.autocast_dtype = autocast_dtype
        self.base_lr = train.lr
        self.lr_warmup_steps = train.lr_warmup_steps
        self.supervised_steps = supervised.steps if supervised else 0
        self.supervised_lr = supervised.lr if supervised and supervised.lr else train.lr
        # Only what trains: with LoRA the frozen base weights get neither gradients nor Adam state.
        self.params = [p for p in stage.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"stage {stage.index} has no parameter that requires a gradient")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay,
        )
        self.saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @property
    def version(self) -> int:
        return self.stage.version

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, micro: int, inputs: Activations, batch: TrainBatch,
                loss_inputs: LossInputs | None = None
                ) -> tuple[Activations, dict[str, float]]:
        """Run this stage on micro-batch `micro` and keep what backward needs. Other stages return
        their detached outputs for the next stage; the last stage is given `loss_inputs`,
        computes the loss, and returns its RowStats and metrics."""
        if micro in self.saved:
            raise ValueError(f"stage {self.stage.index} already holds micro-batch {micro}")
        batch = batch.to(self.device)
        xs = [x.to(self.device) for x in inputs]
        xs = [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in xs]
        with self.autocast():
            out = stage_forward(self.stage, (xs[0], xs[1]), batch)
        leaves = [x for x in xs if x.requires_grad]
        if loss_inputs is not None:
            if not isinstance(out, torch.Tensor):
                raise RuntimeError(f"stage {self.stage.index} is not the last stage; no loss here")
            loss_inputs = replace(loss_inputs, **{
                name: None if tensor is None else tensor.to(self.device)
                for name, tensor in (("proximal", loss_inputs.proximal),
                                     ("reference", loss_inputs.reference),
                                     ("selected", loss_inputs.selected))})
            loss, metrics, rows = micro_batch_loss(out, batch, loss_inputs, self.loss,
                                                   self.sampling)
            self.saved[micro] = (leaves, [loss])
            return rows, metrics
        if isinstance(out, torch.Tensor):
            raise RuntimeError("the last stage needs the loss inputs")
        self.saved[micro] = (leaves, list(out))
        return (out[0].detach(), out[1].detach()), {}

    def backward(self, micro: int, grad_outputs: Activations | None) -> Activations | None:
        """Backpropagate one micro-batch; returns the gradients for the previous stage."""
        if micro not in self.saved:
            raise KeyError(f"stage {self.stage.index} has no forward pass for micro-batch {micro}")
        leaves, outputs = self.saved.pop(micro)
        torch.autograd.backward(outputs, list(grad_outputs) if grad_outputs is not None else None)
        if not leaves:
            return None
        return leaves[0].grad, leaves[1].grad

    def forward_only(self, micro: int, inputs: Activations, batch: TrainBatch
                     ) -> Activations | torch.Tensor:
        """This stage on micro-batch `micro` without gradient, keeping nothing: the detached
        outputs for the next stage, or at the last stage the `completion_logprobs` [rows, C],
        from the same forward and autocast as `forward`'s (so a batch's first update scores its
        proximal log-probs against the same numbers)."""
        batch = batch.to(self.device)
        xs = (inputs[0].to(self.device), inputs[1].to(self.device))
        with torch.no_grad():
            with self.autocast():
                out = stage_forward(self.stage, xs, batch)
            if isinstance(out, torch.Tensor):
                return completion_logprobs(out, batch, self.sampling)
        return out[0], out[1]

    def discard(self) -> None:
        """Forget a step that cannot finish (a peer failed mid-step): activations and gradients."""
        self.saved.clear()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_square_norm(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        # Per-tensor norms on the device, one host sync, the sum of squares in float64.
        norms = torch.stack([g.norm(dtype=torch.float32) for g in grads])
        return float(norms.double().pow(2).sum())

    def step(self, grad_scale: float) -> None:
        """Apply the accumulated gradient (scaled by the global clip) and bump the version."""
        if self.saved:
            raise RuntimeError(f"stage {self.stage.index} steps with {len(self.saved)} micro-batches "
                               "still waiting for backward")
        step = self.stage.version + 1
        lr = self.supervised_lr if step <= self.supervised_steps else self.base_lr
        if self.lr_warmup_steps:
            lr *= min(1.0, step / self.lr_warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if grad_scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.stage.version = step

    def state(self) -> dict:
        return {"weights": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(),
                "version": self.stage.version}

    def load_state(self, state: dict) -> None:
        self.stage.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stage.version = int(state["version"])


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
        policy moves between them."""
        return self.train.optimizer_steps_per_batch > 1

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
        split = self._split(batch, self.train.minibatches_per_batch if sampled else 1)
        totals: dict[str, float] = {}
        reported: dict[str, int] = {}
        grad_norm = 0.0
        updates = 0
        micro_count = 0  # unique within the step: a peer keeps a step's micro-batches by id
        rows_seen: list[RowStats] = []
        for epoch in range(self.train.epochs_per_batch if sampled else 1):
            for rows, minibatch, micros in split:
                counts = LossInputs(None, None, minibatch.num_policy_sequences,
                                    minibatch.num_target_tokens, minibatch.num_supervised_tokens)
                micro_batches = []
                for micro_slice, micro in micros:
                    micro_batches.append((micro_count, micro, replace(
                        counts, proximal=_rows(proximal, rows, micro_slice),
                        reference=_rows(reference, rows, micro_slice))))
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
        # Minibatches are disjoint slices in order: the first pass's micro-batches' rows are the
        # batch's.
        self.row_stats = (torch.cat([r[0].float().cpu() for r in rows_seen]),
                          torch.cat([r[1].float().cpu() for r in rows_seen]))
        result = {key: value / reported[key] for key, value in totals.items()}
        result["grad_norm"] = grad_norm / updates
        return result

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

    def save(self, root: Path, extra: dict) -> Path:
        """Write a checkpoint of every stage at this version under `root` (a CheckpointLayout),
        then put it in charge."""
        return write_checkpoint(root, self.version, {t.stage.index: t.state()
                                                     for t in self.stage_trainers}, extra)

    def load(self, root: Path) -> dict:
        """Load the checkpoint in charge under `root`; a bad checkpoint changes nothing."""
        info, states = read_checkpoint(root, [t.stage.index for t in self.stage_trainers],
                                       self.device)
        for trainer, state in zip(self.stage_trainers, states, strict=True):
            trainer.load_state(state)
        return info


def _rows(per_token: torch.Tensor | None, minibatch: slice, micro: slice) -> torch.Tensor | None:
    """The rows of a whole-batch [B, C] tensor that belong to one micro-batch of a minibatch."""
    return None if per_token is None else per_token[minibatch][micro]
