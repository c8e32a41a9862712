"""The sparse MoE MLP is transformers' Qwen3-MoE and Mixtral block: same output in fp32, both
checkpoint forms load into it and its export loads back into transformers with equal logits;
its routing is recorded, replayed exactly, checked when it comes from a peer, and still trains
the router."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from decentrl.errors import SenderFault
from decentrl.model.moe import (
    ACTIVATIONS,
    FREE_ROUTE,
    MoESpec,
    RoutingReplayError,
    SparseMoE,
    UnsupportedMoEConfig,
    moe_spec_from_hf_config,
    sparse_layer_ids,
)
from decentrl.model.moe_checkpoint import (
    CHECKPOINT_FORMS,
    ExpertCheckpointError,
    checkpoint_names,
    checkpoint_tensors_of_experts,
    expert_tensors_from_checkpoint,
    layer_checkpoint_names,
)

FAMILIES = ["qwen3_moe", "mixtral"]
NUM_EXPERTS = 6
# The block against transformers' in fp32: both sum the same products in the same order; what
# is left is the matmul kernels' blocking (a few ulps).
RELATIVE = 1e-5


def hf_config(family: str, norm_topk_prob: bool = True, top_k: int = 3, **extra: Any) -> Any:
    """A tiny transformers config of `family`, built by its own config class."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    fields = {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
              "max_position_embeddings": 64, "num_experts_per_tok": top_k, "rms_norm_eps": 1e-5,
              **extra}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=8,
                              num_experts=NUM_EXPERTS, norm_topk_prob=norm_topk_prob, **fields)
    return MixtralConfig(intermediate_size=8, num_local_experts=NUM_EXPERTS, **fields)


