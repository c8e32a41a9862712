"""Small helpers shared by the test files (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch

from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout
from decentrl.trust.verify import Layout

# The training tests' sampled batch: two completions of each question, one advantage per row.
SAMPLING = SamplingConfig(temperature=1.0)
MAX_NEW = 12
QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 * 34.", "2+2=?"]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.3, -0.3]


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


def sampled_rollouts(model: LoadedModel) -> list[Rollout]:
    """Two sampled completions for each of the QUESTIONS, prompts of different lengths."""
    prompts = [prompt for prompt in chat_prompts(model, QUESTIONS) for _ in range(2)]
    tokenizer = model.tokenizer
    generations = generate(LocalChain(build(model, 2)), prompts, MAX_NEW, SAMPLING,
                           {tokenizer.eos_token_id}, tokenizer.pad_token_id, 0)
    return [Rollout(prompt_tokens=p, completion_tokens=g.tokens, behaviour_logprobs=g.logprobs,
                    finished=g.finished) for p, g in zip(prompts, generations)]


def weights(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    """The whole model under Hugging Face names (copies)."""
    return {name: tensor.clone() for t in trainer.stage_trainers
            for name, tensor in t.stage.hf_state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@contextlib.contextmanager
def unanswered_peer_address(peer_id: str) -> Iterator[str]:
    """A full peer address on a loopback port that nothing listens on, held for the block."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        yield f"/ip4/127.0.0.1/tcp/{unused.getsockname()[1]}/p2p/{peer_id}"
