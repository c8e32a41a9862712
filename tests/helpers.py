"""Small helpers shared by the test files (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

from decentrl.model.loading import LoadedModel
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.trust.verify import Layout


def build(model: LoadedModel, num_stages: int) -> list[StageModule]:
    """The model as `num_stages` fp32 stages on the CPU."""
    plan = StagePlan.even(model.spec.num_layers, num_stages)
    return build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)


def chat_prompts(model: LoadedModel, questions: list[str]) -> list[list[int]]:
    """Token ids of each question as a one-turn chat, ready for the assistant's answer."""
    return [model.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True)["input_ids"]
            for q in questions]


def layout_logits(stages: list[StageModule], layout: Layout) -> torch.Tensor:
    """The logits of one teacher-forced prefill over a verification layout."""
    with torch.inference_mode():
        x = layout.ids
        for stage in stages:
            x = stage.body(x, layout.positions, layout.valid)
        return stages[-1].head(x)
