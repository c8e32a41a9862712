"""LoRA: a fresh adapter changes nothing, training moves only the adapters, merging computes what
the adapters computed, bad settings are refused, and a LoRA run exports a plain model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import build, chat_prompts
from safetensors.torch import load_file
from swarm_helpers import tiny_run_config
from transformers import AutoModelForCausalLM

from decentrl.config import LORA_TARGETS, RUN_MODEL_DIR, ConfigError, TrainConfig, parse_config
from decentrl.coordinator.local_backend import local_run
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.blocks import positions_from_valid
from decentrl.model.families import spec_from_hf_config
from decentrl.model.loading import LoadedModel
from decentrl.model.lora import (
    LoRALinear,
    add_lora,
    has_lora,
    lora_tensors,
    merge_lora,
)
from decentrl.model.run_stage import load_stage, lora_serving_copy
from decentrl.model.stages import StageModule, StagePlan
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate, left_pad
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout

CPU = torch.device("cpu")
SAMPLING = SamplingConfig(temperature=1.0)
MAX_NEW = 8
RANK, ALPHA = 4, 8.0


def lora_stages(model: LoadedModel, num_stages: int = 2, seed: int = 0,
                targets: tuple[str, ...] = LORA_TARGETS) -> list[StageModule]:
    stages = build(model, num_stages)
    for stage in stages:
        add_lora(stage, RANK, ALPHA, targets, seed)
    return stages


def prompts(model: LoadedModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, the mask of real tokens and the positions of two left-padded chat prompts."""
    tokens, valid = left_pad(chat_prompts(model, ["What is 3 + 4?", "Hi"]),
                             model.tokenizer.pad_token_id, CPU)
    return tokens, valid, positions_from_valid(valid)


def logits(stages: list[StageModule], model: LoadedModel) -> torch.Tensor:
    """The chain's logits [B, T, vocab] on `prompts`."""
    x, valid, positions = prompts(model)
    with torch.no_grad():
        for stage in stages:
            x = stage(x, positions, valid)
    return x


def hf_tensors(stages: list[StageModule]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for stage in stages for name, t in stage.hf_state_dict().items()}


