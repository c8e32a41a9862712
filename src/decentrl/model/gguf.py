"""GGUF checkpoints: a file's Hugging Face config read from its metadata alone, the refusal of an
architecture transformers cannot read from GGUF or decentrl does not run, and the conversion,
once, into a safetensors folder that records the file it came from. Nothing here reaches a hub."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decentrl.model.families import FAMILIES, spec_from_hf_config
from decentrl.model.spec import UnsupportedModel
from decentrl.staging import staged_folder

GGUF_SUFFIX = ".gguf"
# Written into the converted folder: which GGUF file it was converted from.
CONVERTED_FROM = "converted_from.json"
# transformers' model_type -> gguf-py's name of the architecture, where the two differ (as
# transformers maps them to find a file's tensors).
GGUF_NAME_OF = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
# A Hugging Face config's count of experts (Mixtral's, Qwen-MoE's).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts")


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a model's weights were dequantized from."""

    distribution: str | None  # the pip package that ships it; None for a file of the user's own
    version: str | None  # that package's version
    file: str
    sha256: str


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# Enough for every shard of a large sharded model (its files are hashed one by one) and a GGUF.
@functools.lru_cache(maxsize=1024)
def _sha256_while_unchanged(path: Path, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def remembered_sha256(path: Path) -> str:
    """file_sha256, remembered per process while the file is unchanged (a multi-gigabyte GGUF
    is named by its hash on every resolve; a run's owner declares its model's shards by hash at
    every manifest)."""
    stat = path.stat()
    return _sha256_while_unchanged(path.resolve(), stat.st_size, stat.st_mtime_ns)


def gguf_source(path: Path, distribution: str | None = None) -> GgufSource:
    """`path` described by its sha256 and, for a file a pip package ships, that package."""
    version = importlib.metadata.version(distribution) if distribution is not None else None
    return GgufSource(distribution, version, path.name, remembered_sha256(path))


def gguf_families() -> list[str]:
    """The registered families whose GGUF files transformers reads: it builds their config from
    the metadata, and gguf-py names their tensors (transformers reads a Mistral file's config,
    written by llama.cpp as "llama", but finds no "mistral" tensor names to load it with)."""
    from gguf import MODEL_ARCH_NAMES
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    configs, tensors = set(GGUF_SUPPORTED_ARCHITECTURES), set(MODEL_ARCH_NAMES.values())
    return [model_type for model_type in FAMILIES
            if configs & {model_type, GGUF_NAME_OF.get(model_type)}
            and GGUF_NAME_OF.get(model_type, model_type) in tensors]


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The file's metadata keys (no tensor data is read); a file that is not GGUF is refused."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(path))
    except (ValueError, OSError, IndexError, struct.error) as error:
        raise UnsupportedModel(f"{path} is not a readable GGUF file: {error}") from error
    return metadata


def gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config transformers builds from the GGUF file's metadata, checked: an
    architecture transformers cannot read, a family decentrl does not run (named with the
    nearest one it does) or a feature it does not implement is refused before anything is
    converted."""
    from transformers import AutoConfig

    metadata = gguf_metadata(path)
    architecture = str(metadata.get("general.architecture"))
    readable = ", ".join(gguf_families())
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    except (ValueError, KeyError, NotImplementedError) as error:
        raise UnsupportedModel(
            f"{path}: transformers cannot read a GGUF file of architecture {architecture!r} "
            f"({error}); decentrl runs GGUF files of: {readable}") from error
    if config["model_type"] in FAMILIES and config["model_type"] not in gguf_families():
        raise UnsupportedModel(
            f"{path}: transformers reads this GGUF file (architecture {architecture!r}) as "
            f"{config['model_type']!r} but cannot load its tensors; decentrl runs GGUF files of: "
            f"{readable}")
    try:
        spec_from_hf_config(config)
    except UnsupportedModel as error:
        raise UnsupportedModel(f"{path} (GGUF architecture {architecture!r}): {error}") from error
    experts = metadata.get(f"{architecture}.expert_count")
    if experts and not any(config.get(field) for field in EXPERT_COUNT_FIELDS):
        # llama.cpp writes Mixtral as "llama" with experts; transformers reads it as dense Llama.
        raise UnsupportedModel(
            f"{path}: a mixture of experts ({experts} experts) under GGUF architecture "
            f"{architecture!r}, which transformers reads as the dense {config['model_type']!r}; "
            f"decentrl runs GGUF files of: {readable}")
    return config


def convert_gguf(source: Path, out_dir: Path, origin: GgufSource) -> Path:
    """Dequantize a GGUF checkpoint once into a safetensors folder, which records the file it came
    from (CONVERTED_FROM). Writes to a temporary folder and renames it into place, so an
    interrupted conversion never leaves a half-written cache, and two processes converting at
    once both end with the same folder."""
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
    with staged_folder(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_FROM).write_text(json.dumps(asdict(origin), indent=2) + "\n")
        if out_dir.exists():  # another process finished first; theirs is as good as ours
            shutil.rmtree(staging)
        else:
            staging.rename(out_dir)
    return out_dir


def recorded_source(folder: Path) -> GgufSource | None:
    """The GGUF file a converted `folder` records (CONVERTED_FROM), if it records one."""
    record = folder / CONVERTED_FROM
    return GgufSource(**json.loads(record.read_text())) if record.is_file() else None
