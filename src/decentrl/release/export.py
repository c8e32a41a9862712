"""Assembling the stages into one Hugging Face model folder: the only place the whole model exists.

The folder loads with `transformers.AutoModelForCausalLM` and `AutoTokenizer`. The head and the
embedding were untied when the stages were built (see model/stages.py), so the exported config says
`tie_word_embeddings: false` and the checkpoint carries both matrices. LoRA stages are exported
with their adapters merged into the weights: the folder is a plain model.

An export never deletes what it did not write: it refuses an output folder that is not empty
unless asked to replace an earlier export (`force`), and refuses always a folder that is, or
holds, a run folder or anything the export reads.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Literal, get_args

import torch

from decentrl.config import is_run_folder, load_config
from decentrl.errors import DecentrlError
from decentrl.evaluate.suite import SuiteResult
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.model.families import spec_from_hf_config
from decentrl.model.loading import (
    base_origin,
    file_sha256,
    load_model,
    load_tokenizer,
    model_spec,
    resolve_model,
)
from decentrl.model.lora import has_lora, merge_lora
from decentrl.model.planner import parameter_counts
from decentrl.model.run_stage import load_stage
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.net.identity import Identity
from decentrl.observe.metrics import read_metrics
from decentrl.observe.report_data import read_evaluation
from decentrl.release.assembly import (
    EXPORT_DTYPES,
    MAX_SINGLE_FILE_BYTES,
    SHARD_INDEX,
    SHARD_NAME,
    SINGLE_FILE,
    ModelAssembly,
    write_weights,
)
from decentrl.release.card import ModelSize, model_card
from decentrl.release.shards import ShardRecord, check_shard, read_manifest
from decentrl.staging import staged_folder

WRITTEN_FILES = (SINGLE_FILE, SHARD_INDEX, "config.json", "generation_config.json")
CHECKSUMS = "SHA256SUMS"
Weights = Literal["served", "learner"]
WEIGHTS: tuple[str, ...] = get_args(Weights)
# A run folder holds its config and at least one of these (coordinator/loop.py).
SHOWN_NAMES = 3  # entries a refusal names before "..."


class UnsafeOutputFolder(DecentrlError, ValueError):
    """The output folder holds something the export must not replace; the message says what is
    there and what to do."""


def plain_stage(stage: StageModule) -> StageModule:
    """`stage` itself, or for a LoRA stage a copy with the adapters merged (the caller's stage
    keeps its adapters, and may keep training)."""
    if not has_lora(stage):
        return stage
    merged = copy.deepcopy(stage)
    merge_lora(merged)
    return merged


def export_config(hf_config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    # "_"-prefixed keys are the converter's bookkeeping (the GGUF's own model name, for one), and
    # the weights are no longer quantized.
    config = {key: value for key, value in hf_config.items()
              if not key.startswith("_") and key != "quantization_config"}
    config["tie_word_embeddings"] = False
    config["dtype"] = EXPORT_DTYPES[dtype]
    config["torch_dtype"] = EXPORT_DTYPES[dtype]  # the name transformers 4 reads
    return config


def check_extra_name(name: str) -> None:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"extra file name {name!r} must be a relative path inside the folder")
    if name in WRITTEN_FILES or SHARD_NAME.match(name):
        raise ValueError(f"extra file name {name!r} would overwrite the exported {name}")


def export_hf_folder(stages: list[StageModule], hf_config: dict[str, Any], tokenizer: Any,
                     out_dir: Path, extra_files: dict[str, str] | None = None,
                     dtype: torch.dtype = torch.float32, force: bool = False) -> Path:
    """Write the model of `stages` (all of them, any order) as a Hugging Face folder at `out_dir`.

    `out_dir` must be new or empty; with `force` it may hold an earlier export, which is replaced
    (check_output_folder). `extra_files` maps relative file names to text (a model card, a
    training report). `SHA256SUMS` lists every file's checksum (`sha256sum -c SHA256SUMS` checks
    a download)."""
    out_dir = Path(out_dir)
    check_output_folder(out_dir, force)
    if not stages:
        raise ValueError("cannot export a model from no stages")
    assembly = model_assembly(stages[0].spec, hf_config, dtype)
    converted = (assembly.add(position, plain_stage(stage).hf_state_dict())
                 for position, stage in enumerate(stages))
    return write_hf_folder(converted, len(stages), assembly, hf_config, tokenizer, out_dir,
                           lambda size: extra_files or {}, force)


def model_assembly(spec: ModelSpec, hf_config: dict[str, Any], dtype: torch.dtype
                   ) -> ModelAssembly:
    """The assembly of a model of `spec` exported in `dtype`, checked against its config."""
    if hf_config.get("num_hidden_layers") != spec.num_layers:
        raise ValueError(f"hf_config has num_hidden_layers={hf_config.get('num_hidden_layers')} "
                         f"but the stages were built for {spec.num_layers} layers")
    return ModelAssembly(spec.num_layers, dtype)


def write_hf_folder(stages: Iterable[dict[str, torch.Tensor]], count: int,
                    assembly: ModelAssembly, hf_config: dict[str, Any], tokenizer: Any,
                    out_dir: Path, extra_files: Callable[[ModelSize], dict[str, str]],
                    force: bool) -> Path:
    """Write the `count` stages' tensors (converted by `assembly`, which checks them) and the
    rest of the folder at `out_dir`, which the caller has checked (check_output_folder); the
    extra files (a model card) are made from what was written. A model over
    MAX_SINGLE_FILE_BYTES is written a shard a stage, each stage as it comes. The folder is
    written under a temporary name next to `out_dir` and renamed into place, so a reader never
    sees half a model, and an earlier export (`force`) is replaced only then."""
    dtype = assembly.dtype
    with staged_folder(out_dir) as staging:
        sharded = count > 1 and export_bytes(hf_config, dtype) > MAX_SINGLE_FILE_BYTES
        write_weights(stages, count, sharded, staging)
        size = assembly.finish(bool(hf_config.get("tie_word_embeddings")))
        files = extra_files(size)
        for name in files:
            check_extra_name(name)
        (staging / "config.json").write_text(
            json.dumps(export_config(hf_config, dtype), indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(staging)
        generation = {"bos_token_id": tokenizer.bos_token_id,
                      "eos_token_id": tokenizer.eos_token_id,
                      "pad_token_id": tokenizer.pad_token_id}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for name, text in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (staging / CHECKSUMS).write_text(checksums(staging))
        # mkdtemp makes the folder private (0700) and safetensors writes its file 0600; a release
        # is for everyone to read.
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if force:
            replace_folder(staging, out_dir)
        else:
            # A rename replaces an empty folder and fails on one that filled up meanwhile.
            staging.rename(out_dir)
    return out_dir


def export_bytes(hf_config: dict[str, Any], dtype: torch.dtype) -> int:
    """What the exported weights take, from the model's config alone (nothing read)."""
    # The stages untie a tied head (model/stages.py), and so does the export: both count.
    embed, head, layers = parameter_counts(spec_from_hf_config(hf_config))
    return (embed + head + sum(layers)) * torch.empty(0, dtype=dtype).element_size()


