"""The conformance tests every family passes, against transformers' own forward in fp32: logits
of the model cut into 1 to 4 stages on a left-padded batch, decoding step by step through the KV
cache, peers' batched sessions of different lengths, LoRA on every projection, a sparse delta
round trip of each stage's state, and the export loaded back by transformers.

A family's test module defines a module-scoped `case` fixture (its FamilyCase, or several) and
imports the test functions from here; conftest.py builds the `family` they take from `case`.
The tiny model's every norm weight and bias is random (transformers initialises them to ones and
zeros), so a port that ignores one fails, and its weights are drawn with std 0.2 (not 0.02), so
attention is far from uniform and positions, windows and masks change the logits."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from decentrl.config import LORA_TARGETS
from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import LoadedModel, load_model, read_tensors
from decentrl.model.lora import MLP_TARGETS, LoRALinear, add_lora, layer_projections, merge_lora
from decentrl.model.prefix_cache import PrefixCache
from decentrl.model.run_stage import stage_tensor_names
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import (
    SessionStep,
    StageCache,
    StageModule,
    StagePlan,
    build_stage,
    build_stages,
)
from decentrl.model.tiny import make_tiny_model
from decentrl.release.export import export_hf_folder
from decentrl.sync.delta import (
    PublishedState,
    apply_payload,
    decode_payload,
    encode_delta,
    payload_bytes,
    state_hash,
)

CPU = torch.device("cpu")
# Max relative difference (largest absolute difference over the largest reference value) between
# our fp32 logits and transformers'; they differ only in the order of a few reductions.
TOLERANCE = 1e-5
ROW_LENGTHS = (14, 9, 3)  # a batch of rows this long, left-padded
PREFILL = 5  # columns the KV-cache test feeds at once before decoding one at a time
NUM_LAYERS = 4


@dataclass(frozen=True)
class FamilyCase:
    """A tiny model of one family: make_tiny_model's shape with `config` on top."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __str__(self) -> str:
        return self.name or self.model_type


@dataclass
class Family:
    """A tiny model of a family loaded both ways, and transformers' logits on a padded batch."""

    case: FamilyCase
    folder: Path
    model: LoadedModel
    hf: Any  # transformers' model of the folder, fp32
    ids: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]
    expected: torch.Tensor  # [B, T, vocab]: transformers' logits

    def stages(self, num_stages: int) -> list[StageModule]:
        plan = StagePlan.even(self.model.spec.num_layers, num_stages)
        return build_stages(self.model.spec, plan, self.model.tensors, CPU, torch.float32)


def randomise_norms_and_biases(folder: Path, seed: int) -> None:
    """Norm weights 1 + N(0, 0.5) and biases N(0, 0.5), rewritten into the folder's checkpoint."""
    path = folder / "model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(path)
    for name, tensor in tensors.items():
        noise = 0.5 * torch.randn(tensor.shape, generator=generator)
        if name.endswith(".bias"):
            tensors[name] = noise
        elif "norm" in name:
            tensors[name] = 1 + noise
    save_file(tensors, path, metadata={"format": "pt"})


def transformers_logits(hf: Any, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] of transformers' model `hf` on a left-padded batch."""
    with torch.no_grad():
        # generate() skips left padding in the positions as positions_from_valid does.
        return hf(input_ids=ids, attention_mask=valid.long(),
                  position_ids=positions_from_valid(valid)).logits


def padded_batch(lengths: tuple[int, ...], vocab: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [B, max(lengths)], each row left-padded to the longest, and its mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    valid = torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]
    return ids.masked_fill(~valid, 0), valid


