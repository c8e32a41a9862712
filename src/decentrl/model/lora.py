"""LoRA: train only low-rank adapters next to frozen projections, publish only those, and fold them
into the weights for export.

A projection y = x W^T + b becomes y = x W^T + b + (x A^T) B^T * alpha / rank, A [rank, in] and
B [out, rank]. B starts at zero, so a fresh adapter leaves the model exactly as it was; A starts
random (PEFT's init), so the first gradient of B is not zero.

Names: `LoRALinear` keeps the frozen projection's `weight` and `bias` as its own parameters, so a
LoRA stage's state dict holds the same base names as a plain stage (they map to Hugging Face names
unchanged) plus `...<proj>.lora_a` and `...<proj>.lora_b`. `merge_lora` turns a LoRA stage back into
a plain one, state dict and all.

Mixture of experts: an expert's weights are slices of 3-D tensors (model/moe.py), not
projections, so they take no adapter. On such a model the attention projections of every layer
and the MLP projections of its dense layers (Qwen3-MoE's `mlp_only_layers`) are adapted; MLP
targets on a model whose every MLP is a mixture of experts (Mixtral) would adapt nothing, and are
refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decentrl.config import (
    FUSED_LORA_TARGETS,
    LORA_TARGET_NAMES,
    LORA_TARGETS,
    check_lora_targets,
)
from decentrl.model.blocks import DecoderLayer
from decentrl.model.moe import SparseMoE
from decentrl.model.quant import dequantize_rows, quantize_rows
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StageModule

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def check_expert_targets(spec: ModelSpec, targets: Sequence[str]) -> None:
    """A ValueError naming the MLP targets of a model whose every MLP is a mixture of experts:
    its experts' 3-D weights cannot take adapters, so those targets would adapt nothing."""
    mlp = [target for target in targets if target in MLP_TARGETS]
    if mlp and len(spec.sparse_layers) == spec.num_layers:
        attention = [target for target in LORA_TARGETS if target not in MLP_TARGETS]
        raise ValueError(f"LoRA targets {mlp} are {spec.model_type}'s experts, whose 3-D weights "
                         f"take no adapter (every layer's MLP is a mixture of experts); target "
                         f"attention projections only: train.lora_targets = {attention}")


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float,
                 generator: torch.Generator, dtype: torch.dtype | None = None,
                 int8: bool = False) -> None:
        """`dtype`: the adapters' (default: the base's). `int8`: hold the frozen weight as int8
        with a scale per row (model/quant.py), `weight` and `weight_scale` in the state dict."""
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.scale = rank, alpha / rank
        adapter_dtype = dtype or base.weight.dtype
        self.int8 = int8
        if int8:
            values, row_scale = quantize_rows(base.weight)
            self.weight = nn.Parameter(values, requires_grad=False)
            self.register_buffer("weight_scale", row_scale)
        else:
            # The base's own Parameter objects: no copy, and the state dict names stay those of
            # a plain projection.
            self.weight = base.weight
        self.register_parameter("bias", base.bias)
        # PEFT's init, kaiming_uniform_(a=sqrt(5)), is uniform in +-1/sqrt(in_features). Drawn in
        # fp32 on the CPU from `generator`, so the adapters are the same on every device.
        bound = 1.0 / math.sqrt(self.in_features)
        a = (torch.rand(rank, self.in_features, generator=generator) * 2 - 1) * bound
        device, dtype = base.weight.device, adapter_dtype
        self.lora_a = nn.Parameter(a.to(device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))

    def _apply(self, fn: Any, recurse: bool = True) -> LoRALinear:
        # The int8 scales stay fp32 whatever dtype the module is cast to: every peer computes
        # the same weight from them (model/quant.py). They follow the weight's device.
        scale = self._buffers.pop("weight_scale", None)
        try:
            super()._apply(fn, recurse)
        finally:
            if scale is not None:
                self._buffers["weight_scale"] = scale.to(self.weight.device)
        return self

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The frozen weight as the forward uses it, in `dtype`."""
        if self.int8:
            return dequantize_rows(self.weight, self.weight_scale, dtype)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.base_weight(x.dtype), self.bias)
        # Two thin matmuls, never the dense B @ A: rank << in, out.
        return base + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def merged(self) -> nn.Linear:
        """The plain projection with the update folded into its weight (in place)."""
        with torch.no_grad():
            # fp32 math, one rounding to the weight's dtype at the end (an int8 base: the
            # adapters' dtype).
            update = (self.lora_b.float() @ self.lora_a.float()) * self.scale
            merged = self.base_weight(torch.float32) + update
            if self.int8:
                weight = nn.Parameter(merged.to(self.lora_a.dtype), requires_grad=False)
            else:
                self.weight.copy_(merged.to(self.weight.dtype))
                weight = self.weight
        with torch.device("meta"):  # allocates nothing; the parameters are set just below
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight, linear.bias = weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, scale={self.scale:g}")


def adapter_generator(seed: int, layer: int, target: str) -> torch.Generator:
    """The generator of one projection's A. Seeded by the layer's index in the whole model (not
    the stage's) and the projection's name, so every adapter differs, and none depends on how the
    model is split into stages or on which other projections have adapters."""
    return torch.Generator().manual_seed(
        (seed * 2**16 + layer) * len(LORA_TARGET_NAMES) + LORA_TARGET_NAMES.index(target))


def layer_projections(layer: DecoderLayer) -> dict[str, nn.Module]:
    """The projections of `layer` that can carry an adapter, by name -> the block holding it."""
    return {name: block for block in (layer.self_attn, layer.mlp) for name in LORA_TARGET_NAMES
            if isinstance(getattr(block, name, None), (nn.Linear, LoRALinear))}


def resolve_targets(layer: DecoderLayer, targets: Sequence[str], model_type: str
                    ) -> tuple[str, ...]:
    """The projections of `layer` that `targets` (checked names) put adapters on. A projection
    the family fuses (Phi-3's qkv_proj) is targeted by its name or by all of its parts (so the
    default, every projection, fits every family); one part alone, or a projection the family
    does not have, is refused with what it has."""
    has = layer_projections(layer)
    resolved: list[str] = []
    for target in targets:
        fused = next((name for name, parts in FUSED_LORA_TARGETS.items()
                      if target in parts and name in has), None)
        if target in has:
            name = target
        elif fused is not None:
            parts = FUSED_LORA_TARGETS[fused]
            if not set(parts) <= set(targets):
                raise ValueError(
                    f"LoRA target {target!r}: {model_type} fuses {', '.join(parts)} into one "
                    f"projection, {fused}, whose adapter covers them all; target {fused!r} (or "
                    f"all of {list(parts)})")
            name = fused
        else:
            raise ValueError(f"LoRA target {target!r}: {model_type} has no such projection; its "
                             f"projections are {list(has)}")
        if name not in resolved:
            resolved.append(name)
    return tuple(resolved)


def add_lora(stage: StageModule, rank: int, alpha: float, targets: Sequence[str],
             seed: int, dtype: torch.dtype | None = None, int8: bool = False) -> None:
    """Wrap the `targets` projections of every layer of `stage` in adapters (a sparse layer's
    attention projections only, in `dtype`, default the base's; `int8`: the wrapped frozen
    weights held in int8, model/quant.py) and freeze every other parameter of the stage
    (embedding, norms, head, routers and experts included)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha}")
    targets = check_lora_targets(tuple(targets))
    check_expert_targets(stage.spec, targets)
    if has_lora(stage):
        raise ValueError(f"stage {stage.index} already has LoRA adapters")
    for layer_id, layer in zip(stage.layer_ids, stage.layers):
        assert isinstance(layer, DecoderLayer)
        projections = layer_projections(layer)
        if isinstance(layer.mlp, SparseMoE):  # an expert's projections: no adapter (docstring)
            layer_targets = tuple(target for target in targets if target not in MLP_TARGETS)
        else:
            layer_targets = targets
        for target in resolve_targets(layer, layer_targets, stage.spec.model_type):
            block = projections[target]
            generator = adapter_generator(seed, layer_id, target)
            setattr(block, target, LoRALinear(getattr(block, target), rank, alpha, generator,
                                              dtype, int8))
    for name, param in stage.named_parameters():
        param.requires_grad_(name.endswith(ADAPTER_SUFFIXES))


def has_lora(stage: StageModule) -> bool:
    return any(isinstance(module, LoRALinear) for module in stage.modules())


def lora_tensors(stage: StageModule) -> dict[str, torch.Tensor]:
    """The adapter tensors of `stage` under their state dict names, sharing the parameters'
    storage (empty without LoRA)."""
    return {name: tensor for name, tensor in stage.state_dict().items()
            if name.endswith(ADAPTER_SUFFIXES)}


def merge_lora(stage: StageModule) -> None:
    """Fold every adapter into its base weight and put the plain projection back, so `stage` is a
    plain stage again (its parameters keep their requires_grad flags)."""
    wrapped = [name for name, module in stage.named_modules() if isinstance(module, LoRALinear)]
    for name in wrapped:
        parent_name, _, attribute = name.rpartition(".")
        parent = stage.get_submodule(parent_name)
        lora = getattr(parent, attribute)
        setattr(parent, attribute, lora.merged())

