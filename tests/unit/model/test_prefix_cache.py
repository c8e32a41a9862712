"""The prefix cache of a stage peer (model/prefix_cache.py): sessions that start with a prompt
prefix an earlier session ran reuse its keys, values and outputs, and get what the plain prefill
gives: greedy decoding continues token for token the same, the values agree to bf16 rounding
(and the reused columns are the very bits the earlier session computed). Rows padded
differently in one session, hidden-state inputs (stage 1), weight changes, eviction under a
budget, and the inference service's first steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch
from swarm_helpers import tiny_run_config

from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import LoadedModel
from decentrl.model.prefix_cache import BLOCK_SIZE, PrefixCache
from decentrl.model.stages import StageCache, StageModule, StagePlan, build_stages
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import InferenceStep
from decentrl.rollout.generate import left_pad
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.inbound import InboundChecks
from decentrl.stage.inference import InferenceService

CPU = torch.device("cpu")
# The tiny model's character tokenizer: 3 blocks of shared prefix, then each problem's own text.
SYSTEM = "You are a calculator. Call <tool>(expr)</tool>, then answer. " * 2
PROBLEMS = ["What is 12+7?", "Compute 3*(4+5) and add 2.", "99-42=?"]
DECODE_STEPS = 6


def bf16_stages(model: LoadedModel, num_stages: int) -> list[StageModule]:
    plan = StagePlan.even(model.spec.num_layers, num_stages)
    return build_stages(model.spec, plan, model.tensors, CPU, torch.bfloat16)


def prompt(model: LoadedModel, problem: str) -> list[int]:
    return model.tokenizer(SYSTEM + problem)["input_ids"]


@dataclass
class Prefilled:
    valid: torch.Tensor  # [B, T]
    hidden: list[torch.Tensor]  # each stage's outputs [B, T, hidden]
    caches: list[StageCache]


def prefill(stages: list[StageModule], prefix_caches: list[PrefixCache] | None,
            model: LoadedModel, rows: list[list[int]]) -> Prefilled:
    """A session's first step through every stage: plain (`prefix_caches` None) or cached."""
    ids, valid = left_pad(rows, model.tokenizer.pad_token_id, CPU)
    positions = positions_from_valid(valid)
    x, hidden, caches = ids, [], []
    with torch.inference_mode():
        for index, stage in enumerate(stages):
            cache = stage.new_cache(len(rows), ids.shape[1] + DECODE_STEPS)
            x = (prefix_caches[index].prefill(x, positions, valid, cache) if prefix_caches
                 else stage.body(x, positions, valid, cache))
            hidden.append(x)
            caches.append(cache)
    return Prefilled(valid, hidden, caches)


def greedy(stages: list[StageModule], prefilled: Prefilled) -> torch.Tensor:
    """DECODE_STEPS greedy tokens [B, steps] continuing from the prefilled caches."""
    valid, x = prefilled.valid, prefilled.hidden[-1]
    position = positions_from_valid(valid)[:, -1:]
    tokens = []
    with torch.inference_mode():
        for _ in range(DECODE_STEPS):
            token = stages[-1].head(x[:, -1]).argmax(-1, keepdim=True)
            tokens.append(token)
            position, valid = position + 1, torch.cat([valid, torch.ones_like(token, dtype=torch.bool)], 1)
            x = token
            for stage, cache in zip(stages, prefilled.caches):
                x = stage.body(x, position, valid, cache)
    return torch.cat(tokens, 1)


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to bf16 rounding in a few places (SDPA's reduction order changes with the keys a
    call holds: see model/prefix_cache.py)."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def assert_same_as_plain(stages: list[StageModule], cached: Prefilled, plain: Prefilled) -> None:
    """Outputs and keys/values at every real position agree, and greedy decoding from both gives
    the same tokens."""
    valid = plain.valid
    for got, expected in zip(cached.hidden, plain.hidden):
        assert_close_bf16(got[valid], expected[valid])
    width = valid.shape[1]
    for got_cache, expected_cache in zip(cached.caches, plain.caches):
        assert got_cache.length == expected_cache.length == width
        for got, expected in zip(got_cache.layers, expected_cache.layers):
            for name in ("keys", "values"):
                held = getattr(got, name)[:, :, :width].transpose(1, 2)
                assert_close_bf16(held[valid], getattr(expected, name)[:, :, :width]
                                  .transpose(1, 2)[valid])
    assert torch.equal(greedy(stages, cached), greedy(stages, plain))