def build_family(case: FamilyCase, folder: Path) -> Family:
    """The tiny model of `case` written to `folder`, loaded, and transformers' logits."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(folder, seed=7, num_layers=NUM_LAYERS, model_type=case.model_type,
                    **{"initializer_range": 0.2, **case.config})
    randomise_norms_and_biases(folder, seed=7)
    model = load_model(str(folder))
    ids, valid = padded_batch(ROW_LENGTHS, model.spec.vocab_size, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return Family(case, folder, model, hf, ids, valid, transformers_logits(hf, ids, valid))


def lora_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The projections LoRA adapts in this family: all seven, but only attention's when every
    MLP is a mixture of experts (its experts take no adapter: model/lora.py)."""
    if len(spec.sparse_layers) == spec.num_layers:
        return tuple(target for target in LORA_TARGETS if target not in MLP_TARGETS)
    return LORA_TARGETS


def relative_difference(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return float((ours - expected).abs().max() / expected.abs().max())


def chain_logits(stages: list[StageModule], ids: torch.Tensor, valid: torch.Tensor
                 ) -> torch.Tensor:
    """Logits [B, T, vocab] of one forward through the stages, without a cache."""
    positions, x = positions_from_valid(valid), ids
    with torch.no_grad():
        for stage in stages:
            x = stage(x, positions, valid)
    return x


def decode_sessions(stages: list[StageModule], prompts: list[tuple[torch.Tensor, torch.Tensor]],
                    fed: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
    """Each session's logits [B, steps, vocab] of decoding its `fed` tokens [B, steps] one at a
    time after its prompt (ids, valid): all sessions' steps through `body_sessions` together, or
    each session alone through `forward`."""
    caches: list[list[StageCache]] = []
    with torch.no_grad():
        for ids, valid in prompts:
            session = [stage.new_cache(ids.shape[0], ids.shape[1] + fed[0].shape[1])
                       for stage in stages]
            x = ids
            for stage, cache in zip(stages, session):
                x = stage.body(x, positions_from_valid(valid), valid, cache)
            caches.append(session)
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        for step in range(fed[0].shape[1]):
            xs = [tokens[:, step:step + 1] for tokens in fed]
            key_valid = [torch.cat([valid, torch.ones(valid.shape[0], step + 1, dtype=torch.bool)],
                                   1) for _, valid in prompts]
            at = [positions_from_valid(kv)[:, -1:] for kv in key_valid]
            for index, stage in enumerate(stages):
                steps = [SessionStep(x, pos, kv, session[index])
                         for x, pos, kv, session in zip(xs, at, key_valid, caches)]
                xs = stage.body_sessions(steps) if batched else \
                    [stage.body(s.inputs, s.positions, s.key_valid, s.cache) for s in steps]
            for session_logits, x in zip(logits, xs):
                session_logits.append(stages[-1].head(x))
    return [torch.cat(pieces, 1) for pieces in logits]


def stages_difference(family: Family, num_stages: int) -> float:
    """Our logits of the model cut into `num_stages` against transformers', over real positions
    (a padding query attends to itself here, to nothing in transformers)."""
    logits = chain_logits(family.stages(num_stages), family.ids, family.valid)
    return relative_difference(logits[family.valid], family.expected[family.valid])


def kv_cache_difference(family: Family) -> float:
    """Two stages prefilling PREFILL columns, then decoding one column at a time through their
    KV caches, against transformers' logits of the whole batch."""
    stages = family.stages(2)
    ids, valid = family.ids, family.valid
    positions = positions_from_valid(valid)
    caches = [stage.new_cache(ids.shape[0], ids.shape[1]) for stage in stages]
    pieces = []
    with torch.no_grad():
        for start, end in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, ids.shape[1])]:
            x = ids[:, start:end]
            for stage, cache in zip(stages, caches):
                x = stage(x, positions[:, start:end], valid[:, :end], cache)
            pieces.append(x)
    logits = torch.cat(pieces, dim=1)
    return relative_difference(logits[valid], family.expected[valid])