def sharpen_(module: torch.nn.Module, seed: int) -> None:
    """Routers far from uniform (std 1: default init routes almost at random) and experts that
    move the output (std 0.3)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("mlp.gate.weight") or name == "gate.weight":
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            elif ".experts." in f".{name}":
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def hf_block(config: Any) -> torch.nn.Module:
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block_class = (Qwen3MoeSparseMoeBlock if config.model_type == "qwen3_moe"
                   else MixtralSparseMoeBlock)
    block = block_class(config).eval()
    sharpen_(block, seed=0)
    return block


def ours_like(block: torch.nn.Module, config: Any) -> SparseMoE:
    moe = SparseMoE(moe_spec_from_hf_config(config.to_dict()))
    moe.load_state_dict(block.state_dict(), strict=True)  # the same names as transformers'
    return moe.eval()


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach(), expected.detach()
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize(("family", "norm_topk_prob", "implementation"), [
    ("qwen3_moe", True, "eager"), ("qwen3_moe", False, "eager"), ("mixtral", True, "eager"),
    ("qwen3_moe", True, "grouped_mm"), ("qwen3_moe", False, "grouped_mm"),
    ("mixtral", True, "grouped_mm"),
])
def test_block_matches_transformers(family: str, norm_topk_prob: bool,
                                    implementation: str) -> None:
    config = hf_config(family, norm_topk_prob)
    # from_pretrained picks grouped_mm where it can; a block built alone runs the eager loop.
    config._experts_implementation = implementation
    block = hf_block(config)
    moe = ours_like(block, config)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)
        got = moe(x)
    assert got.hidden.shape == x.shape and got.experts.shape == (3, 7, 3)
    assert relative_difference(got.hidden, expected) < RELATIVE
    # Not vacuous: the routing uses every expert, and the weights' normalisation matters.
    assert got.experts.unique().numel() == NUM_EXPERTS
    flipped_spec = MoESpec(**{**vars(moe.spec), "norm_topk_prob": not norm_topk_prob})
    flipped_moe = SparseMoE(flipped_spec)
    flipped_moe.load_state_dict(moe.state_dict())
    with torch.no_grad():
        flipped = flipped_moe(x).hidden
    assert (relative_difference(flipped, expected) > 1e-2) == (family == "qwen3_moe")


@pytest.mark.parametrize(("family", "norm_topk_prob"),
                         [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_block_equals_transformers_eager_in_bf16(family: str, norm_topk_prob: bool) -> None:
    """Bit for bit, where the families round differently: Qwen3-MoE scales by routing weights
    rounded to bf16, Mixtral by fp32 ones."""
    config = hf_config(family, norm_topk_prob)
    config._experts_implementation = "eager"
    block = hf_block(config).to(torch.bfloat16)
    moe = ours_like(block, config).to(torch.bfloat16)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(moe(x).hidden, block(x))


def test_spec_reads_both_families() -> None:
    qwen = moe_spec_from_hf_config(hf_config("qwen3_moe", norm_topk_prob=False).to_dict())
    assert (qwen.family, qwen.hidden_size, qwen.expert_intermediate_size, qwen.num_experts,
            qwen.top_k, qwen.norm_topk_prob, qwen.renormalises, qwen.activation) == (
        "qwen3_moe", 16, 8, NUM_EXPERTS, 3, False, False, "silu")
    mixtral = moe_spec_from_hf_config(hf_config("mixtral", top_k=2).to_dict())
    assert (mixtral.expert_intermediate_size, mixtral.top_k, mixtral.renormalises) == (8, 2, True)
    # config.json may name the expert count either way (transformers maps one to the other).
    as_written = {**hf_config("mixtral").to_dict(), "num_local_experts": 5}
    as_written.pop("num_experts", None)
    assert moe_spec_from_hf_config(as_written).num_experts == 5
    assert qwen.routing_dtype == torch.int8
    assert MoESpec("qwen3_moe", 8, 4, 129, 8, True, "silu").routing_dtype == torch.int16


def test_sparse_layers_follow_transformers() -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = hf_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                       mlp_only_layers=[3])
    model = AutoModelForCausalLM.from_config(config)
    expected = {i for i, layer in enumerate(model.model.layers)
                if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)}
    assert sparse_layer_ids(config.to_dict()) == expected == {1, 5}
    assert sparse_layer_ids(hf_config("mixtral").to_dict()) == {0, 1, 2}
    assert sparse_layer_ids({"model_type": "llama", "num_hidden_layers": 4}) == frozenset()


def qwen2_moe_config() -> dict[str, Any]:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig().to_dict()


@pytest.mark.parametrize(("config", "message"), [
    (qwen2_moe_config, "qwen2_moe.*shared experts.*nearest supported"),
    (lambda: {**hf_config("qwen3_moe").to_dict(), "shared_expert_intermediate_size": 8},
     "shared experts"),
    (lambda: hf_config("mixtral", router_jitter_noise=0.1).to_dict(), "router_jitter_noise"),
    (lambda: hf_config("qwen3_moe", hidden_act="gelu_new").to_dict(),
     "activation 'gelu_new' is not supported"),
    (lambda: {**hf_config("mixtral").to_dict(), "num_experts_per_tok": 7},
     "num_experts_per_tok 7 exceeds"),
    (lambda: {**hf_config("qwen3_moe").to_dict(), "num_experts": 0}, "num_experts=0"),
    (lambda: {"model_type": "llama"}, "not a mixture-of-experts family"),
])
def test_unsupported_configs_are_refused(config: Any, message: str) -> None:
    with pytest.raises(UnsupportedMoEConfig, match=message):
        moe_spec_from_hf_config(config())


# --- checkpoints ------------------------------------------------------------------------------


@dataclass
class Saved:
    """A tiny model of a family, saved by transformers in both forms."""

    config: Any
    spec: MoESpec
    model: Any  # the transformers model
    per_expert: Path  # save_pretrained's default
    fused: Path  # save_pretrained(save_original_format=False)
    sparse: list[int]  # its sparse layers


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    from transformers import AutoModelForCausalLM

    family = request.param
    # Qwen3-MoE with a dense layer in the middle, as mlp_only_layers allows.
    extra = {"mlp_only_layers": [1]} if family == "qwen3_moe" else {}
    config = hf_config(family, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    sharpen_(model, seed=1)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder / "per-expert")
    model.save_pretrained(folder / "fused", save_original_format=False)
    sparse = sorted(sparse_layer_ids(config.to_dict()))
    return Saved(config, moe_spec_from_hf_config(config.to_dict()), model, folder / "per-expert",
                 folder / "fused", sparse)


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_save_pretrained_writes_per_expert_tensors(saved: Saved) -> None:
    per_expert, fused = CHECKPOINT_FORMS[saved.spec.family]
    written = set(tensors_of(saved.per_expert))
    written_fused = set(tensors_of(saved.fused))
    for layer in saved.sparse:
        prefix = f"model.layers.{layer}"
        assert set(checkpoint_names(saved.spec, prefix, per_expert)) <= written
        assert set(checkpoint_names(saved.spec, prefix, fused)) <= written_fused
    assert not any(name.endswith("gate_up_proj") for name in written)
    assert not any(".experts.0." in name for name in written_fused)


def test_both_forms_load_into_the_same_module(saved: Saved) -> None:
    per_expert, fused = tensors_of(saved.per_expert), tensors_of(saved.fused)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    for layer in saved.sparse:
        prefix = f"model.layers.{layer}"
        from_per_expert = expert_tensors_from_checkpoint(per_expert, prefix, saved.spec)
        from_fused = expert_tensors_from_checkpoint(fused, prefix, saved.spec)
        hf_mlp = saved.model.model.layers[layer].mlp
        for name, tensor in hf_mlp.state_dict().items():
            assert torch.equal(from_per_expert[name], tensor)
            assert torch.equal(from_fused[name], tensor)
        moe = SparseMoE(saved.spec)
        moe.load_state_dict(from_per_expert, strict=True)
        with torch.no_grad():
            assert relative_difference(moe(x).hidden, hf_mlp(x)) < RELATIVE


def test_a_stage_reads_only_its_layers_experts(saved: Saved) -> None:
    """With the names layer_checkpoint_names lists, a sharded read takes the layer's experts and
    nothing else, from either form."""
    layer = saved.sparse[-1]
    prefix = f"model.layers.{layer}"
    for folder in (saved.per_expert, saved.fused):
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            names = layer_checkpoint_names(saved.spec, prefix, list(f.keys()))
            read = {name: f.get_tensor(name) for name in names}
        assert all(name.startswith(prefix + ".") for name in names)
        loaded = expert_tensors_from_checkpoint(read, prefix, saved.spec)
        assert torch.equal(loaded["experts.down_proj"],
                           saved.model.model.layers[layer].mlp.experts.down_proj.detach())


def test_export_loads_back_into_transformers(saved: Saved, tmp_path: Path) -> None:
    """Fused checkpoint -> SparseMoE state -> our export (with the model's other tensors) ->
    from_pretrained: the names save_pretrained writes, equal weights and equal logits."""
    from transformers import AutoModelForCausalLM

    tensors = tensors_of(saved.fused)
    for layer in saved.sparse:
        prefix = f"model.layers.{layer}"
        state = expert_tensors_from_checkpoint(tensors, prefix, saved.spec)
        for name in checkpoint_names(saved.spec, prefix, CHECKPOINT_FORMS[saved.spec.family][1]):
            del tensors[name]
        tensors.update(checkpoint_tensors_of_experts(state, prefix, saved.spec))
    assert set(tensors) == set(tensors_of(saved.per_expert))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(saved.per_expert / "config.json", tmp_path / "config.json")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = saved.model(ids).logits, reloaded(ids).logits
    assert torch.equal(got, expected)
    # Not vacuous: without their experts' outputs the logits move.
    for layer in saved.sparse:
        torch.nn.init.zeros_(reloaded.model.layers[layer].mlp.experts.down_proj)
    with torch.no_grad():
        assert relative_difference(reloaded(ids).logits, expected) > 0.1


def test_malformed_checkpoints_are_refused(saved: Saved) -> None:
    tensors = tensors_of(saved.per_expert)
    prefix = f"model.layers.{saved.sparse[0]}"
    names = checkpoint_names(saved.spec, prefix, CHECKPOINT_FORMS[saved.spec.family][0])
    missing = {k: v for k, v in tensors.items() if k != names[-1]}
    with pytest.raises(ExpertCheckpointError, match=re.escape(f"lacks 1 tensor(s) of {prefix}")):
        expert_tensors_from_checkpoint(missing, prefix, saved.spec)
    module = CHECKPOINT_FORMS[saved.spec.family][0].module
    extra = {**tensors, f"{prefix}.{module}.shared_expert.up_proj.weight": torch.zeros(8, 16)}
    with pytest.raises(ExpertCheckpointError, match="shared experts"):
        layer_checkpoint_names(saved.spec, prefix, list(extra))
    wrong = {**tensors, names[1]: torch.zeros(7, 16)}
    with pytest.raises(ExpertCheckpointError, match=r"has shape \(7, 16\).*\(8, 16\)"):
        expert_tensors_from_checkpoint(wrong, prefix, saved.spec)


# --- routing record and replay ----------------------------------------------------------------


@pytest.fixture(params=[("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)],
                ids=["qwen3-unnormalised", "qwen3-normalised", "mixtral"])
def moe(request: pytest.FixtureRequest) -> SparseMoE:
    family, norm = request.param
    config = hf_config(family, norm)
    return ours_like(hf_block(config), config)


def tokens(count: int = 40, seed: int = 4) -> torch.Tensor:
    return torch.randn(count, 16, generator=torch.Generator().manual_seed(seed))


def reference(moe: SparseMoE, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Token by token, the definition: the router's probabilities of the given experts
    (renormalised as the family does) weighting those experts' SwiGLU outputs."""
    rows = []
    for token, chosen in zip(x, experts.long()):
        probs = torch.softmax(moe.gate.weight @ token, dim=-1)[chosen]
        weights = probs / probs.sum() if moe.spec.renormalises else probs
        inner = moe.spec.expert_intermediate_size
        total = torch.zeros_like(token)
        for weight, expert in zip(weights, chosen):
            gate_up = moe.experts.gate_up_proj[expert]
            hidden = F.silu(gate_up[:inner] @ token) * (gate_up[inner:] @ token)
            total = total + weight * (moe.experts.down_proj[expert] @ hidden)
        rows.append(total)
    return torch.stack(rows)


def test_replay_of_the_record_is_exact(moe: SparseMoE) -> None:
    x = tokens()
    with torch.no_grad():
        recorded = moe(x)
        replayed = moe(x, replay=recorded.experts)
    assert recorded.experts.dtype == torch.int8
    assert torch.equal(replayed.hidden, recorded.hidden)
    assert torch.equal(replayed.experts, recorded.experts)
    # A peer may list a token's experts in any order: the same experts, the same output.
    shuffled = recorded.experts.flip(-1)
    with torch.no_grad():
        assert torch.allclose(moe(x, replay=shuffled).hidden, recorded.hidden, atol=1e-6)


def test_rows_without_a_record_route_freely(moe: SparseMoE) -> None:
    """Padding, or tokens a sampler did not record, replay FREE_ROUTE: the router chooses."""
    x = tokens()
    with torch.no_grad():
        recorded = moe(x)
        moe.gate.weight.mul_(-1)  # an update that moves every token's experts
        free = moe(x)
        replay = recorded.experts.clone()
        replay[::2] = FREE_ROUTE
        mixed = moe(x, replay=replay)
    assert torch.equal(mixed.experts[::2], free.experts[::2])
    assert torch.equal(mixed.experts[1::2], recorded.experts[1::2])
    assert not torch.equal(free.experts[1::2], recorded.experts[1::2])
    assert relative_difference(mixed.hidden[::2], free.hidden[::2]) < RELATIVE
    assert relative_difference(mixed.hidden[1::2],
                               reference(moe, x[1::2], recorded.experts[1::2])) < RELATIVE


def test_after_an_update_replay_keeps_the_recorded_experts(moe: SparseMoE) -> None:
    x = tokens()
    with torch.no_grad():
        recorded = moe(x)
        moe.gate.weight.add_(torch.randn(moe.gate.weight.shape,
                                         generator=torch.Generator().manual_seed(5)))
        free = moe(x)
        replayed = moe(x, replay=recorded.experts)
        expected = reference(moe, x, recorded.experts)
    changed = (free.experts.sort(-1).values != recorded.experts.sort(-1).values).any(-1)
    assert changed.float().mean() > 0.3  # the update moved many tokens' experts
    assert torch.equal(replayed.experts, recorded.experts)
    assert relative_difference(replayed.hidden, expected) < RELATIVE
    assert relative_difference(free.hidden[changed], replayed.hidden[changed]) > 1e-2


def test_gradients_reach_the_router_under_replay(moe: SparseMoE) -> None:
    x = tokens(count=12)
    top_k = moe.spec.top_k
    # Every token replays experts 0..top_k-1 (expert 5 is in no token's set).
    replay = torch.arange(top_k, dtype=torch.int8).expand(12, top_k)
    moe(x, replay=replay).hidden.square().sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    expert_grads = moe.experts.gate_up_proj.grad.abs().sum(dim=(1, 2))
    assert (expert_grads[:top_k] > 0).all() and (expert_grads[top_k:] == 0).all()


@pytest.mark.parametrize(("make", "message"), [
    (lambda r: r.float(), "must hold integer expert indices, got torch.float32"),
    (lambda r: r.tolist(), "must be a tensor, got list"),
    (lambda r: r[:-1], r"has shape \(39, 3\); these tokens need \(40, 3\)"),
    (lambda r: r[:, :2], r"has shape \(40, 2\); .*top_k=3"),
    (lambda r: r.index_put((torch.tensor([7]), torch.tensor([1])), torch.tensor(6, dtype=r.dtype)),
     "names expert 6 for token 7; experts are 0..5"),
    (lambda r: r.index_put((torch.tensor([2]), torch.tensor([0])),
                           torch.tensor(-2, dtype=r.dtype)), "names expert -2 for token 2"),
    (lambda r: torch.cat([r[:, :1], r[:, :1], r[:, 2:]], dim=1),
     "names expert .* twice for token 0"),
    (lambda r: r.index_put((torch.tensor([3]), torch.tensor([2])),
                           torch.tensor(FREE_ROUTE, dtype=r.dtype)),
     "row 3 mixes -1 \\(route freely\\) with experts"),
])
def test_malformed_replay_is_refused(make: Any, message: str) -> None:
    config = hf_config("qwen3_moe")
    moe = ours_like(hf_block(config), config)
    x = tokens()
    with torch.no_grad():
        recorded = moe(x).experts
    with pytest.raises(RoutingReplayError, match=message) as refused:
        moe(x, replay=make(recorded))
    assert isinstance(refused.value, SenderFault)  # a peer's bad record strikes that peer


def test_activations_match_transformers() -> None:
    from transformers.activations import ACT2FN

    x = torch.linspace(-4, 4, 101)
    for name, function in ACTIVATIONS.items():
        assert torch.equal(function(x), ACT2FN[name](x)), name

