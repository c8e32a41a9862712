"""Stage plans validate; a missing tensor is named; the head is untied from the embedding; a
session's first step runs each distinct row once; the KV cache overflows loudly; devices and
dtypes are picked as asked. (Each family's logits against transformers, cut into stages, with
padding, the KV cache, batched sessions, LoRA, deltas and the export: tests/unit/model/families.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import build

from decentrl.device import compute_dtype, pick_device
from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import LoadedModel
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.rollout.chain import last_position
from decentrl.rollout.generate import left_pad

CPU = torch.device("cpu")
# fp32 throughout; a prefill of distinct rows and one of the whole batch differ only in the order
# of a few reductions.
ATOL = 1e-5
QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 * 34, then add 5."]


def prompts(model: LoadedModel) -> list[list[int]]:
    """Chat prompts of different lengths, so the batch needs left padding."""
    return [model.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True)["input_ids"]
            for q in QUESTIONS]


def chain_logits(stages: list[StageModule], ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Logits [B, L, vocab] of a full forward through the stages, without a cache."""
    positions = positions_from_valid(valid)
    x = ids
    with torch.no_grad():
        for stage in stages:
            x = stage(x, positions, valid)
    return x


def test_even_plans() -> None:
    assert StagePlan.even(4, 1).starts == (0,)
    assert StagePlan.even(4, 2).starts == (0, 2)
    assert StagePlan.even(5, 2).starts == (0, 3)  # the extra layer goes to the first stage
    assert StagePlan.even(30, 4).starts == (0, 8, 16, 23)
    plan = StagePlan.even(7, 3)
    assert [list(plan.layers(i)) for i in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan.num_stages == 3
    for num_layers, num_stages in [(1, 1), (4, 4), (30, 7), (32, 5)]:
        plan = StagePlan.even(num_layers, num_stages)
        covered = [layer for i in range(num_stages) for layer in plan.layers(i)]
        assert covered == list(range(num_layers))
        sizes = [len(plan.layers(i)) for i in range(num_stages)]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("num_layers", "num_stages"), [(4, 0), (4, 5), (4, -1)])
def test_even_plan_rejects_impossible_splits(num_layers: int, num_stages: int) -> None:
    with pytest.raises(ValueError, match="num_stages"):
        StagePlan.even(num_layers, num_stages)


