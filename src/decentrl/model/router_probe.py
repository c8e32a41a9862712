"""How well a claimed routing matches a stage's routers: a spot-check re-executes a stage
(stage/verification.py) and asks, of every token and every sparse layer, how far the experts a
replica claimed fall short of the router's own top-k (model/moe.py `routing_gaps`).

The probe watches one forward through hooks on the stage's sparse MLPs, so the forward itself is
the one every peer runs (no argument threads through the layers for it). Each hook computes the
router logits again from the MLP's input, as `SparseMoE.route` does: a small matmul beside the
experts' work."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from decentrl.model.moe import SparseMoE, routing_gaps
from decentrl.model.stages import StageModule, distinct_rows


class RouterProbe:
    """A context over one forward of `stage`: afterwards, `gaps` scores a claimed routing of its
    positions against the router logits that forward saw."""

    def __init__(self, stage: StageModule) -> None:
        self.stage = stage
        self._moes = [layer.mlp for layer in stage.layers if isinstance(layer.mlp, SparseMoE)]
        self._logits: list[list[torch.Tensor]] = [[] for _ in self._moes]
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RouterProbe:
        for index, moe in enumerate(self._moes):
            self._hooks.append(moe.register_forward_hook(self._recorder(index)))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _recorder(self, index: int) -> Any:
        def record(moe: SparseMoE, args: tuple[Any, ...], output: Any) -> None:
            hidden = args[0]
            logits = moe.gate(hidden.reshape(-1, moe.spec.hidden_size)).float()
            self._logits[index].append(logits.reshape(*hidden.shape[:-1], -1))
        return record

    @property
    def router_logits(self) -> list[torch.Tensor]:
        """The watched forward's router logits, fp32, [rows it ran, T, experts] per sparse
        layer of the stage (rows: the distinct ones, where only those ran)."""
        if any(len(calls) != 1 for calls in self._logits):
            raise RuntimeError(f"the probe watches one forward; its layers saw "
                               f"{[len(calls) for calls in self._logits]}")
        return [calls[0] for calls in self._logits]

    def gaps(self, claimed: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor,
             key_valid: torch.Tensor) -> torch.Tensor:
        """[B, T]: per position, the largest `routing_gaps` over the stage's sparse layers of the
        `claimed` experts [B, T, sparse layers, top_k] (checked; FREE_ROUTE rows claim
        nothing), for the forward of `inputs`, `positions`, `key_valid` watched. A first step
        whose rows repeat ran each distinct row once (StageModule.body_routed): its logits go to
        every repeat."""
        batch, length = claimed.shape[:2]
        result = torch.zeros((batch, length))
        for layer, logits in enumerate(self.router_logits):
            if logits.shape[0] != batch:  # the distinct rows ran
                logits = logits[distinct_rows(inputs, positions, key_valid)[1]]
            chosen = claimed[:, :, layer].to(device=logits.device, dtype=torch.long)
            gaps = routing_gaps(logits.reshape(batch * length, -1),
                                chosen.reshape(batch * length, -1))
            result = torch.maximum(result, gaps.reshape(batch, length).cpu())
        return result
