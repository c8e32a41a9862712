"""The tests a mixture-of-experts family passes on top of conformance.py's: its checkpoint read
in either form transformers reads (per expert, fused) and sharded, each stage reading only its
layers' experts; routing recorded through the stage (a plain forward, the KV cache, batched
sessions) and replayed exactly, the recorded experts kept after the weights change, malformed
routing refused; LoRA refusing the experts; and the learner replaying the routing generation
recorded, so its log-probs are the behaviour's.

A family's test class inherits `MoEConformance` beside `Conformance`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from decentrl.config import LORA_TARGETS
from decentrl.learn.batch import build_batch
from decentrl.learn.stage_trainer import stage_forward
from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import read_tensors, tensor_names
from decentrl.model.lora import MLP_TARGETS, add_lora
from decentrl.model.moe import FREE_ROUTE, RoutingReplayError, SparseMoE
from decentrl.model.run_stage import stage_tensor_names
from decentrl.model.stages import SessionStep, StageModule, StagePlan, build_stage
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate, rollout_group
from decentrl.rollout.sampling import SamplingConfig, sampling_logprobs
from tests.unit.model.families.conformance import (
    CPU,
    PREFILL,
    TOLERANCE,
    Family,
    chain_logits,
    padded_batch,
    relative_difference,
)


def routed_chain(stages: list[StageModule], ids: torch.Tensor, valid: torch.Tensor,
                 replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, T, vocab] of one forward through the stages, and the model's routing
    [B, T, sparse layers, top_k]; `replay` (the same shape) replayed."""
    positions, x, records = positions_from_valid(valid), ids, []
    with torch.no_grad():
        for stage in stages:
            own = None if replay is None else stage.stage_routing(replay)
            x, experts = stage.forward_routed(x, positions, valid, replay=own)
            if experts is not None:
                records.append(experts)
    return x, torch.cat(records, dim=2)


def routers(stages: list[StageModule]) -> list[torch.nn.Parameter]:
    return [module.gate.weight for stage in stages for module in stage.modules()
            if isinstance(module, SparseMoE)]


def moved_routers(stages: list[StageModule], seed: int) -> list[StageModule]:
    """A copy of `stages` whose every router moved far (std 1): an update's routing change."""
    moved = copy.deepcopy(stages)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in routers(moved):
            weight.add_(torch.randn(weight.shape, generator=generator))
    return moved