def names_text(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:SHOWN_NAMES])
    return shown + (", ..." if len(names) > SHOWN_NAMES else "")


def check_output_folder(out_dir: Path, force: bool, inputs: Mapping[str, Path] | None = None
                        ) -> None:
    """Refuse an `out_dir` that writing the export would lose files from, with an
    UnsafeOutputFolder that says what is there and what to do. Refused always: a file, a folder
    that is or holds one of `inputs` (what the export reads, by description), a run folder.
    Refused unless `force`: any other non-empty folder. Refused even then: one holding a file
    that its SHA256SUMS does not list, i.e. anything but an earlier export as it was written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UnsafeOutputFolder(f"{out_dir} is a file, not a folder: choose an empty or new "
                                 "folder for the export")
    target = out_dir.resolve()
    for description, path in (inputs or {}).items():
        source = path.resolve()
        if source == target:
            raise UnsafeOutputFolder(f"{out_dir} is {description}, which this export reads: "
                                     "choose an empty or new folder outside it")
        if target in source.parents:
            raise UnsafeOutputFolder(f"{out_dir} holds {description} {path}, which this export "
                                     "reads: choose an empty or new folder outside it")
    entries = [entry.name for entry in out_dir.iterdir()] if out_dir.exists() else []
    if not entries:
        return
    if is_run_folder(out_dir):
        raise UnsafeOutputFolder(f"{out_dir} is a run folder (config.json with its checkpoints, "
                                 "store or metrics): choose an empty or new folder; an export "
                                 "never replaces a run")
    sums = out_dir / CHECKSUMS
    if not force and sums.is_file():
        raise UnsafeOutputFolder(f"{out_dir} holds an earlier export: pass --force to replace "
                                 "it, or choose an empty or new folder")
    if not force:
        raise UnsafeOutputFolder(f"{out_dir} is not empty (it holds {names_text(entries)}): "
                                 "choose an empty or new folder")
    listed = {CHECKSUMS, *(line.split("  ", 1)[-1] for line in sums.read_text().splitlines())
              } if sums.is_file() else set()
    unlisted: list[str] = []
    # Symbolic links are entries, never followed: replacing the folder removes the link only.
    for root, dirs, files in os.walk(out_dir):
        here = Path(root)
        if is_run_folder(here):
            raise UnsafeOutputFolder(f"{out_dir} holds the run folder {here}: choose an empty or "
                                     "new folder; an export never replaces a run")
        links = [name for name in dirs if (here / name).is_symlink()]
        for name in [*files, *links]:
            relative = (here / name).relative_to(out_dir).as_posix()
            if relative not in listed:
                unlisted.append(relative)
        if len(unlisted) > SHOWN_NAMES:
            break  # enough to name; the folder may be large
    if unlisted:
        raise UnsafeOutputFolder(f"{out_dir} holds files that no export wrote "
                                 f"({names_text(unlisted)}): choose an empty or new folder; "
                                 "--force replaces only an earlier export")


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


def signed_shards(run_dir: Path, layout: CheckpointLayout, version: int
                  ) -> dict[int, ShardRecord]:
    """The shards the run's owner signed for checkpoint `version` (a swarm run's), by stage;
    empty for a run without a manifest (a local run)."""
    key = run_dir / "keys" / "owner.key"
    if not key.is_file():
        return {}
    manifest = read_manifest(layout, version, Identity.from_file(key).peer_id)
    return {} if manifest is None else {record.stage: record for record in manifest.shards}


def export_run(run_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32,
               weights: Weights = "served", force: bool = False) -> Path:
    """Assemble the latest checkpoint of a run (its folder: `config.json` and
    `checkpoints/latest` -> `checkpoints/v<N>/stage<i>.pt`, written by a local run or by the
    swarm's training peers; the weights files alone, never the optimizer state beside them)
    into a Hugging Face folder at `out_dir`, with a model card
    (`README.md`) built from the run's config, evaluations (evaluation.json too, when the run's
    model was compared with its base), last swarm snapshot and shard checksums.

    `out_dir` must be new or empty, or with `force` an earlier export, and never the run folder,
    a folder holding it, or the base model's folder (check_output_folder); a folder inside the
    run (`runs/demo/model`) is the usual place.

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
    layout = CheckpointLayout(run_dir / "checkpoints")
    version = layout.latest_version()
    if version is None or not layout.folder(version).is_dir():
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint (checkpoints/latest)")
    folder = resolve_model(config.model)
    checkpoint = layout.folder(version)
    check_output_folder(out_dir, force, {"the run folder": run_dir, "the checkpoint": checkpoint,
                                         "the base model's folder": folder})
    signed = signed_shards(run_dir, layout, version)
    hashes = []
    for index in range(config.num_stages):
        path = layout.stage_file(version, index)
        if index in signed:  # a shard the coordinator signed, fetched or not
            hashes.append(check_shard(path, signed[index]))
        elif path.is_file():
            hashes.append(file_sha256(path))
        else:
            raise FileNotFoundError(f"checkpoint {checkpoint} lacks {path.name}")
    hf_config = json.loads((folder / "config.json").read_text())
    assembly = model_assembly(model_spec(folder), hf_config, dtype)
    versions: set[int] = set()
    served: list[bool] = []

    def stages() -> Iterator[dict[str, torch.Tensor]]:
        """Each stage with the checkpoint's weights, LoRA merged, converted: one at a time."""
        for index in range(config.num_stages):
            path = layout.stage_file(version, index)
            state = torch.load(path, map_location="cpu", weights_only=True)
            stage = load_stage(config, index, torch.device("cpu"), torch.float32)
            served.append(weights == "served" and "served" in state)
            try:
                # In LoRA mode only the adapters were published; the rest is the learner's
                # (frozen).
                stage.load_state_dict({**state["weights"],
                                       **(state["served"] if served[-1] else {})})
            except (KeyError, RuntimeError) as error:
                raise ValueError(f"{path} does not hold stage {index} of this run: "
                                 f"{error}") from None
            versions.add(int(state["version"]))
            if len(versions) != 1:
                raise ValueError(f"checkpoint {checkpoint} mixes stage versions "
                                 f"{sorted(versions)}")
            if len(set(served)) != 1:
                raise ValueError(f"checkpoint {checkpoint} carries served weights for some "
                                 f"stages only")
            del state
            if has_lora(stage):
                merge_lora(stage)  # in place: this stage is the export's own
            yield assembly.add(index, stage.hf_state_dict())

    evaluations = [read_evaluation(run_dir / name) for name in ("eval_before.json",
                                                                "eval_after.json")]
    suite_path = run_dir / "evaluation.json"
    suite = SuiteResult.from_json(json.loads(suite_path.read_text())) if suite_path.is_file() \
        else None
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else None
    steps = max((r.step for r in records.steps), default=0) if records else 0
    snapshot = records.snapshots[-1] if records and records.snapshots else None

    def card(size: ModelSize) -> dict[str, str]:
        return {"README.md": model_card(config, base_origin(config.model), size,
                                        next(iter(versions)), steps, hashes, *evaluations,
                                        suite, snapshot, "served" if served[0] else "learner")}

    return write_hf_folder(stages(), config.num_stages, assembly, hf_config,
                           load_tokenizer(folder), out_dir, card, force)


def load_stages_from_folder(path: Path, num_stages: int, device: torch.device,
                            dtype: torch.dtype) -> list[StageModule]:
    """Stages of an evenly split plan, built from a Hugging Face folder (an export, for one)."""
    model = load_model(str(path))
    plan = StagePlan.even(model.spec.num_layers, num_stages)
    return build_stages(model.spec, plan, model.tensors, device, dtype)