def test_a_session_reuses_the_prefix_an_earlier_session_computed(tiny_model: LoadedModel
                                                                 ) -> None:
    stages = bf16_stages(tiny_model, 1)
    [cache] = [PrefixCache(stage, 4096) for stage in stages]
    first, second = (prompt(tiny_model, problem) for problem in PROBLEMS[:2])
    shared = len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE  # whole blocks of the common text
    earlier = prefill(stages, [cache], tiny_model, [first, first])
    assert cache.reused_tokens == 0
    assert cache.computed_tokens == len(first)  # the repeated row ran once
    assert cache.held_tokens == len(first) // BLOCK_SIZE * BLOCK_SIZE

    later = prefill(stages, [cache], tiny_model, [second] * 3)
    assert cache.reused_tokens == shared
    assert cache.computed_tokens == len(first) + len(second) - shared
    # The reused columns are the earlier session's bits.
    assert torch.equal(later.hidden[0][:, :shared], earlier.hidden[0][:1, :shared].expand(3, -1, -1))
    for got, stored in zip(later.caches[0].layers, earlier.caches[0].layers):
        assert torch.equal(got.keys[:, :, :shared], stored.keys[:1, :, :shared].expand(3, -1, -1, -1))
    assert_same_as_plain(stages, later, prefill(stages, None, tiny_model, [second] * 3))


def test_rows_padded_differently_in_one_session(tiny_model: LoadedModel) -> None:
    """A session of several groups left-pads each prompt to the longest: a row's blocks start at
    its first real column, so every row finds the shared prefix, and its padding columns (which
    see only themselves) are computed apart."""
    stages = bf16_stages(tiny_model, 1)
    [cache] = [PrefixCache(stage, 4096) for stage in stages]
    prompts = [prompt(tiny_model, problem) for problem in PROBLEMS]
    prefill(stages, [cache], tiny_model, [prompts[0]])
    rows = [prompts[1], prompts[2], prompts[1], prompts[0]]
    assert len({len(row) for row in rows}) == 3
    reused_before = cache.reused_tokens
    cached = prefill(stages, [cache], tiny_model, rows)
    assert cache.reused_tokens - reused_before > 0
    plain = prefill(stages, None, tiny_model, rows)
    assert_same_as_plain(stages, cached, plain)
    # The padding columns' outputs too (a next stage takes them as its inputs there).
    assert_close_bf16(cached.hidden[0], plain.hidden[0])


def test_hidden_state_inputs_at_a_later_stage(tiny_model: LoadedModel) -> None:
    """Stage 1's inputs are stage 0's outputs, hashed as bits: they repeat as the prompts do
    because stage 0 hands on the very bits it reused."""
    stages = bf16_stages(tiny_model, 2)
    caches = [PrefixCache(stage, 4096) for stage in stages]
    first, second = (prompt(tiny_model, problem) for problem in PROBLEMS[:2])
    prefill(stages, caches, tiny_model, [first] * 2)
    cached = prefill(stages, caches, tiny_model, [second] * 2)
    shared = len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE
    assert [c.reused_tokens for c in caches] == [shared, shared]
    assert_same_as_plain(stages, cached, prefill(stages, None, tiny_model, [second] * 2))


def test_new_weights_empty_the_cache(tiny_model: LoadedModel) -> None:
    [stage] = bf16_stages(tiny_model, 1)
    cache = PrefixCache(stage, 4096)
    rows = [prompt(tiny_model, PROBLEMS[0])]
    prefill([stage], [cache], tiny_model, rows)
    stage.version += 1
    prefill([stage], [cache], tiny_model, rows)
    assert cache.reused_tokens == 0
    prefill([stage], [cache], tiny_model, rows)
    assert cache.reused_tokens > 0
    # Weights written in place under the same version number (a rollback's state reuses it):
    # the cached prefix is no longer theirs.
    reused = cache.reused_tokens
    with torch.no_grad():
        stage.layers[0].mlp.up_proj.weight.mul_(2)
    later = prefill([stage], [cache], tiny_model, rows)
    assert cache.reused_tokens == reused
    assert_same_as_plain([stage], later, prefill([stage], None, tiny_model, rows))