def set_b(stages: list[StageModule], seed: int) -> None:
    """Random B matrices (a fresh adapter's are zero, so it would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in stages:
            for name, tensor in lora_tensors(stage).items():
                if name.endswith(".lora_b"):
                    tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))


def make_trainer(stages: list[StageModule], autocast: torch.dtype = torch.float32
                 ) -> PipelineTrainer:
    train = TrainConfig(lr=1e-2, lora_rank=RANK, lora_alpha=ALPHA)
    return PipelineTrainer.local(stages, train, loss_config_from(train, MAX_NEW), SAMPLING,
                                 autocast)


@pytest.fixture(scope="module")
def batch(tiny_model: LoadedModel) -> TrainBatch:
    """Two sampled completions of one prompt: the first rewarded, the second punished."""
    tokenizer = tiny_model.tokenizer
    prompts = chat_prompts(tiny_model, ["What is 3 + 4?"]) * 2
    generations = generate(LocalChain(build(tiny_model, 2)), prompts, MAX_NEW, SAMPLING,
                           {tokenizer.eos_token_id}, tokenizer.pad_token_id, 0)
    rollouts = [Rollout(prompt_tokens=p, completion_tokens=g.tokens, behaviour_logprobs=g.logprobs,
                        finished=g.finished)
                for p, g in zip(prompts, generations)]
    return build_batch(rollouts, [1.0, -1.0], [0, 0], tokenizer.pad_token_id)


def completion_logprobs(trainer: PipelineTrainer, batch: TrainBatch) -> torch.Tensor:
    logprobs = trainer._chain_logprobs([t.stage for t in trainer.stage_trainers], batch)
    return (logprobs * batch.completion_valid).sum(1)


# ------------------------------------------------------------------------------- structure

def test_a_fresh_adapter_changes_nothing(tiny_model: LoadedModel) -> None:
    stages = lora_stages(tiny_model)
    assert torch.equal(logits(stages, tiny_model), logits(build(tiny_model, 2), tiny_model))
    assert all(has_lora(stage) for stage in stages)
    # Only the adapters train; they are named after the projection they adapt.
    for stage in stages:
        trainable = {name for name, p in stage.named_parameters() if p.requires_grad}
        assert trainable == set(lora_tensors(stage))
        assert len(trainable) == 2 * len(LORA_TARGETS) * len(stage.layers)
    assert "layers.0.self_attn.q_proj.lora_a" in lora_tensors(stages[0])
    assert "layers.1.mlp.down_proj.lora_b" in lora_tensors(stages[1])
    # The base weights keep their names: the HF names of a plain stage plus the adapters'.
    plain = set(hf_tensors(build(tiny_model, 2)))
    names = set(hf_tensors(stages))
    assert plain <= names
    assert names - plain == {n for n in names if n.endswith((".lora_a", ".lora_b"))}


def test_adapters_do_not_depend_on_the_stage_split(tiny_model: LoadedModel) -> None:
    one, three = hf_tensors(lora_stages(tiny_model, 1)), hf_tensors(lora_stages(tiny_model, 3))
    assert one.keys() == three.keys()
    assert all(torch.equal(one[name], three[name]) for name in one)
    a = [t for name, t in one.items() if name.endswith(".lora_a")]
    assert not torch.equal(a[0], a[1])  # every projection has its own A
    other_seed = hf_tensors(lora_stages(tiny_model, 1, seed=1))
    assert not torch.equal(one["model.layers.0.self_attn.q_proj.lora_a"],
                           other_seed["model.layers.0.self_attn.q_proj.lora_a"])


def test_adapter_size_of_smollm2_135m() -> None:
    """30 layers, hidden 576, k/v 192, MLP 1536: rank 8 on all seven projections."""
    spec = spec_from_hf_config({"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                                "intermediate_size": 1536, "num_hidden_layers": 30,
                                "num_attention_heads": 9, "num_key_value_heads": 3,
                                "rope_theta": 1e5, "rms_norm_eps": 1e-5,
                                "max_position_embeddings": 8192})
    with torch.device("meta"):
        stage = StageModule(spec, StagePlan.even(30, 1), 0)
        add_lora(stage, 8, 16.0, LORA_TARGETS, seed=0)
    per_layer = 8 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))
    assert sum(t.numel() for t in lora_tensors(stage).values()) == 30 * per_layer == 2_442_240


def test_bad_settings_are_refused(tiny_model: LoadedModel) -> None:
    stage = build(tiny_model, 1)[0]
    with pytest.raises(ValueError, match=r"unknown LoRA target 'qproj'.*'q_proj'.*'down_proj'"):
        add_lora(stage, RANK, ALPHA, ["q_proj", "qproj"], seed=0)
    # A fused projection (Phi-3's) on a family that has the separate ones (test_phi3.py: the
    # other way round).
    with pytest.raises(ValueError, match=r"'qkv_proj': llama has no such projection; its "
                                         r"projections are \['q_proj', 'k_proj', 'v_proj'"):
        add_lora(stage, RANK, ALPHA, ["q_proj", "qkv_proj"], seed=0)
    with pytest.raises(ValueError, match="at least one target"):
        add_lora(stage, RANK, ALPHA, [], seed=0)
    with pytest.raises(ValueError, match="rank must be >= 1, got 0"):
        add_lora(stage, 0, ALPHA, LORA_TARGETS, seed=0)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        add_lora(stage, RANK, 0.0, LORA_TARGETS, seed=0)
    assert not has_lora(stage)  # a refused call changed nothing
    add_lora(stage, RANK, ALPHA, ["q_proj"], seed=0)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(stage, RANK, ALPHA, ["v_proj"], seed=0)
    with pytest.raises(ConfigError, match=r"train\.lora_targets.*unknown LoRA target 'qproj'"):
        parse_config({"train": {"lora_targets": ["qproj"]}})
    with pytest.raises(ConfigError, match=r"train\.lora_targets.*at least one"):
        parse_config({"train": {"lora_targets": []}})
    with pytest.raises(ConfigError, match=r"train\.lora_targets.*more than once"):
        parse_config({"train": {"lora_targets": ["q_proj", "q_proj"]}})
    with pytest.raises(ConfigError, match=r"train\.lora_rank"):
        parse_config({"train": {"lora_rank": -1}})
    with pytest.raises(ConfigError, match=r"train\.lora_alpha"):
        parse_config({"train": {"lora_alpha": 0}})


# -------------------------------------------------------------------------------- training

def test_training_moves_only_the_adapters(tiny_model: LoadedModel, batch: TrainBatch,
                                          tmp_path: Path) -> None:
    trainer = make_trainer(lora_stages(tiny_model))
    before = hf_tensors([t.stage for t in trainer.stage_trainers])
    logprobs_before = completion_logprobs(trainer, batch)
    for _ in range(3):
        trainer.train_step(batch)
    after = hf_tensors([t.stage for t in trainer.stage_trainers])
    for name in before:
        if name.endswith((".lora_a", ".lora_b")):
            assert not torch.equal(before[name], after[name]), name
        else:
            assert torch.equal(before[name], after[name]), name
    # The rewarded completion became likelier, the punished one less likely.
    logprobs_after = completion_logprobs(trainer, batch)
    assert logprobs_after[0] > logprobs_before[0] + 0.5
    assert logprobs_after[1] < logprobs_before[1] - 0.5
    # The Adam state covers the adapters only, and a checkpoint restores them exactly.
    assert all(len(t.optimizer.state) == len(lora_tensors(t.stage))
               for t in trainer.stage_trainers)
    trainer.save(tmp_path, {})
    restored = make_trainer(lora_stages(tiny_model))
    restored.load(tmp_path)
    assert restored.version == 3
    loaded = hf_tensors([t.stage for t in restored.stage_trainers])
    assert all(torch.equal(after[name], loaded[name]) for name in after)


def test_gradients_reach_the_adapters_under_bf16_autocast(tiny_model: LoadedModel,
                                                          batch: TrainBatch) -> None:
    layer = build(tiny_model, 1)[0].layers[0].mlp.up_proj
    lora = LoRALinear(layer, RANK, ALPHA, torch.Generator().manual_seed(0))
    with torch.no_grad():
        lora.lora_b.normal_()  # else the gradient of A is exactly zero
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora(torch.randn(3, layer.in_features))
    assert out.dtype == torch.bfloat16
    out.float().pow(2).sum().backward()
    for adapter in (lora.lora_a, lora.lora_b):
        assert adapter.grad is not None and adapter.grad.dtype == torch.float32
        assert torch.isfinite(adapter.grad).all() and adapter.grad.abs().max() > 0
    # The whole training step under bf16 autocast: fp32 adapters move, the base does not.
    trainer = make_trainer(lora_stages(tiny_model), autocast=torch.bfloat16)
    before = hf_tensors([t.stage for t in trainer.stage_trainers])
    metrics = trainer.train_step(batch)
    assert 0 < metrics["grad_norm"] < float("inf")
    after = hf_tensors([t.stage for t in trainer.stage_trainers])
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all(name.endswith(".lora_b") for name in moved)  # A's gradient was 0


# --------------------------------------------------------------------------------- merging

def test_merge_computes_what_the_adapters_computed(tiny_model: LoadedModel) -> None:
    stages = lora_stages(tiny_model)
    set_b(stages, seed=3)
    adapted = logits(stages, tiny_model)
    base = logits(build(tiny_model, 2), tiny_model)
    assert (adapted - base).abs().max() > 1e-2  # the adapters do change the model
    merged = copy.deepcopy(stages)
    for stage in merged:
        merge_lora(stage)
    assert not any(has_lora(stage) for stage in merged)
    assert torch.allclose(logits(merged, tiny_model), adapted, atol=1e-5, rtol=0)
    plain = build(tiny_model, 2)
    for stage, reference in zip(merged, plain):
        assert list(stage.state_dict()) == list(reference.state_dict())
        assert list(stage.hf_state_dict()) == list(reference.hf_state_dict())
    assert all(has_lora(stage) for stage in stages)  # the copies were merged, not these


# ------------------------------------------------------------------------------ a whole run

def test_lora_run_trains_and_exports_a_plain_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(
        tiny_model_dir, 2, host={"run_dir": str(tmp_path), "threads": 1},
        task={"name": "sums", "options": {"max_digits": 1}},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
        train={"mode": "sync", "steps": 2, "micro_batch_size": 8, "checkpoint_every": 2,
               "zero_variance_groups": "keep", "lora_rank": RANK, "lora_alpha": ALPHA,
               "lora_targets": ["q_proj", "v_proj", "down_proj"]},
        eval={"problems": 2, "pass_k": 1, "max_new_tokens": 6})
    run = local_run(config)
    learner = [t.stage for t in run.trainer.stage_trainers]
    # The tiny model earns no reward, so every advantage and gradient is zero: give B values up
    # front, as training would, so that the replicas and the merge have something to carry.
    set_b(learner, seed=4)
    summary = run.run()
    assert summary.steps == 2 and run.trainer.version == 2
    replicas = run.backend.chain.stages + run.backend.eval_chain.stages
    assert all(has_lora(stage) for stage in learner + replicas)
    # The replicas generated and evaluated with the learner's adapters.
    assert run.backend.chain.versions() == (1, 1)  # synced before the second step's rollouts
    for trained, *copies in zip(learner, run.backend.chain.stages, run.backend.eval_chain.stages):
        for replica in copies:
            assert lora_tensors(trained).keys() == lora_tensors(replica).keys()
            assert all(torch.equal(t, lora_tensors(replica)[name])
                       for name, t in lora_tensors(trained).items())
    # The export is a plain model that computes what the learner computes.
    final = summary.path / RUN_MODEL_DIR
    exported = load_file(final / "model.safetensors")
    assert not any("lora" in name for name in exported)
    assert json.loads((final / "config.json").read_text())["tie_word_embeddings"] is False
    hf = AutoModelForCausalLM.from_pretrained(final).eval()
    tokens, valid, positions = prompts(run.backend.model)
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=valid.long(), position_ids=positions).logits
    actual = logits(learner, run.backend.model)
    assert torch.allclose(actual[valid], expected[valid], atol=1e-4)
    # The merge changed the adapted projections, nothing else.
    original = run.backend.model.tensors
    changed = {name for name in original if not torch.equal(exported[name], original[name])}
    assert changed == {name for name in original
                       if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}
    # The checkpoint resumes into LoRA stages.
    resumed = local_run(config.model_copy(update={"train": config.train.model_copy(
        update={"steps": 3})}))
    assert resumed.step == 2
    for trained, stage in zip(learner, resumed.trainer.stage_trainers):
        assert all(torch.equal(t, stage.stage.state_dict()[name])
                   for name, t in trained.state_dict().items())



def test_a_peer_that_trains_and_serves_holds_the_frozen_base_once(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, train={"lora_rank": 4})
    cpu = torch.device("cpu")
    # The learner's fp32 master keeps its frozen base in the compute dtype, adapters in fp32.
    learner = load_stage(config, 0, cpu, torch.float32, frozen_dtype=torch.bfloat16)
    assert {p.dtype for p in learner.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in learner.parameters() if not p.requires_grad} == {torch.bfloat16}
    served = lora_serving_copy(config, learner, torch.bfloat16)
    own = dict(learner.named_parameters())
    for name, param in served.named_parameters():
        if own[name].requires_grad:  # its own adapters, in the serving dtype
            assert param is not own[name] and param.dtype == torch.bfloat16
            assert torch.equal(param, own[name].to(torch.bfloat16))
        else:  # the learner's very tensors
            assert param is own[name]
    # It computes what a stage loaded apart in the serving dtype computes.
    apart = load_stage(config, 0, cpu, torch.float32, frozen_dtype=torch.bfloat16
                       ).to(cpu, torch.bfloat16)
    tokens, positions = torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
    valid = torch.ones(1, 4, dtype=torch.bool)
    torch.testing.assert_close(served(tokens, positions, valid), apart(tokens, positions, valid),
                               atol=0, rtol=0)
    with pytest.raises(ValueError, match="frozen_dtype"):
        lora_serving_copy(config, load_stage(config, 0, cpu, torch.float32), torch.bfloat16)