@pytest.mark.parametrize(("starts", "message"), [
    ((), "start at layer 0"),
    ((1, 2), "start at layer 0"),
    ((0, 2, 2), "at least one layer"),
    ((0, 3, 2), "at least one layer"),
    ((0, 4), "no layer for the last stage"),
])
def test_plan_validation(starts: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StagePlan(4, starts)


def test_plan_and_model_must_agree(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="stage 2 does not exist"):
        StagePlan.even(4, 2).layers(2)
    with pytest.raises(ValueError, match="covers 6 layers, the model has 4"):
        build_stages(tiny_model.spec, StagePlan.even(6, 2), tiny_model.tensors, CPU, torch.float32)


def test_missing_tensor_is_named(tiny_model: LoadedModel) -> None:
    tensors = dict(tiny_model.tensors)
    del tensors["model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.3.mlp.up_proj.weight.*stage 1"):
        build_stages(tiny_model.spec, StagePlan.even(4, 2), tensors, CPU, torch.float32)


def test_tied_head_is_an_untied_copy(tiny_model: LoadedModel) -> None:
    assert "lm_head.weight" not in tiny_model.tensors  # the tiny checkpoint is tied
    [stage] = build(tiny_model, 1)
    embed, head = stage.embed_tokens.weight, stage.lm_head.weight
    assert torch.equal(embed, head)
    assert embed.data_ptr() != head.data_ptr()
    optimizer = torch.optim.SGD([head], lr=0.1)
    head.grad = torch.ones_like(head)
    optimizer.step()
    assert torch.equal(embed, tiny_model.tensors["model.embed_tokens.weight"])
    assert torch.allclose(head, embed - 0.1)


def test_explicit_head_is_loaded(tiny_model: LoadedModel) -> None:
    """An untied checkpoint's head is its own; a tied one's is the embedding, as transformers
    loads it, even where the file also holds an lm_head.weight."""
    tensors = dict(tiny_model.tensors)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    untied = replace(tiny_model.spec, tie_word_embeddings=False)
    first, last = build_stages(untied, StagePlan.even(4, 2), tensors, CPU, torch.float32)
    assert torch.equal(last.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(first.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert first.lm_head is None and last.embed_tokens is None
    assert tiny_model.spec.tie_word_embeddings
    _, tied = build_stages(tiny_model.spec, StagePlan.even(4, 2), tensors, CPU, torch.float32)
    assert torch.equal(tied.lm_head.weight, tensors["model.embed_tokens.weight"])
    del tensors["lm_head.weight"]
    with pytest.raises(KeyError, match="no tensor 'lm_head.weight' needed by stage 1"):
        build_stages(untied, StagePlan.even(4, 2), tensors, CPU, torch.float32)


def test_the_kv_cache_overflows_loudly(tiny_model: LoadedModel) -> None:
    """A cache holds at most the positions it was opened for, rather than wrapping around."""
    [stage] = build(tiny_model, 1)
    ids, valid = left_pad(prompts(tiny_model), tiny_model.tokenizer.pad_token_id, CPU)
    cache = stage.new_cache(ids.shape[0], ids.shape[1])
    with torch.no_grad():
        stage(ids, positions_from_valid(valid), valid, cache)
        with pytest.raises(ValueError, match="KV cache overflow"):
            stage(ids[:, :1], positions_from_valid(valid)[:, -1:] + 1,
                  torch.ones(ids.shape[0], ids.shape[1] + 1, dtype=torch.bool), cache)


def test_a_sessions_first_step_runs_each_distinct_row_once(tiny_model: LoadedModel) -> None:
    """A group's rows share their prompt: the first step computes it once and copies its keys,
    values and outputs to the repeats; the cache then continues as if every row had run."""
    stages = build(tiny_model, 2)
    first, second = prompts(tiny_model)[:2]
    rows = [first, first, second, first]
    ids, valid = left_pad(rows, tiny_model.tokenizer.pad_token_id, CPU)
    positions = positions_from_valid(valid)
    batch_sizes: list[int] = []
    stages[1].layers[0].register_forward_hook(lambda module, args, out: batch_sizes.append(
        args[0].shape[0]))
    caches = [stage.new_cache(len(rows), ids.shape[1] + 1) for stage in stages]
    with torch.no_grad():
        x = ids
        for stage, cache in zip(stages, caches):
            x = stage(x, positions, valid, cache, head_positions=last_position(ids))
        assert batch_sizes == [2]  # the second stage's inputs repeat as the prompts do
        assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[3])
        full = chain_logits(stages, ids, valid)[:, -1]
        assert torch.allclose(x, full, atol=ATOL, rtol=0)
        # The next step feeds every row the same token, but their pasts differ: all rows run.
        token = torch.full((len(rows), 1), 5, dtype=torch.long)
        step_valid = torch.cat([valid, torch.ones(len(rows), 1, dtype=torch.bool)], 1)
        x = token
        batch_sizes.clear()
        for stage, cache in zip(stages, caches):
            x = stage(x, positions[:, -1:] + 1, step_valid, cache)
        assert batch_sizes == [len(rows)]
        extended = chain_logits(stages, torch.cat([ids, token], 1), step_valid)[:, -1]
        assert torch.allclose(x[:, -1], extended, atol=ATOL, rtol=0)


def test_key_valid_must_cover_cache_and_input(tiny_model: LoadedModel) -> None:
    [stage] = build(tiny_model, 1)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="key_valid covers 2 positions"):
        stage(ids, torch.arange(3)[None], torch.ones(1, 2, dtype=torch.bool))


def pretend_available(monkeypatch: pytest.MonkeyPatch, cuda: bool, mps: bool) -> None:
    """What torch reports about CUDA and Apple MPS, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.parametrize(("cuda", "mps", "picked"), [
    (True, True, "cuda"),
    (True, False, "cuda"),
    (False, True, "mps"),
    (False, False, "cpu"),
])
def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch: pytest.MonkeyPatch, cuda: bool,
                                            mps: bool, picked: str) -> None:
    pretend_available(monkeypatch, cuda, mps)
    assert pick_device("auto") == torch.device(picked)
    assert pick_device() == torch.device(picked)  # "auto" is the default


@pytest.mark.parametrize("name", ["cpu", "cuda", "mps"])
def test_an_explicit_device_is_honoured(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # Every backend available: "auto" would pick CUDA, a name is taken as it is.
    pretend_available(monkeypatch, cuda=True, mps=True)
    assert pick_device(name) == torch.device(name)


@pytest.mark.parametrize(("name", "message"), [
    ("cuda", "device 'cuda' was asked for but torch sees no CUDA device"),
    ("mps", "device 'mps' was asked for but this machine has no usable Apple MPS"),
])
def test_an_explicit_device_that_is_missing_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                       name: str, message: str) -> None:
    pretend_available(monkeypatch, cuda=False, mps=False)
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        pick_device(name)
    assert pick_device("cpu") == CPU


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cpu', 'cuda', "
                                         r"'mps'\), got 'tpu'"):
        pick_device("tpu")


@pytest.mark.parametrize(("capability", "auto"), [
    ("AVX512_BF16", torch.bfloat16),
    ("AMX", torch.bfloat16),
    ("AVX2", torch.float32),
    ("DEFAULT", torch.float32),
])
def test_compute_dtype_is_bf16_only_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch,
                                                         capability: str,
                                                         auto: torch.dtype) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert compute_dtype(CPU, "auto") == compute_dtype(CPU) == auto
    # An explicit dtype is taken as it is.
    assert compute_dtype(CPU, "fp32") == torch.float32
    assert compute_dtype(CPU, "bf16") == torch.bfloat16
    assert compute_dtype(CPU, "fp16") == torch.float16


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'bf16', 'fp32', "
                                         r"'fp16'\), got 'float64'"):
        compute_dtype(CPU, "float64")