def test_the_budget_holds_and_the_least_recently_used_leaf_goes_first(tiny_model: LoadedModel
                                                                      ) -> None:
    [stage] = bf16_stages(tiny_model, 1)
    cache = PrefixCache(stage, 3 * BLOCK_SIZE + 5)  # three blocks
    # Two prompts with nothing in common, two blocks each.
    one = tiny_model.tokenizer("a" * (2 * BLOCK_SIZE + 3))["input_ids"]
    two = tiny_model.tokenizer("b" * (2 * BLOCK_SIZE + 3))["input_ids"]
    prefill([stage], [cache], tiny_model, [one])
    assert cache.held_tokens == 2 * BLOCK_SIZE
    prefill([stage], [cache], tiny_model, [two])
    # The third block fit; the fourth evicted the least recently used one, the leaf of `one`'s
    # chain, not its root, which still serves.
    assert cache.held_tokens == 3 * BLOCK_SIZE
    prefill([stage], [cache], tiny_model, [one])
    assert cache.reused_tokens == BLOCK_SIZE
    assert cache.held_tokens <= 3 * BLOCK_SIZE
    # A chain longer than the whole budget keeps what fits and never evicts its own parents.
    long = tiny_model.tokenizer("c" * (5 * BLOCK_SIZE))["input_ids"]
    prefill([stage], [cache], tiny_model, [long])
    assert cache.held_tokens == 3 * BLOCK_SIZE
    reused = cache.reused_tokens
    prefill([stage], [cache], tiny_model, [long])
    assert cache.reused_tokens - reused == 3 * BLOCK_SIZE


def test_a_zero_budget_is_the_plain_prefill(tiny_model: LoadedModel) -> None:
    [stage] = bf16_stages(tiny_model, 1)
    cache = PrefixCache(stage, 0)
    rows = [prompt(tiny_model, PROBLEMS[0])] * 2
    prefill([stage], [cache], tiny_model, rows)
    off = prefill([stage], [cache], tiny_model, rows)
    assert not cache.enabled and cache.held_tokens == 0 and cache.reused_tokens == 0
    plain = prefill([stage], None, tiny_model, rows)
    assert torch.equal(off.hidden[0], plain.hidden[0])


def test_a_prefill_starts_a_session(tiny_model: LoadedModel) -> None:
    [stage] = bf16_stages(tiny_model, 1)
    cache = PrefixCache(stage, 4096)
    session = stage.new_cache(1, 8)
    ids, valid = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    session.length = 2
    with pytest.raises(ValueError, match="its cache holds 2 positions"):
        cache.prefill(ids, positions_from_valid(valid), valid, session)
    with pytest.raises(ValueError, match="capacity_tokens >= 0"):
        PrefixCache(stage, -1)


def test_the_inference_service_serves_first_steps_from_the_cache(tiny_model_dir: Path,
                                                                   tiny_model: LoadedModel
                                                                   ) -> None:
    """Through `InferenceService.infer` (no network): a second session's first step reuses the
    first's prefix, its sampled tokens are the plain prefill's, and the service counts both."""
    config = tiny_run_config(tiny_model_dir, 1, swarm={"prefix_cache_tokens": 4096})
    [stage] = bf16_stages(tiny_model, 1)
    checks = InboundChecks(tiny_model.spec, 0, 1, config.swarm.max_session_tokens)
    service = InferenceService(config, stage, cast(SwarmNode, None), checks)
    first, second = (prompt(tiny_model, problem) for problem in PROBLEMS[:2])
    sampling = SamplingConfig(temperature=0.0)

    def first_step(session: str, rows: list[list[int]]) -> torch.Tensor:
        ids, valid = left_pad(rows, tiny_model.tokenizer.pad_token_id, CPU)
        body = InferenceStep(session=session, start=0, batch=len(rows), max_length=256,
                             sampling=sampling, seed=1)
        reply = service.infer("caller", body, {"inputs": ids,
                                               "positions": positions_from_valid(valid),
                                               "key_valid": valid})
        return reply.tensors["tokens"]

    first_step("a", [first] * 2)
    assert service.prefix_cache.reused_tokens == 0
    assert service.prefix_cache.computed_tokens == len(first)
    tokens = first_step("b", [second] * 2)
    shared = len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE
    assert service.prefix_cache.reused_tokens == shared
    assert service.prefix_cache.computed_tokens == len(first) + len(second) - shared
    plain = prefill([stage], None, tiny_model, [second] * 2)
    with torch.inference_mode():
        expected = stage.head(plain.hidden[0][:, -1]).argmax(-1)
    assert torch.equal(tokens, expected)