def batched_sessions_differences(family: Family) -> tuple[float, float]:
    """Two sessions of different lengths (two padded rows; one row) decoding three tokens
    together through body_sessions: the largest difference from each decoding alone, and from
    transformers' logits of the whole sequences."""
    vocab, steps = family.model.spec.vocab_size, 3
    prompts = [padded_batch((10, 6), vocab, seed=1), padded_batch((4,), vocab, seed=2)]
    generator = torch.Generator().manual_seed(3)
    fed = [torch.randint(3, vocab, (ids.shape[0], steps), generator=generator)
           for ids, _ in prompts]
    stages = family.stages(2)
    together = decode_sessions(stages, prompts, fed, batched=True)
    alone = decode_sessions(stages, prompts, fed, batched=False)
    versus_alone, versus_transformers = 0.0, 0.0
    for (ids, valid), tokens, got, one in zip(prompts, fed, together, alone):
        versus_alone = max(versus_alone, relative_difference(got, one))
        full_valid = torch.cat([valid, torch.ones_like(tokens, dtype=torch.bool)], 1)
        expected = transformers_logits(family.hf, torch.cat([ids, tokens], 1), full_valid)
        versus_transformers = max(versus_transformers,
                                  relative_difference(got, expected[:, -steps:]))
    return versus_alone, versus_transformers


@dataclass
class LoraLogits:
    """Two stages' logits without LoRA, with fresh adapters on every projection, with trained
    ones (random B), and with those merged into the weights."""

    adapters: int
    projections: int  # the projections of the stages' layers that can take an adapter
    plain: torch.Tensor
    fresh: torch.Tensor
    adapted: torch.Tensor
    merged: torch.Tensor


def lora_logits(family: Family) -> LoraLogits:
    plain = chain_logits(family.stages(2), family.ids, family.valid)
    stages = family.stages(2)
    projections = sum(len(layer_projections(layer)) for stage in stages for layer in stage.layers)
    for stage in stages:
        add_lora(stage, 2, 4.0, lora_targets(family.model.spec), seed=0)
    adapters = [m for stage in stages for m in stage.modules() if isinstance(m, LoRALinear)]
    fresh = chain_logits(stages, family.ids, family.valid)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for adapter in adapters:
            adapter.lora_b.copy_(0.5 * torch.randn(adapter.lora_b.shape, generator=generator))
    adapted = chain_logits(stages, family.ids, family.valid)
    merged = copy.deepcopy(stages)
    for stage in merged:
        merge_lora(stage)
    return LoraLogits(len(adapters), projections, plain, fresh, adapted,
                      chain_logits(merged, family.ids, family.valid))


def export_difference(family: Family, folder: Path) -> tuple[dict[str, Any], float]:
    """Three stages whose every weight moved (the head apart from the embedding), exported to
    `folder` and loaded by transformers: its loading info (missing, unexpected... tensors) and
    its logits' difference from ours."""
    from transformers import AutoModelForCausalLM

    stages = family.stages(3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for stage in stages:
            for param in stage.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    ours = chain_logits(stages, family.ids, family.valid)
    folder = export_hf_folder(stages, family.model.hf_config, family.model.tokenizer, folder)
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    output_loading_info=True)
    theirs = transformers_logits(hf.eval(), family.ids, family.valid)
    return info, relative_difference(theirs[family.valid], ours[family.valid])


