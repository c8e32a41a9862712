"""The stage a run builds: exactly one stage's layers, read from the run's model folder (only its
own tensors), with the run's LoRA adapters when it trains only those. Peers build their stage
this way, and so does the export of a run's checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from decentrl.config import RunConfig
from decentrl.model.loading import (
    StoredTensors,
    check_tied_head,
    model_spec,
    require_tensors,
    resolve_model,
    stage_files,
    stage_tensor_names,
    tensor_names,
)
from decentrl.model.lora import add_lora
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import HEAD, StageModule, StagePlan, build_stage


@dataclass(frozen=True)
class StageSource:
    """What stage `index` of a run is read from: the model folder, its sizes and plan, and the
    checkpoint tensors the stage is built from (`names`; the head's stage of a tied model also
    reads any lm_head.weight, `tied_head`, to refuse one that differs)."""

    folder: Path
    spec: ModelSpec
    plan: StagePlan
    index: int
    names: frozenset[str]
    tied_head: frozenset[str]

    @classmethod
    def of(cls, config: RunConfig, index: int) -> StageSource:
        folder = resolve_model(config.model)
        spec = model_spec(folder)
        plan = StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
        names = stage_tensor_names(spec, plan, index, tensor_names(folder) if spec.moe else ())
        tied = spec.tie_word_embeddings and index == plan.num_stages - 1
        return cls(folder, spec, plan, index, frozenset(names),
                   frozenset({HEAD} if tied else ()))

    def files(self) -> list[Path]:
        """The model files the stage reads (model/loading.py stage_files)."""
        return stage_files(self.folder, self.names | self.tied_head)


def load_stage(config: RunConfig, index: int, device: torch.device, dtype: torch.dtype,
               frozen_dtype: torch.dtype | None = None) -> StageModule:
    """Stage `index` of the run's plan at version 0, in `dtype`. LoRA adapters are seeded by the
    run's seed: every peer of a stage builds the same ones. `frozen_dtype`: in a LoRA run, the
    dtype of the frozen base, the adapters alone taking `dtype` (a training peer's fp32 master
    holds its base in the compute dtype it would be cast to anyway, once)."""
    source = StageSource.of(config, index)
    tensors = StoredTensors(source.folder, (source.names | source.tied_head).__contains__)
    require_tensors(source.folder, set(source.names), tensors)
    check_tied_head(source.folder, source.spec, tensors)
    # Built from the stored tensors one at a time: the stage is never held twice.
    lora = config.train.lora_rank > 0
    base_dtype = frozen_dtype if lora and frozen_dtype is not None else dtype
    stage = build_stage(source.spec, source.plan, index, tensors, device, base_dtype)
    add_run_lora(stage, config, dtype)
    return stage


def stage_shapes(config: RunConfig, spec: ModelSpec, index: int) -> dict[str, torch.Tensor]:
    """Stage `index`'s state dict as the run trains it (LoRA adapters included), on the meta
    device: every tensor's shape and dtype, with nothing read or allocated."""
    with torch.device("meta"):
        stage = StageModule(spec, StagePlan.of(spec.num_layers, config.num_stages,
                                                  config.stage_layers), index)
    add_run_lora(stage, config)
    return stage.state_dict()


def add_run_lora(stage: StageModule, config: RunConfig, dtype: torch.dtype | None = None
                 ) -> None:
    """The run's LoRA adapters on `stage` (in `dtype`, default its base's), if it trains
    adapters only."""
    train = config.train
    if train.lora_rank > 0:
        add_lora(stage, train.lora_rank, train.lora_alpha, train.lora_targets, config.seed,
                 dtype, int8=train.lora_base == "int8")


def lora_serving_copy(config: RunConfig, learner: StageModule, dtype: torch.dtype
                      ) -> StageModule:
    """`learner`, a LoRA stage whose frozen base is in `dtype`, as a peer that trains it also
    serves or re-executes it: the very same frozen tensors and buffers (held once: the base
    never changes in a LoRA run) and its own copy of the adapters in `dtype` (the served ones
    lag the learner's by the versions in flight). Nothing of the base is allocated again, so a
    peer holds a model's slice once whatever roles it plays."""
    if config.train.lora_rank == 0:
        raise ValueError("only a LoRA stage's base can be shared between roles")
    with torch.device("meta"):
        copy = StageModule(learner.spec, learner.plan, learner.index)
        add_run_lora(copy, config, dtype)
    params, buffers = dict(learner.named_parameters()), dict(learner.named_buffers())
    for prefix, module in copy.named_modules():
        here = f"{prefix}." if prefix else ""
        for name in [n for n, p in module._parameters.items() if p is not None]:
            param = params[here + name]
            if param.requires_grad:  # an adapter
                module._parameters[name] = torch.nn.Parameter(param.detach().to(dtype).clone())
            else:
                if param.dtype not in (dtype, torch.int8):
                    raise ValueError(f"{here + name} is {param.dtype} in the learner, not the "
                                     f"serving {dtype}: load it with frozen_dtype={dtype}")
                module._parameters[name] = param
        for name in [n for n, b in module._buffers.items() if b is not None]:
            module._buffers[name] = buffers[here + name]
    copy.version = learner.version
    return copy
