"""Assembling the stages into one Hugging Face model folder: the only place the whole model exists.

The folder loads with `transformers.AutoModelForCausalLM` and `AutoTokenizer`. The head and the
embedding were untied when the stages were built (see model/stages.py), so the exported config says
`tie_word_embeddings: false` and the checkpoint carries both matrices. LoRA stages are exported
with their adapters merged into the weights: the folder is a plain model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Literal, get_args

import torch
from safetensors.torch import save_file

from decentrl.config import load_config
from decentrl.evaluate.suite import SuiteResult
from decentrl.learn.trainer import latest_checkpoint
from decentrl.model.loading import load_model, load_tokenizer, resolve_model
from decentrl.model.lora import has_lora, merge_lora
from decentrl.model.run_stage import load_stage
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.observe.report import read_evaluation, read_metrics
from decentrl.release.card import model_card

EXPORT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
REQUIRED_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
WRITTEN_FILES = ("model.safetensors", "config.json", "generation_config.json")
CHECKSUMS = "SHA256SUMS"
Weights = Literal["served", "learner"]
WEIGHTS: tuple[str, ...] = get_args(Weights)


def merge_stage_tensors(stages: list[StageModule], num_layers: int) -> dict[str, torch.Tensor]:
    """Every stage's tensors under their Hugging Face names, checked to form exactly one model:
    each layer 0..num_layers-1 held by exactly one stage; the embedding, final norm and head
    present."""
    if not stages:
        raise ValueError("cannot export a model from no stages")
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}  # tensor name -> position of the stage in `stages`
    layer_owner: dict[int, int] = {}
    for position, stage in enumerate(stages):
        for name, tensor in stage.hf_state_dict().items():
            if name in merged:
                raise ValueError(f"tensor {name!r} appears in stage {owner[name]} and stage "
                                 f"{position}: the stages overlap")
            match = LAYER_NAME.match(name)
            if match:
                layer = int(match.group(1))
                if layer_owner.setdefault(layer, position) != position:
                    raise ValueError(f"layer {layer} appears in stage {layer_owner[layer]} and "
                                     f"stage {position}: the stages overlap")
            merged[name] = tensor
            owner[name] = position
    missing_layers = sorted(set(range(num_layers)) - set(layer_owner))
    if missing_layers:
        raise ValueError(f"the stages hold no weights for layers {missing_layers} of a "
                         f"{num_layers}-layer model: every stage must be exported")
    extra_layers = sorted(set(layer_owner) - set(range(num_layers)))
    if extra_layers:
        raise ValueError(f"the stages hold layers {extra_layers}, beyond the {num_layers} layers "
                         "the config declares")
    missing = [name for name in REQUIRED_TENSORS if name not in merged]
    if missing:
        raise ValueError(f"the stages lack {missing}: the first stage (embedding) and the last "
                         "stage (final norm and head) must be exported")
    return merged


def plain_stage(stage: StageModule) -> StageModule:
    """`stage` itself, or for a LoRA stage a copy with the adapters merged (the caller's stage
    keeps its adapters, and may keep training)."""
    if not has_lora(stage):
        return stage
    merged = copy.deepcopy(stage)
    merge_lora(merged)
    return merged


def export_config(hf_config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    config = dict(hf_config)
    config.pop("quantization_config", None)
    config["tie_word_embeddings"] = False
    config["dtype"] = EXPORT_DTYPES[dtype]
    config["torch_dtype"] = EXPORT_DTYPES[dtype]  # the name transformers 4 reads
    return config


def check_extra_name(name: str) -> None:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"extra file name {name!r} must be a relative path inside the folder")
    if name in WRITTEN_FILES:
        raise ValueError(f"extra file name {name!r} would overwrite the exported {name}")


def export_hf_folder(stages: list[StageModule], hf_config: dict[str, Any], tokenizer: Any,
                     out_dir: Path, extra_files: dict[str, str] | None = None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write the model of `stages` (all of them, any order) as a Hugging Face folder at `out_dir`.

    The folder is written under a temporary name next to `out_dir` and renamed into place, so a
    reader never sees half a model; an existing `out_dir` is replaced. `extra_files` maps relative
    file names to text (a model card, a training report). `SHA256SUMS` lists every file's
    checksum (`sha256sum -c SHA256SUMS` checks a download)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {list(EXPORT_DTYPES)}, got {dtype}")
    if not stages:
        raise ValueError("cannot export a model from no stages")
    num_layers = stages[0].spec.num_layers
    if hf_config.get("num_hidden_layers") != num_layers:
        raise ValueError(f"hf_config has num_hidden_layers={hf_config.get('num_hidden_layers')} "
                         f"but the stages were built for {num_layers} layers")
    extra_files = extra_files or {}
    for name in extra_files:
        check_extra_name(name)
    merged = merge_stage_tensors([plain_stage(stage) for stage in stages], num_layers)
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous()
               for name, t in sorted(merged.items())}

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(
            json.dumps(export_config(hf_config, dtype), indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(staging)
        generation = {"bos_token_id": tokenizer.bos_token_id,
                      "eos_token_id": tokenizer.eos_token_id,
                      "pad_token_id": tokenizer.pad_token_id}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for name, text in extra_files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (staging / CHECKSUMS).write_text(checksums(staging))
        # mkdtemp makes the folder private (0700) and safetensors writes its file 0600; a release
        # is for everyone to read.
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        replace_folder(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksums(folder: Path) -> str:
    """`sha256sum` lines for every file under `folder`, sorted by path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    return "".join(f"{file_sha256(p)}  {p.relative_to(folder).as_posix()}\n" for p in files)