class Conformance:
    """The conformance tests, inherited by each family's test class (test_<family>.py)."""

    @pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
    def test_logits_match_transformers(self, family: Family, num_stages: int) -> None:
        assert len(family.stages(num_stages)) == num_stages
        assert stages_difference(family, num_stages) <= TOLERANCE
        # Not vacuous: the logits differ between positions far beyond the tolerance.
        valid, expected = family.valid, family.expected
        spread = expected[valid].std(0).median() / expected[valid].abs().max()
        assert spread > 100 * TOLERANCE


    def test_kv_cache_decoding_matches_transformers(self, family: Family) -> None:
        assert kv_cache_difference(family) <= TOLERANCE


    def test_batched_sessions_match_each_alone_and_transformers(self, family: Family) -> None:
        """Two sessions holding different numbers of positions (one of two padded rows, one of a
        single row) decode together through body_sessions, as each does alone and as transformers
        computes the whole sequences."""
        versus_alone, versus_transformers = batched_sessions_differences(family)
        assert versus_alone <= TOLERANCE and versus_transformers <= TOLERANCE


    def test_each_stage_reads_only_its_tensors(self, family: Family) -> None:
        """A peer reads its stage's tensors (stage_tensor_names) and nothing else; the stages'
        names cover the checkpoint."""
        spec = family.model.spec
        plan = StagePlan.even(spec.num_layers, 3)
        wanted = [stage_tensor_names(spec, plan, index, family.model.tensors)
                  for index in range(plan.num_stages)]
        assert set().union(*wanted) == set(family.model.tensors)
        for index, names in enumerate(wanted):
            tensors = read_tensors(family.folder, names.__contains__)
            assert set(tensors) == names
            build_stage(spec, plan, index, tensors, CPU, torch.float32)

    def test_prefix_cache_reuses_a_shared_prefix(self, family: Family) -> None:
        """A session whose prompt shares its start with an earlier session's reuses that prefix's
        blocks, and its outputs are the plain prefill's."""
        [stage] = family.stages(1)
        ids, valid = family.ids[:1], family.valid[:1]
        positions, width = positions_from_valid(valid), ids.shape[1]
        prefix_cache = PrefixCache(stage, capacity_tokens=64, block_size=4)
        with torch.no_grad():
            prefix_cache.prefill(ids, positions, valid, stage.new_cache(1, width))
            changed = ids.clone()
            changed[:, -3:] = (changed[:, -3:] + 1) % family.model.spec.vocab_size
            hidden = prefix_cache.prefill(changed, positions, valid, stage.new_cache(1, width))
            plain = stage.body(changed, positions, valid, stage.new_cache(1, width))
        assert prefix_cache.reused_tokens >= 8
        assert relative_difference(hidden[valid], plain[valid]) <= TOLERANCE

    def test_lora_on_every_projection(self, family: Family) -> None:
        """A fresh adapter on each projection of every layer (the default targets: seven, or four
        where q/k/v and gate/up are fused; a sparse layer's attention projections only, since
        experts take none) changes nothing; trained (random B), it changes the logits, and
        merging it in computes what it computed."""
        lora = lora_logits(family)
        assert lora.adapters == lora.projections >= 4 * family.model.spec.num_layers
        assert torch.equal(lora.fresh, lora.plain)
        valid = family.valid
        assert relative_difference(lora.adapted[valid], lora.plain[valid]) > 100 * TOLERANCE
        assert relative_difference(lora.merged[valid], lora.adapted[valid]) <= TOLERANCE


    def test_sparse_delta_round_trip(self, family: Family) -> None:
        """Each stage's state (every family-specific tensor among it) goes through a sparse delta:
        encoded, decoded against the replica's shapes, applied; the replica then holds exactly the
        publisher's state, closer to the learner's than before, and loads into the stage."""
        generator = torch.Generator().manual_seed(0)
        for stage in family.stages(2):
            state = stage.state_dict()
            publisher, replica = PublishedState.of(0, state), PublishedState.of(0, state)
            learner = {name: t + 0.01 * torch.randn(t.shape, generator=generator)
                       for name, t in state.items()}
            data = payload_bytes(encode_delta(publisher, learner, density=0.5))
            shapes = {name: t.shape for name, t in state.items()}
            apply_payload(publisher, decode_payload(data, shapes), 1)
            apply_payload(replica, decode_payload(data, shapes), 1)
            assert {t.name for t in decode_payload(data, shapes).sparse} == set(state)
            assert state_hash(replica.tensors) == state_hash(publisher.tensors)
            for name, tensor in replica.tensors.items():
                assert (tensor - learner[name]).norm() < (state[name] - learner[name]).norm(), name
            stage.load_state_dict(replica.tensors, strict=True)


    def test_export_loads_in_transformers(self, family: Family, tmp_path: Path) -> None:
        """Stages whose every weight moved (the head apart from the embedding) export to a folder
        transformers loads without a missing or unexpected tensor, with our logits."""
        info, difference = export_difference(family, tmp_path / "export")
        assert not any(info.values()), info
        assert difference <= TOLERANCE
