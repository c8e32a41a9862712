"""One stage of the training chain: `StageTrainer` owns a stage's fp32 master weights and its own
optimizer, and only ever sees activations in and gradients back, as a training peer does;
`StageWorker` is what the driver (learn/trainer.py) needs of any stage, local or remote."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Protocol

import torch

from decentrl.config import SupervisedConfig, TrainConfig
from decentrl.learn.batch import TrainBatch
from decentrl.learn.losses import LossConfig
from decentrl.learn.stage_loss import LossInputs, completion_logprobs, micro_batch_loss
from decentrl.model.prefix import predicting_hidden, shared_prompt_body
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StageModule
from decentrl.rollout.sampling import SamplingConfig

Activations = tuple[torch.Tensor, torch.Tensor]  # (prompt part, completion part)


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
            raise RuntimeError(f"stage {self.stage.index} steps with {len(self.saved)} "
                               "micro-batches still waiting for backward")
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