def replace_folder(new: Path, target: Path) -> None:
    """Rename `new` to `target`. A rename cannot replace a non-empty folder, so an existing
    `target` is moved aside first, restored if the rename fails, and deleted after."""
    if not target.exists():
        new.rename(target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    try:
        target.rename(aside / target.name)
        try:
            new.rename(target)
        except BaseException:
            (aside / target.name).rename(target)
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def export_run(run_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32,
               weights: Weights = "served") -> Path:
    """Assemble the latest checkpoint of a run (its folder: `config.json` and
    `checkpoints/latest` -> `checkpoints/v<N>/stage<i>.pt`, written by a local run or by the
    swarm's training peers) into a Hugging Face folder at `out_dir`, with a model card
    (`README.md`) built from the run's config, evaluations (evaluation.json too, when the run's
    model was compared with its base), last swarm snapshot and shard checksums.

    `weights`: "served", the weights the inference replicas held at that version (what generated
    the rollouts and answered the swarm's evaluations; with sparse updates the learner's changes
    not yet sent are missing), or "learner", the training peers' own. A checkpoint that carries no
    served weights (a local run, whose replicas get every version whole) has one kind only."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: it has no config.json")
    config = load_config(config_path)
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None or not checkpoint.is_dir():
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint (checkpoints/latest)")
    stages, versions, hashes, served = [], set(), [], []
    for index in range(config.num_stages):
        path = checkpoint / f"stage{index}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {checkpoint} lacks {path.name}")
        hashes.append(file_sha256(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
        stage = load_stage(config, index, torch.device("cpu"), torch.float32)
        served.append(weights == "served" and "served" in state)
        try:
            # In LoRA mode only the adapters were published; the rest is the learner's (frozen).
            stage.load_state_dict({**state["weights"], **(state["served"] if served[-1] else {})})
        except (KeyError, RuntimeError) as error:
            raise ValueError(f"{path} does not hold stage {index} of this run: {error}") from None
        stage.version = int(state["version"])
        versions.add(stage.version)
        stages.append(stage)
    if len(versions) != 1:
        raise ValueError(f"checkpoint {checkpoint} mixes stage versions {sorted(versions)}")
    if len(set(served)) != 1:
        raise ValueError(f"checkpoint {checkpoint} carries served weights for some stages only")
    evaluations = [read_evaluation(run_dir / name) for name in ("eval_before.json",
                                                                "eval_after.json")]
    suite_path = run_dir / "evaluation.json"
    suite = SuiteResult.from_json(json.loads(suite_path.read_text())) if suite_path.is_file() \
        else None
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else None
    steps = max((r.step for r in records.steps), default=0) if records else 0
    snapshot = records.snapshots[-1] if records and records.snapshots else None
    card = model_card(config, versions.pop(), steps, hashes, *evaluations, suite, snapshot,
                      "served" if served[0] else "learner")
    folder = resolve_model(config.model)
    hf_config = json.loads((folder / "config.json").read_text())
    return export_hf_folder(stages, hf_config, load_tokenizer(folder), out_dir,
                            extra_files={"README.md": card}, dtype=dtype)


def load_stages_from_folder(path: Path, num_stages: int, device: torch.device,
                            dtype: torch.dtype) -> list[StageModule]:
    """Stages of an evenly split plan, built from a Hugging Face folder (an export, for one)."""
    model = load_model(str(path))
    plan = StagePlan.even(model.spec.num_layers, num_stages)
    return build_stages(model.spec, plan, model.tensors, device, dtype)
