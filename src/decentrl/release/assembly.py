"""The exported model's weights, one stage at a time.

Each stage's tensors are checked as they arrive against the stages before (no tensor twice,
every layer held by exactly one stage; at the end the embedding, final norm and head present),
converted to the export dtype and, for a model over `MAX_SINGLE_FILE_BYTES`, written at once as a
safetensors shard of their own (`model-0000i-of-0000n.safetensors` and the index transformers
reads), so an export never holds more than one stage of a model that no peer could hold whole.
A smaller model goes into one `model.safetensors`, as before."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from decentrl.release.card import ModelSize

EXPORT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
REQUIRED_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# Hugging Face shards checkpoints past 5 GB; a stage per shard past 4 GiB keeps any file under it
# for the models a swarm splits (an 8B model's eighth is 2 GB in bf16).
MAX_SINGLE_FILE_BYTES = 4 * 1024**3


class ModelAssembly:
    """Stages' tensors (Hugging Face names), checked to form exactly one model as they come."""

    def __init__(self, num_layers: int, dtype: torch.dtype) -> None:
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype must be one of {list(EXPORT_DTYPES)}, got {dtype}")
        self.num_layers, self.dtype = num_layers, dtype
        self.owner: dict[str, int] = {}  # tensor name -> position of the stage that gave it
        self.layer_owner: dict[int, int] = {}
        self.parameters = 0
        self.nbytes = 0
        self.head_parameters = 0

    def add(self, position: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage `position`'s tensors, checked against those before and converted to the export
        dtype, on the CPU, sorted by name."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in sorted(tensors.items()):
            if name in self.owner:
                raise ValueError(f"tensor {name!r} appears in stage {self.owner[name]} and stage "
                                 f"{position}: the stages overlap")
            match = LAYER_NAME.match(name)
            if match:
                layer = int(match.group(1))
                if self.layer_owner.setdefault(layer, position) != position:
                    raise ValueError(f"layer {layer} appears in stage {self.layer_owner[layer]} "
                                     f"and stage {position}: the stages overlap")
                if layer >= self.num_layers:
                    raise ValueError(f"the stages hold layer {layer}, beyond the "
                                     f"{self.num_layers} layers the config declares")
            self.owner[name] = position
            converted = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous()
            out[name] = converted
            self.parameters += converted.numel()
            self.nbytes += converted.numel() * converted.element_size()
            if name == "lm_head.weight":
                self.head_parameters = converted.numel()
        return out

    def finish(self, tied_base: bool) -> ModelSize:
        """What the export holds, once every stage was added; ValueError naming what is missing.
        `tied_base`: the base stored its head as its embedding (counted once there)."""
        missing_layers = sorted(set(range(self.num_layers)) - set(self.layer_owner))
        if missing_layers:
            raise ValueError(f"the stages hold no weights for layers {missing_layers} of a "
                             f"{self.num_layers}-layer model: every stage must be exported")
        missing = [name for name in REQUIRED_TENSORS if name not in self.owner]
        if missing:
            raise ValueError(f"the stages lack {missing}: the first stage (embedding) and the "
                             "last stage (final norm and head) must be exported")
        tied = self.head_parameters if tied_base else 0
        return ModelSize(self.parameters, self.parameters - tied, EXPORT_DTYPES[self.dtype],
                         self.nbytes)


def write_weights(stages: Iterable[dict[str, torch.Tensor]], count: int, sharded: bool,
                  folder: Path) -> None:
    """Write `count` stages' converted tensors into `folder`: one shard a stage, each written as
    it comes (`sharded`), or all of them into one file."""
    if not sharded:
        merged: dict[str, torch.Tensor] = {}
        for tensors in stages:
            merged.update(tensors)
        save_file(dict(sorted(merged.items())), folder / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total = 0
    written = 0
    for number, tensors in enumerate(stages, start=1):
        name = f"model-{number:05d}-of-{count:05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        written = number
        tensors.clear()  # the caller's dict too: the stage's tensors go as soon as written
    if written != count:
        raise ValueError(f"{written} stages were written of the {count} announced")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")