class MoEConformance:
    """Mixture-of-experts tests, inherited by a family's test class."""

    @pytest.mark.parametrize("fused", [False, True])
    def test_each_stage_reads_its_experts_from_either_form_sharded(
            self, family: Family, tmp_path: Path, fused: bool) -> None:
        """transformers' own save in small shards, per expert (as it saves by default) or fused
        (its in-memory form): each stage reads only its layers' tensors, and the stages compute
        the logits of the stages built from the whole checkpoint."""
        folder = tmp_path / "saved"
        family.hf.save_pretrained(folder, max_shard_size="40KB", save_original_format=not fused)
        assert (folder / "model.safetensors.index.json").is_file()
        available = tensor_names(folder)
        assert any(name.endswith("experts.gate_up_proj") for name in available) == fused
        spec = family.model.spec
        plan = StagePlan.even(spec.num_layers, 3)
        stages = []
        for index in range(plan.num_stages):
            names = stage_tensor_names(spec, plan, index, available)
            layers = {int(name.split(".")[2]) for name in names if name.startswith("model.layers.")}
            assert layers == set(plan.layers(index))
            tensors = read_tensors(folder, names.__contains__)
            assert set(tensors) == names
            stages.append(build_stage(spec, plan, index, tensors, CPU, torch.float32))
        assert torch.equal(chain_logits(stages, family.ids, family.valid),
                           chain_logits(family.stages(3), family.ids, family.valid))

    def test_recorded_routing_replays_exactly(self, family: Family) -> None:
        """A forward's record, replayed, runs the same experts and gives the same logits bit for
        bit; the record names every sparse layer's top_k distinct experts."""
        stages = family.stages(2)
        logits, record = routed_chain(stages, family.ids, family.valid)
        spec = family.model.spec
        assert spec.moe is not None
        assert record.shape == (*family.ids.shape, len(spec.sparse_layers), spec.moe.top_k)
        assert record.dtype == spec.moe.routing_dtype
        assert bool(((record >= 0) & (record < spec.moe.num_experts)).all())
        replayed, again = routed_chain(stages, family.ids, family.valid, record)
        assert torch.equal(replayed, logits) and torch.equal(again, record)

    def test_kv_cache_records_the_routing_of_one_forward(self, family: Family) -> None:
        """Decoding step by step through the KV cache records, at every real position, the
        experts one forward over the whole rows chooses; replayed in that forward, the record
        gives the step-by-step logits."""
        stages = family.stages(2)
        ids, valid = family.ids, family.valid
        positions = positions_from_valid(valid)
        caches = [stage.new_cache(ids.shape[0], ids.shape[1]) for stage in stages]
        pieces, records = [], []
        with torch.no_grad():
            for start, end in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, ids.shape[1])]:
                x, chunk = ids[:, start:end], []
                for stage, cache in zip(stages, caches):
                    x, experts = stage.forward_routed(x, positions[:, start:end],
                                                      valid[:, :end], cache)
                    if experts is not None:
                        chunk.append(experts)
                pieces.append(x)
                records.append(torch.cat(chunk, dim=2))
        stepped, record = torch.cat(pieces, dim=1), torch.cat(records, dim=1)
        whole, free = routed_chain(stages, ids, valid)
        assert torch.equal(record[valid], free[valid])
        replayed, _ = routed_chain(stages, ids, valid, record)
        assert relative_difference(replayed[valid], stepped[valid]) <= TOLERANCE
        assert relative_difference(whole[valid], stepped[valid]) <= TOLERANCE

    def test_batched_sessions_record_and_replay_as_alone(self, family: Family) -> None:
        """Sessions decoding together record the experts each records alone; a replay given to
        one session's step runs there, and the other session routes freely."""
        [stage] = family.stages(1)
        prompts = [padded_batch((7, 4), family.model.spec.vocab_size, seed=1),
                   padded_batch((5,), family.model.spec.vocab_size, seed=2)]

        def opened() -> list[SessionStep]:
            """Each prompt's session after its prefill, and its next step."""
            steps = []
            for ids, valid in prompts:
                cache = stage.new_cache(ids.shape[0], ids.shape[1] + 1)
                positions = positions_from_valid(valid)
                stage.body(ids, positions, valid, cache)
                steps.append(SessionStep(ids[:, -1:], positions[:, -1:] + 1,
                                         torch.cat([valid, valid[:, -1:]], 1), cache))
            return steps

        with torch.no_grad():
            together = stage.body_sessions_routed(opened())
            alone = [stage.body_routed(step.inputs, step.positions, step.key_valid, step.cache)
                     for step in opened()]
            records = [routed.experts for routed in together]
            assert all(record is not None for record in records)
            for routed, one in zip(together, alone):
                assert one.experts is not None and torch.equal(routed.experts, one.experts)
            assert family.model.spec.moe is not None
            other = (records[0] + 1) % family.model.spec.moe.num_experts
            first, second = opened()
            replayed = stage.body_sessions_routed(
                [SessionStep(first.inputs, first.positions, first.key_valid, first.cache,
                             replay=other), second])
        assert torch.equal(replayed[0].experts, other)
        assert torch.equal(replayed[1].experts, records[1])

    def test_replay_after_a_weight_change_keeps_the_recorded_experts(self,
                                                                     family: Family) -> None:
        """Once the routers move, many tokens' own routing changes; replayed, every token runs
        the recorded experts (a replay with FREE_ROUTE rows lets those rows route freely)."""
        stages = family.stages(2)
        _, record = routed_chain(stages, family.ids, family.valid)
        moved = moved_routers(stages, seed=1)
        own_logits, own = routed_chain(moved, family.ids, family.valid)
        changed = (own.sort(-1).values != record.sort(-1).values).any(-1)
        assert float(changed.float().mean()) > 0.1
        replayed_logits, replayed = routed_chain(moved, family.ids, family.valid, record)
        assert torch.equal(replayed, record)
        assert relative_difference(replayed_logits, own_logits) > 100 * TOLERANCE
        partial = record.clone()
        partial[0] = FREE_ROUTE
        _, mixed = routed_chain(moved, family.ids, family.valid, partial)
        assert torch.equal(mixed[0], own[0]) and torch.equal(mixed[1:], record[1:])

    @pytest.mark.parametrize(("make", "message"), [
        (lambda r: r[:, :, :-1], r"needs \[3, 14, \d+, top_k\]"),
        (lambda r: r[:, 1:], r"needs \[3, 14, \d+, top_k\]"),
        (lambda r: r.float(), r"integer expert indices"),
        (lambda r: r[..., :1], r"top_k=2"),
        (lambda r: r.index_fill(-1, torch.tensor([0]), 99), r"names expert 99"),
        (lambda r: r.index_fill(-1, torch.tensor([1]), 0).index_fill(
            -1, torch.tensor([0]), 0), r"twice for token"),
    ])
    def test_malformed_routing_is_refused(self, family: Family, make: Any,
                                          message: str) -> None:
        [stage] = family.stages(1)
        _, record = routed_chain([stage], family.ids, family.valid)
        with pytest.raises(RoutingReplayError, match=message):
            stage.body(family.ids, positions_from_valid(family.valid), family.valid,
                       replay=make(record))

    def test_lora_adapts_no_expert(self, family: Family) -> None:
        """An expert takes no adapter: MLP targets adapt the dense layers only, and are refused
        by a model whose every MLP is a mixture of experts."""
        spec = family.model.spec
        [stage] = family.stages(1)
        if len(spec.sparse_layers) == spec.num_layers:
            with pytest.raises(ValueError, match=r"experts, whose 3-D weights take no adapter"):
                add_lora(stage, 2, 4.0, MLP_TARGETS, seed=0)
            return
        add_lora(stage, 2, 4.0, LORA_TARGETS, seed=0)
        adapted = {name.split(".")[1] for name, _ in stage.named_parameters()
                   if name.endswith("mlp.down_proj.lora_a")}
        assert {int(layer) for layer in adapted} == set(range(spec.num_layers)) - \
            spec.sparse_layers
        assert not any(p.requires_grad for p in routers([stage]))

    def test_learner_replays_the_generated_routing(self, family: Family) -> None:
        """Generation records each completion token's experts; the learner's forward (moved
        routers) runs exactly those, and with the sampler's weights its log-probs are the
        behaviour's."""
        chain = LocalChain(family.stages(2))
        sampling = SamplingConfig()
        vocab = family.model.spec.vocab_size
        prompts = [[5, 9, 11, 7, 3], [12, 4, 8]]
        generations = generate(chain, prompts, 6, sampling, set(), 0, seed=3,
                               record_routing=True)
        rollouts = [rollout for prompt, rows in zip(prompts, ([g] for g in generations))
                    for rollout in rollout_group("g", "t", 0, prompt, rows, 0).rollouts]
        assert all(r.routing is not None for r in rollouts)
        batch = build_batch(rollouts, [1.0, -1.0], [0, 0], 0, routing=True)
        assert batch.routing is not None
        assert bool((batch.routing[:, -1] == FREE_ROUTE).all())  # the last token: unread
        assert bool((batch.routing[:, :-1] != FREE_ROUTE).all())
        assert int(batch.completions.max()) < vocab

        def learner_logprobs(stages: list[StageModule]) -> torch.Tensor:
            x: Any = (batch.prompts, batch.completions)
            with torch.no_grad():
                for stage in stages:
                    x = stage_forward(stage, x, batch)
            return sampling_logprobs(x, batch.completions[batch.completion_valid], sampling)

        behaviour = batch.behaviour_logprobs[batch.completion_valid]
        assert float((learner_logprobs(chain.stages) - behaviour).abs().max()) < 1e-4
        moved = moved_routers(chain.stages, seed=2)
        modules = [m for stage in moved for m in stage.modules() if isinstance(m, SparseMoE)]
        calls: dict[int, list[torch.Tensor]] = {k: [] for k in range(len(modules))}
        hooks = [module.register_forward_hook(
                     lambda _module, _inputs, out, k=k: calls[k].append(out.experts))
                 for k, module in enumerate(modules)]
        learner_logprobs(moved)
        for hook in hooks:
            hook.remove()
        # Each sparse layer runs on the prompts, then on the completions: its second call.
        completions = torch.stack([calls[k][1] for k in range(len(modules))], dim=2)
        assert torch.equal(completions[:, :-1], batch.routing[:, :-1])
