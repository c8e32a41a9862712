"""Export: trained stages become a Hugging Face folder that transformers loads and that computes
exactly what the chain computes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import build, chat_prompts
from safetensors.torch import load_file

from decentrl.config import TrainConfig
from decentrl.learn.batch import build_batch
from decentrl.learn.trainer import PipelineTrainer, loss_config_from
from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.stages import StageModule
from decentrl.release.export import export_hf_folder, export_run, load_stages_from_folder
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate, left_pad
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout

CPU = torch.device("cpu")
GREEDY = SamplingConfig(temperature=0.0)
QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 * 34, then add 5."]
CARD = "# tiny\n\nTrained by a test.\n"




def state(stages: list[StageModule]) -> dict[str, torch.Tensor]:
    return {name: tensor for stage in stages for name, tensor in stage.hf_state_dict().items()}


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


@pytest.fixture(scope="module")
def trained(sharp: LoadedModel) -> list[StageModule]:
    """Two stages after one training step, so the head no longer equals the embedding."""
    stages = build(sharp, 2)
    tokenizer = sharp.tokenizer
    prompts = chat_prompts(sharp, QUESTIONS)
    sampling = SamplingConfig()
    generations = generate(LocalChain(stages), prompts, 8, sampling, {tokenizer.eos_token_id},
                           tokenizer.pad_token_id, 0)
    rollouts = [Rollout(prompt_tokens=p, completion_tokens=g.tokens, behaviour_logprobs=g.logprobs,
                        finished=g.finished, completion_text="")
                for p, g in zip(prompts, generations)]
    batch = build_batch(rollouts, [1.0, -1.0, 0.5], [0, 0, 0], tokenizer.pad_token_id)
    train = TrainConfig(lr=1e-3)
    PipelineTrainer.local(stages, train, loss_config_from(train, 8), sampling, torch.float32
                          ).train_step(batch)
    assert all(stage.version == 1 for stage in stages)
    head, embed = stages[1].lm_head.weight, stages[0].embed_tokens.weight
    assert (head - embed).abs().max() > 1e-4
    return stages


@pytest.fixture(scope="module")
def exported(trained: list[StageModule], sharp: LoadedModel,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "model"
    return export_hf_folder(trained, sharp.hf_config, sharp.tokenizer, out,
                            extra_files={"README.md": CARD})


def test_folder_contents(exported: Path, trained: list[StageModule], sharp: LoadedModel) -> None:
    assert sorted(p.name for p in exported.parent.iterdir()) == ["model"]  # no staging left over
    config = json.loads((exported / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == sharp.spec.num_layers
    generation = json.loads((exported / "generation_config.json").read_text())
    tokenizer = sharp.tokenizer
    assert generation == {"bos_token_id": tokenizer.bos_token_id,
                          "eos_token_id": tokenizer.eos_token_id,
                          "pad_token_id": tokenizer.pad_token_id}
    assert (exported / "README.md").read_text() == CARD
    tensors = load_file(exported / "model.safetensors")
    expected = state(trained)
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)  # fp32, bit for bit
    assert tensors["lm_head.weight"].dtype == torch.float32
    # A release is readable by everyone: not the private modes of a temporary folder.
    assert exported.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in exported.iterdir()} == {0o644}


def test_transformers_loads_the_same_model(exported: Path, trained: list[StageModule],
                                           sharp: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert hf.dtype == torch.float32
    # Untied: transformers kept our head instead of re-tying it to the embedding.
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    assert torch.equal(hf.lm_head.weight, trained[1].lm_head.weight)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    prompts = chat_prompts(sharp, QUESTIONS)
    assert [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True)["input_ids"]
            for q in QUESTIONS] == prompts
    pad = tokenizer.pad_token_id
    assert pad == sharp.tokenizer.pad_token_id

    ids, valid = left_pad(prompts, pad, CPU)
    positions = positions_from_valid(valid)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=valid.long(), position_ids=positions).logits
        x = ids
        for stage in trained:
            x = stage(x, positions, valid)
    # Same fp32 weights, two implementations: reductions in another order, ~1e-6 on logits that
    # span several units for this sharpened model.
    assert torch.allclose(x[valid], expected[valid], atol=1e-5, rtol=0)

    ours = generate(LocalChain(trained), prompts, 16, GREEDY, {tokenizer.eos_token_id}, pad)
    out = hf.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=16,
                      do_sample=False)  # eos and pad from the exported generation_config.json
    for row, generation in enumerate(ours):
        theirs = out[row, ids.shape[1]:].tolist()
        cut = (theirs.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in theirs
               else len(theirs))
        assert generation.tokens == theirs[:cut], f"row {row}"
    assert len({tuple(g.tokens) for g in ours}) > 1  # not one token repeated by every row


def test_round_trip_into_stages(exported: Path, trained: list[StageModule]) -> None:
    stages = load_stages_from_folder(exported, 3, CPU, torch.float32)
    assert len(stages) == 3
    loaded, expected = state(stages), state(trained)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_bf16_export_and_replacing_a_folder(trained: list[StageModule], sharp: LoadedModel,
                                            tmp_path: Path) -> None:
    out = tmp_path / "model"
    export_hf_folder(trained, sharp.hf_config, sharp.tokenizer, out,
                     extra_files={"notes/old.txt": "old"})
    export_hf_folder(list(reversed(trained)), sharp.hf_config, sharp.tokenizer, out,
                     dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert not (out / "notes").exists()  # replaced, not merged
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    expected = state(trained)
    assert all(tensors[k].dtype == torch.bfloat16 for k in tensors)
    assert all(torch.equal(tensors[k], expected[k].bfloat16()) for k in expected)


def test_incomplete_or_overlapping_stages_are_refused(trained: list[StageModule],
                                                      sharp: LoadedModel, tmp_path: Path) -> None:
    first, last = trained
    out = tmp_path / "model"

    def export(stages: list[StageModule], **kwargs: object) -> Path:
        return export_hf_folder(stages, sharp.hf_config, sharp.tokenizer, out, **kwargs)

    with pytest.raises(ValueError, match=r"no weights for layers \[2, 3\]"):
        export([first])
    with pytest.raises(ValueError, match=r"no weights for layers \[0, 1\]"):
        export([last])
    with pytest.raises(ValueError, match="appears in stage 0 and stage 1"):
        export([first, first, last])
    with pytest.raises(ValueError, match="no stages"):
        export([])
    with pytest.raises(ValueError, match="num_hidden_layers=6"):
        export_hf_folder(trained, {**sharp.hf_config, "num_hidden_layers": 6}, sharp.tokenizer, out)
    with pytest.raises(ValueError, match="relative path"):
        export(trained, extra_files={"../escape.txt": "x"})
    with pytest.raises(ValueError, match="would overwrite"):
        export(trained, extra_files={"config.json": "{}"})
    with pytest.raises(ValueError, match="dtype"):
        export(trained, dtype=torch.int8)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half-written


def test_missing_head_is_refused(sharp: LoadedModel, tmp_path: Path) -> None:
    # A plan whose last stage is absent and a layer-complete set without a head cannot occur
    # with real stages, so drop the head from a real one.
    [stage] = build(sharp, 1)
    stage.lm_head = None
    stage.norm = None
    with pytest.raises(ValueError, match="lack.*model.norm.weight.*lm_head.weight"):
        export_hf_folder([stage], sharp.hf_config, sharp.tokenizer, tmp_path / "model")


def test_a_runs_latest_checkpoint_exports_to_the_same_model(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """`decentrl export RUN_DIR OUT_DIR`: the stage shards a run's training peers checkpointed
    become one folder holding exactly the trained weights; a folder that is not a complete run
    is refused by name."""
    from swarm_helpers import tiny_run_config
    from typer.testing import CliRunner

    from decentrl.cli import app

    config = tiny_run_config(tiny_sharp_dir, 2, run_dir=str(tmp_path / "runs"))
    run_dir = config.path
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(config.model_dump_json())
    interval = {"mean": 0.555, "low": 0.486, "high": 0.622, "n": 200}
    (run_dir / "eval_after.json").write_text(json.dumps(
        {"task": "sums", "split": "heldout", "problems": 200, "pass1": interval, "pass_k": None,
         "k": 1, "mean_completion_tokens": 9.5, "samples": []}))
    peers = [{"peer_id": f"12D3KooW{name}", "name": name, "stage": stage, "role": role,
              "version": 1, "tokens_per_s": 10.0, "bytes_sent": 1000, "reputation": 1.0,
              "banned": False}
             for stage in range(2) for name, role in ((f"train{stage}", "training"),
                                                      (f"infer{stage}.0", "inference"))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in [
        {"event": "step", "elapsed_s": 10.0, "step": 1, "version": 1, "reward": 0.5,
         "accuracy": 0.5, "staleness_mean": 0.0},
        {"event": "swarm", "elapsed_s": 11.0, "step": 1, "version": 1, "peers": peers}]))
    train = TrainConfig(lr=1e-3)
    PipelineTrainer.local(trained, train, loss_config_from(train, 8), SamplingConfig(),
                          torch.float32).save(run_dir / "checkpoints", {"step": 1})

    result = CliRunner().invoke(app, ["export", str(run_dir), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    tensors = load_file(out / "model.safetensors")
    expected = state(trained)
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    card = (out / "README.md").read_text()
    assert "| pass@1 (greedy) | - | 55.5% [48.6, 62.2] |" in card
    assert "1 optimizer steps; this is weight version 1 of every stage" in card
    assert "| infer1.0 | 1 | inference | 1 | `12D3KooWinfer1.0` |" in card  # who trained it
    shard = (run_dir / "checkpoints" / "v1" / "stage0.pt").read_bytes()
    assert hashlib.sha256(shard).hexdigest() in card
    # SHA256SUMS covers every other file, as `sha256sum -c` reads it.
    listed = dict(reversed(line.split("  ")) for line in
                  (out / "SHA256SUMS").read_text().splitlines())
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != "SHA256SUMS")
    for name, digest in listed.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name

    (run_dir / "checkpoints" / "v1" / "stage1.pt").unlink()
    with pytest.raises(FileNotFoundError, match="lacks stage1.pt"):
        export_run(run_dir, tmp_path / "again")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_run(tmp_path, tmp_path / "again")
    refused = CliRunner().invoke(app, ["export", str(run_dir), str(tmp_path / "again"),
                                       "--dtype", "int8"])
    assert refused.exit_code == 2 and "--dtype must be one of" in refused.output
