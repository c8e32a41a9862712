"""Stage plans that follow the peers: how many layers each stage gets, from the memory and the
speed of the peers that will hold it.

A pipeline runs at its slowest stage's pace, and a stage whose layers do not fit its peer's
memory does not run at all. So the planner gives each stage at least one layer and then hands
out the rest one at a time, each to the stage that would finish its share soonest with it
(layers / speed), among those whose peer still has room; greedy on the bottleneck, which is
optimal here because a stage's time grows with each layer it takes. Every stage's weights are
counted exactly (the model built on the meta device: embeddings on the first stage, the final
norm and head on the last, each layer's own size, mixtures of experts included), times what
each parameter costs the role: inference holds it in the compute dtype; full training an fp32
master copy, its gradient and AdamW's two moments besides; LoRA training the frozen base in its
dtype (the adapters are small and counted in the reserve). The planner says why each stage got
what it got: memory or speed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StageModule, StagePlan

GIB = 1024**3
# What a parameter costs each role, in bytes: the served copy in bf16; full training's fp32
# master, gradient and two AdamW moments, plus the bf16 copy it serves from; a LoRA run's frozen
# base in bf16 (int8: 1).
BYTES_PER_PARAMETER = {"inference": 2.0, "training": 18.0, "lora": 2.0, "lora-int8": 1.0}


class PlanError(ValueError):
    """No plan fits: the text names the stage and the bytes it lacks."""


@dataclass(frozen=True)
class StageHost:
    """What the peers of one stage offer: bytes of memory for the weights (after the runtime,
    activations and caches: `reserve_bytes` is taken off), and relative speed (layer-forwards a
    second, any unit the same across stages: announced tokens/s work)."""

    memory_bytes: int
    speed: float
    reserve_bytes: int = GIB // 2

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or not self.speed > 0 or self.reserve_bytes < 0:
            raise ValueError(f"a stage host needs memory > 0, speed > 0, reserve >= 0; got "
                             f"{self.memory_bytes}, {self.speed}, {self.reserve_bytes}")


@dataclass(frozen=True)
class PlanChoice:
    plan: StagePlan
    stage_bytes: tuple[int, ...]  # what each stage's weights take for the role
    reasons: tuple[str, ...]  # one line a stage

    def describe(self) -> str:
        return "\n".join(self.reasons)


def parameter_counts(spec: ModelSpec) -> tuple[int, int, list[int]]:
    """Parameters of the first stage's embeddings, of the last stage's norm and head, and of
    every layer (they differ in a mixture of experts), counted on the meta device."""
    with torch.device("meta"):
        whole = StageModule(spec, StagePlan.even(spec.num_layers, 1), 0)
    embed = whole.embed_tokens.weight.numel() if whole.embed_tokens is not None else 0
    head = sum(p.numel() for module in (whole.norm, whole.lm_head) if module is not None
               for p in module.parameters())
    return embed, head, [sum(p.numel() for p in layer.parameters()) for layer in whole.layers]


def plan_stages(spec: ModelSpec, hosts: Sequence[StageHost], role: str = "inference"
                ) -> PlanChoice:
    """The plan for `hosts` (one a stage, in order) holding `spec` as `role` (a key of
    BYTES_PER_PARAMETER); PlanError where the model does not fit them."""
    if role not in BYTES_PER_PARAMETER:
        raise ValueError(f"role {role!r} is not one of {sorted(BYTES_PER_PARAMETER)}")
    stages = len(hosts)
    if not 1 <= stages <= spec.num_layers:
        raise PlanError(f"{stages} stages for a {spec.num_layers}-layer model")
    cost = BYTES_PER_PARAMETER[role]
    embed, head, layers = parameter_counts(spec)
    fixed = [(embed if stage == 0 else 0) + (head if stage == stages - 1 else 0)
             for stage in range(stages)]
    room = [host.memory_bytes - host.reserve_bytes - cost * fixed[stage]
            for stage, host in enumerate(hosts)]

    def weight_bytes(stage: int, start: int, count: int) -> float:
        return cost * (fixed[stage] + sum(layers[start:start + count]))

    # Layers are handed out in order, so a stage's next layer is the one after its last: build
    # counts first (which stage takes how many), then check each stage's real layers.
    counts = [1] * stages
    capped = [False] * stages
    largest_first = sorted(layers, reverse=True)
    while sum(counts) < spec.num_layers:
        open_stages = [stage for stage in range(stages) if not capped[stage]]
        if not open_stages:
            break
        stage = min(open_stages, key=lambda s: ((counts[s] + 1) / hosts[s].speed, s))
        # One more layer must fit even if the stage gets the largest ones (experts differ).
        if cost * sum(largest_first[:counts[stage] + 1]) > room[stage]:
            capped[stage] = True
        else:
            counts[stage] += 1
    if sum(counts) < spec.num_layers:
        short = spec.num_layers - sum(counts)
        raise PlanError(f"the {stages} stages' memory holds {sum(counts)} of the model's "
                        f"{spec.num_layers} layers as {role}: {short} more need about "
                        f"{cost * max(layers) * short / GIB:.2f} GiB more, or more stages")
    plan = StagePlan.sized(spec.num_layers, counts)
    stage_bytes = tuple(int(weight_bytes(s, plan.starts[s], counts[s])) for s in range(stages))
    for stage, host in enumerate(hosts):
        if stage_bytes[stage] + host.reserve_bytes > host.memory_bytes:
            raise PlanError(f"stage {stage}'s {counts[stage]} layers take "
                            f"{stage_bytes[stage] / GIB:.2f} GiB as {role}, over its peer's "
                            f"{(host.memory_bytes - host.reserve_bytes) / GIB:.2f} GiB")
    total_speed = sum(host.speed for host in hosts)
    reasons = []
    for stage, host in enumerate(hosts):
        share = host.speed / total_speed
        why = (f"capped by memory: one more layer would not fit its "
               f"{host.memory_bytes / GIB:.1f} GiB" if capped[stage]
               else f"its speed's share is {share:.0%} of the pipeline's "
                    f"({share * spec.num_layers:.1f} layers)")
        span = plan.layers(stage)
        reasons.append(f"stage {stage}: layers {span.start}-{span.stop - 1} ({counts[stage]}), "
                       f"{stage_bytes[stage] / GIB:.2f} GiB of weights as {role}; {why}")
    return PlanChoice(plan, stage_bytes, tuple(reasons))
