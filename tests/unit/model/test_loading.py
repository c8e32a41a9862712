"""Loading a local Hugging Face folder of every registered family (the tiny models of the
conformance tests, tests/unit/model/families/cases.py): sharded checkpoints with each stage
opening only the shards of its own tensors, fp32, bf16 and fp16 checkpoints read to transformers'
logits, tied and untied heads, a tokenizer without a pad token; and the refusals of a checkpoint
that lacks a tensor, a tokenizer without a chat template, and an unsupported family or feature
as `decentrl train` shows them (one line)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from swarm_helpers import tiny_run_config
from typer.testing import CliRunner

from decentrl.cli import app
from decentrl.model import loading
from decentrl.model.loading import load_model, load_tokenizer, read_tensors
from decentrl.model.run_stage import load_stage, stage_tensor_names
from decentrl.model.stages import HEAD, StagePlan, build_stages
from decentrl.model.tiny import make_tiny_model
from tests.unit.model.families.cases import family_cases
from tests.unit.model.families.conformance import (
    TOLERANCE,
    FamilyCase,
    chain_logits,
    padded_batch,
    relative_difference,
    transformers_logits,
)

CASES = family_cases()
CPU = torch.device("cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def tiny_family(case: FamilyCase, folder: Path) -> Path:
    return make_tiny_model(folder, seed=5, model_type=case.model_type,
                           **{"initializer_range": 0.2, **case.config})


def resave(folder: Path, out: Path, dtype: torch.dtype = torch.float32,
           max_shard_size: str | None = None) -> Path:
    """`folder`'s model saved again by transformers in `dtype`, in shards of at most
    `max_shard_size`, with its tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **extra)
    load_tokenizer(folder).save_pretrained(out)
    return out


def logits_difference(folder: Path, num_stages: int = 2) -> float:
    """Our fp32 logits of the folder's checkpoint against transformers' (which reads it in fp32)."""
    from transformers import AutoModelForCausalLM

    model = load_model(str(folder))
    stages = build_stages(model.spec, StagePlan.even(model.spec.num_layers, num_stages),
                          model.tensors, CPU, torch.float32)
    ids, valid = padded_batch((9, 4), model.spec.vocab_size, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = transformers_logits(hf, ids, valid)
    return relative_difference(chain_logits(stages, ids, valid)[valid], expected[valid])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_sharded_checkpoint_is_read_per_stage_from_its_own_shards(
        case: FamilyCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = tiny_family(case, tmp_path / "whole")
    sharded = resave(whole, tmp_path / "sharded", max_shard_size="40KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 3
    opened: list[str] = []
    real_open = loading.safe_open

    def recording_open(path: Path, **kwargs: Any) -> Any:
        opened.append(Path(path).name)
        return real_open(path, **kwargs)

    monkeypatch.setattr(loading, "safe_open", recording_open)
    model = load_model(str(whole))
    plan = StagePlan.even(model.spec.num_layers, 3)
    for index in range(plan.num_stages):
        names = stage_tensor_names(model.spec, plan, index, loading.tensor_names(sharded))
        opened.clear()
        tensors = read_tensors(sharded, names.__contains__)
        assert set(tensors) == names
        assert set(opened) == {weight_map[name] for name in names}
        for name in names:
            assert torch.equal(tensors[name], model.tensors[name]), name
    assert logits_difference(sharded, num_stages=3) <= TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp32_bf16_and_fp16_checkpoints_load_to_transformers_logits(
        case: FamilyCase, dtype: str, tmp_path: Path) -> None:
    folder = resave(tiny_family(case, tmp_path / "original"), tmp_path / dtype, DTYPES[dtype])
    stored = load_file(folder / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {DTYPES[dtype]}
    model = load_model(str(folder))
    assert all(t.dtype == torch.float32 for t in model.tensors.values())
    assert all(torch.equal(model.tensors[name], t.float()) for name, t in stored.items())
    assert logits_difference(folder) <= TOLERANCE


def test_a_tied_head_with_an_lm_head_that_differs_is_refused_as_transformers_unties_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A tied config whose file also holds lm_head.weight: the embedding's copy loads as the
    tied head; a different one (transformers would keep it apart) is refused, by a whole load
    and by the stage that holds the head."""
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "tied"))
    path = folder / "model.safetensors"
    tensors = load_file(path)
    assert HEAD not in tensors
    tensors[HEAD] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    assert logits_difference(folder) <= TOLERANCE
    tensors[HEAD] = torch.randn_like(tensors[HEAD])
    save_file(tensors, path, metadata={"format": "pt"})
    refusal = r"ties the head to the embedding .* but the checkpoint's lm_head.weight differs"
    with pytest.raises(ValueError, match=refusal):
        load_model(str(folder))
    config = tiny_run_config(folder, 2)
    load_stage(config, 0, CPU, torch.float32)
    with pytest.raises(ValueError, match=refusal):
        load_stage(config, 1, CPU, torch.float32)


def test_an_untied_head_is_its_own_tensor_and_one_missing_is_named(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "untied", seed=4, tie_word_embeddings=False)
    tensors = load_file(folder / "model.safetensors")
    assert not torch.equal(tensors[HEAD], tensors["model.embed_tokens.weight"])
    assert logits_difference(folder) <= TOLERANCE
    del tensors[HEAD]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors its config.json implies: lm_head.weight"):
        load_model(str(folder))


def without_tokenizer_field(folder: Path, field: str) -> None:
    """`folder`'s tokenizer_config.json without `field` (and no chat_template.jinja for one)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop(field, None)
    path.write_text(json.dumps(config))
    if field == "chat_template":
        (folder / "chat_template.jinja").unlink(missing_ok=True)


def test_a_tokenizer_without_a_pad_token_pads_with_its_end_of_sequence_token(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "nopad"))
    without_tokenizer_field(folder, "pad_token")
    tokenizer = load_tokenizer(folder)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    without_tokenizer_field(folder, "eos_token")
    with pytest.raises(ValueError, match="neither a pad token nor an end-of-sequence token"):
        load_tokenizer(folder)


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "notemplate"))
    without_tokenizer_field(folder, "chat_template")
    with pytest.raises(ValueError, match=r"has no chat template.*chat_template\.jinja"):
        load_tokenizer(folder)


def train_refusal(model: str, tmp_path: Path) -> str:
    """What `decentrl train` says, as one line, of a run of `model`."""
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{model}"\n[host]\nrun_dir = "{tmp_path / "runs"}"\n'
                      'device = "cpu"\n')
    result = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:"), result.output
    return text


@pytest.mark.usefixtures("restored_logging")  # decentrl train configures logging
@pytest.mark.parametrize(("fields", "message"), [
    ({"model_type": "phi"}, "model_type 'phi' is not supported; the nearest supported family is"),
    ({"hidden_act": "relu2"}, "llama: hidden_act 'relu2' is not supported"),
])
def test_train_names_an_unsupported_family_or_feature_in_one_line(
        tiny_model_dir: Path, tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    assert message in train_refusal(str(folder), tmp_path)
