"""Where a sparse MoE layer's tensors live in a Hugging Face checkpoint, and their translation to
and from SparseMoE's parameters.

transformers 5.23 writes, and the Hub's checkpoints hold, one matrix per expert and projection
(save_pretrained reverts its in-memory fusion by default):
  Qwen3-MoE  {layer}.mlp.gate.weight [E, H],
             {layer}.mlp.experts.{e}.gate_proj.weight / up_proj.weight [I, H],
             {layer}.mlp.experts.{e}.down_proj.weight [H, I]
  Mixtral    {layer}.block_sparse_moe.gate.weight [E, H],
             {layer}.block_sparse_moe.experts.{e}.w1.weight (gate) / w3.weight (up) [I, H],
             {layer}.block_sparse_moe.experts.{e}.w2.weight (down) [H, I]
from_pretrained also reads its in-memory form, which save_pretrained(save_original_format=False)
writes, for both families under `mlp`:
  {layer}.mlp.gate.weight [E, H], {layer}.mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then
  up rows), {layer}.mlp.experts.down_proj [E, H, I]
SparseMoE holds that fused form (names relative to the module: gate.weight, experts.gate_up_proj,
experts.down_proj). We read either form and export the per-expert one, which every reader takes.
`layer` is a decoder layer's checkpoint prefix, e.g. "model.layers.3"."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from decentrl.errors import DecentrlError
from decentrl.model.moe import MoESpec

ROUTER = "gate.weight"
GATE_UP = "experts.gate_up_proj"
DOWN = "experts.down_proj"
# Unexpected tensors listed in an error, at most.
LISTED = 5


class ExpertCheckpointError(DecentrlError, ValueError):
    """A checkpoint's tensors for a sparse MoE layer are missing, extra or of the wrong shape."""


@dataclass(frozen=True)
class CheckpointForm:
    """One layout of a layer's MoE tensors in a checkpoint."""

    name: str  # as messages call it
    module: str  # the MLP's name under the decoder layer
    projections: tuple[str, ...]  # per-expert (gate, up, down) names; () in the fused form


# Per family, the forms a checkpoint may take; the first is the one we export.
CHECKPOINT_FORMS: dict[str, tuple[CheckpointForm, ...]] = {
    "qwen3_moe": (CheckpointForm("per-expert", "mlp", ("gate_proj", "up_proj", "down_proj")),
                  CheckpointForm("fused", "mlp", ())),
    "mixtral": (CheckpointForm("per-expert", "block_sparse_moe", ("w1", "w3", "w2")),
                CheckpointForm("fused", "mlp", ())),
}


def export_form(spec: MoESpec) -> CheckpointForm:
    """The form checkpoint_tensors_of_experts writes: what save_pretrained writes."""
    return CHECKPOINT_FORMS[spec.family][0]


def checkpoint_names(spec: MoESpec, layer_prefix: str, form: CheckpointForm) -> list[str]:
    """Every checkpoint name of one layer's router and experts in `form`."""
    base = f"{layer_prefix}.{form.module}."
    names = [base + ROUTER]
    if not form.projections:
        return [*names, base + GATE_UP, base + DOWN]
    return names + [f"{base}experts.{expert}.{projection}.weight"
                    for expert in range(spec.num_experts) for projection in form.projections]


def checkpoint_form(spec: MoESpec, layer_prefix: str, available: Collection[str]
                    ) -> CheckpointForm:
    """The form of the layer's tensors among the checkpoint's `available` names. Refused: a
    layer with no complete form (missing experts, another family's names), and one with tensors
    under its MoE module the form lacks (shared experts, more experts than the config says)."""
    present = set(available)
    forms = CHECKPOINT_FORMS[spec.family]
    modules = tuple({f"{layer_prefix}.{form.module}." for form in forms})
    for form in forms:
        names = checkpoint_names(spec, layer_prefix, form)
        if present.issuperset(names):
            extra = sorted(present.difference(names).intersection(
                name for name in present if name.startswith(modules)))
            if extra:
                raise ExpertCheckpointError(
                    f"{layer_prefix} has {len(extra)} tensor(s) a {spec.family} MoE layer of "
                    f"{spec.num_experts} experts does not, e.g. {extra[:LISTED]} (shared experts "
                    "and extra experts are not supported)")
            return form
    closest = max(forms, key=lambda form: len(present.intersection(
        checkpoint_names(spec, layer_prefix, form))))
    missing = [name for name in checkpoint_names(spec, layer_prefix, closest)
               if name not in present]
    raise ExpertCheckpointError(
        f"the checkpoint lacks {len(missing)} tensor(s) of {layer_prefix}'s {spec.family} experts "
        f"(closest: the {closest.name} form), e.g. {missing[:LISTED]}")


def layer_checkpoint_names(spec: MoESpec, layer_prefix: str, available: Collection[str]
                           ) -> list[str]:
    """The names to read from the checkpoint for one layer's MoE (of `available`, the names
    the checkpoint holds: a sharded index's weight_map keys), so a stage reads only its own
    layers' experts."""
    return checkpoint_names(spec, layer_prefix, checkpoint_form(spec, layer_prefix, available))


def _shaped(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]
            ) -> torch.Tensor:
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise ExpertCheckpointError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; "
                                    f"the config makes it {shape}")
    return tensor


def expert_tensors_from_checkpoint(tensors: Mapping[str, torch.Tensor], layer_prefix: str,
                                   spec: MoESpec) -> dict[str, torch.Tensor]:
    """SparseMoE's state dict for one layer, from checkpoint `tensors` (any superset of the
    layer's, in either form), shapes checked against `spec`."""
    form = checkpoint_form(spec, layer_prefix, tensors.keys())
    base = f"{layer_prefix}.{form.module}."
    experts, hidden, inner = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    router = _shaped(tensors, base + ROUTER, (experts, hidden))
    if not form.projections:
        return {ROUTER: router,
                GATE_UP: _shaped(tensors, base + GATE_UP, (experts, 2 * inner, hidden)),
                DOWN: _shaped(tensors, base + DOWN, (experts, hidden, inner))}
    gate, up, down = form.projections
    gate_ups, downs = [], []
    for expert in range(experts):
        prefix = f"{base}experts.{expert}."
        gate_ups.append(torch.cat((_shaped(tensors, f"{prefix}{gate}.weight", (inner, hidden)),
                                   _shaped(tensors, f"{prefix}{up}.weight", (inner, hidden)))))
        downs.append(_shaped(tensors, f"{prefix}{down}.weight", (hidden, inner)))
    return {ROUTER: router, GATE_UP: torch.stack(gate_ups), DOWN: torch.stack(downs)}


def checkpoint_tensors_of_experts(state: Mapping[str, torch.Tensor], layer_prefix: str,
                                  spec: MoESpec) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors in the per-expert form save_pretrained writes, from
    SparseMoE's state dict. Each is its own copy: safetensors refuses tensors sharing storage."""
    form = export_form(spec)
    gate, up, down = form.projections
    base = f"{layer_prefix}.{form.module}."
    inner = spec.expert_intermediate_size
    gate_up, down_proj = state[GATE_UP].detach(), state[DOWN].detach()
    out = {base + ROUTER: state[ROUTER].detach().clone()}
    for expert in range(spec.num_experts):
        prefix = f"{base}experts.{expert}."
        out[f"{prefix}{gate}.weight"] = gate_up[expert, :inner].clone()
        out[f"{prefix}{up}.weight"] = gate_up[expert, inner:].clone()
        out[f"{prefix}{down}.weight"] = down_proj[expert].clone()
    return out
