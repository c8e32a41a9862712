"""Cutting the decoder into pipeline stages. Stage 0 owns the token embedding, the last stage owns
the final norm and the head, every stage owns a contiguous range of layers and its own KV cache.

Tied embeddings: a stage boundary separates the embedding (stage 0) from the head (last stage), so
keeping one shared matrix would need a gradient all-reduce across the first and last peers on every
step. We untie instead: the head starts as a copy of the embedding and the two then train
independently; an exported model says `tie_word_embeddings: false` and carries both matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from decentrl.model.blocks import (
    DecoderLayer,
    LayerCache,
    ModelSpec,
    RMSNorm,
    SessionRows,
    attention_mask,
    kv_capacity,
    rotary_tables,
)


@dataclass(frozen=True)
class StagePlan:
    """Layer ranges of the stages: stage i holds layers [starts[i], starts[i+1])."""

    num_layers: int
    starts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0:
            raise ValueError(f"stage plan must start at layer 0, got starts={self.starts}")
        if any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"every stage needs at least one layer, got starts={self.starts}")
        if self.starts[-1] >= self.num_layers:
            raise ValueError(f"stage starts {self.starts} leave no layer for the last stage "
                             f"of a {self.num_layers}-layer model")

    @classmethod
    def even(cls, num_layers: int, num_stages: int) -> StagePlan:
        if not 1 <= num_stages <= num_layers:
            raise ValueError(f"num_stages must be in [1, {num_layers}] for a {num_layers}-layer "
                             f"model, got {num_stages}")
        base, extra = divmod(num_layers, num_stages)
        starts, start = [], 0
        for stage in range(num_stages):
            starts.append(start)
            start += base + (1 if stage < extra else 0)
        return cls(num_layers, tuple(starts))

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def layers(self, stage: int) -> range:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} does not exist in a {self.num_stages}-stage plan")
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else self.num_layers
        return range(self.starts[stage], end)


class LayerKV(Protocol):
    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys/values; return the keys/values of every position."""
        ...


class StageKV(Protocol):
    """What a stage needs of a cache: one entry per layer and how many positions it holds."""

    layers: Sequence[LayerKV]
    length: int


class StageCache:
    """The KV cache of one stage for one batch of sequences (one generation session). It starts
    empty and grows with the positions written (LayerCache), up to `max_length`."""

    def __init__(self, spec: ModelSpec, num_layers: int, batch: int, max_length: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_layers < 1:
            raise ValueError(f"a stage cache needs at least one layer, got {num_layers}")
        self.layers = [LayerCache(batch, spec.num_kv_heads, max_length, spec.head_dim, dtype, device)
                       for _ in range(num_layers)]
        self.max_length = max_length
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions every layer has room for (all grow together)."""
        return self.layers[0].capacity

    def capacity_for(self, length: int) -> int:
        """The capacity once `length` positions are held."""
        return max(self.capacity, kv_capacity(length, self.max_length))

    def reserve(self, length: int) -> None:
        """Room for `length` positions in every layer (a ValueError past `max_length`)."""
        for layer in self.layers:
            layer.reserve(length)

    @property
    def nbytes(self) -> int:
        """The bytes the cache's keys and values take."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)


class RecordingKV:
    """Keeps one layer's keys/values of a forward from position 0, as computed (with their graph
    when gradients are on)."""

    keys: torch.Tensor
    values: torch.Tensor

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = keys, values
        return keys, values


@dataclass
class LayerList:
    layers: list = field(default_factory=list)
    length: int = 0


def distinct_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows equal in every one of `tensors` (bit for bit) are one: the first row of each distinct
    row [U], and for every row the index of its distinct row among those [B]."""
    batch = tensors[0].shape[0]
    key = torch.zeros(batch, dtype=torch.long, device=tensors[0].device)
    for tensor in tensors:
        bits = tensor.reshape(batch, -1).contiguous().view(torch.uint8)
        _, inverse = torch.unique(bits, dim=0, return_inverse=True)
        key = key * batch + inverse
    _, row_of = torch.unique(key, return_inverse=True)
    first = torch.full((int(row_of.max()) + 1,), batch, dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, row_of, torch.arange(batch, device=key.device), "amin")
    return first, row_of


@dataclass(frozen=True)
class SessionStep:
    """One session's step in a batch of several (StageModule.body_sessions)."""

    inputs: torch.Tensor  # [B, T] token ids (stage 0) or hidden states of the new positions
    positions: torch.Tensor  # [B, T]
    key_valid: torch.Tensor  # [B, cached + T]
    cache: StageCache


class StageModule(nn.Module):
    """One pipeline stage. Input: token ids (stage 0) or hidden states; output: hidden states, or
    logits at the last stage. `version` counts the optimizer steps behind these weights."""

    def __init__(self, spec: ModelSpec, plan: StagePlan, index: int) -> None:
        super().__init__()
        self.spec, self.plan, self.index = spec, plan, index
        self.layer_ids = plan.layers(index)
        self.is_first = index == 0
        self.is_last = index == plan.num_stages - 1
        self.version = 0
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in self.layer_ids)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if self.is_last else None

    def new_cache(self, batch: int, max_length: int) -> StageCache:
        param = next(self.parameters())
        return StageCache(self.spec, len(self.layers), batch, max_length, param.dtype, param.device)

    def body(self, inputs: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             cache: StageKV | None = None) -> torch.Tensor:
        """Embedding (stage 0) and this stage's layers. `inputs` covers the new positions only;
        `key_valid` [B, cached + new] marks real tokens; `cache` holds the earlier positions."""
        start = cache.length if cache is not None else 0
        if key_valid.shape[1] != start + inputs.shape[1]:
            raise ValueError(f"key_valid covers {key_valid.shape[1]} positions, expected "
                             f"{start} cached + {inputs.shape[1]} new")
        if isinstance(cache, StageCache) and start == 0 and inputs.shape[0] > 1:
            first, row_of = distinct_rows(inputs, positions, key_valid)
            if first.shape[0] < inputs.shape[0]:
                return self._prefill_distinct(inputs, positions, key_valid, cache, first, row_of)
        x = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        rope = rotary_tables(positions, self.spec.head_dim, self.spec.rope_theta, x.dtype)
        mask = attention_mask(key_valid, start, inputs.shape[1])
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, cache.layers[i] if cache is not None else None, start)
        if cache is not None:
            cache.length = start + inputs.shape[1]
        return x

    def body_sessions(self, steps: Sequence[SessionStep]) -> list[torch.Tensor]:
        """The body over the steps of several sessions at once (continuous batching on a peer):
        one batch through the projections and MLPs, each session's attention over its own cache.
        Every step feeds the same number of new positions; each gets the hidden states it would
        get alone, and its cache moves on as alone."""
        new = {step.inputs.shape[1] for step in steps}
        if len(new) != 1:
            raise ValueError(f"batched steps must feed the same number of positions, got {new}")
        (length,) = new
        sessions, row = [], 0
        for step in steps:
            start, batch = step.cache.length, step.inputs.shape[0]
            if step.key_valid.shape != (batch, start + length):
                raise ValueError(f"key_valid {tuple(step.key_valid.shape)} for {batch} rows "
                                 f"holding {start} cached + {length} new positions")
            sessions.append(SessionRows(slice(row, row + batch), step.cache.layers, start,
                                        attention_mask(step.key_valid, start, length)))
            row += batch
        inputs = torch.cat([step.inputs for step in steps])
        x = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        rope = rotary_tables(torch.cat([step.positions for step in steps]), self.spec.head_dim,
                             self.spec.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward_sessions(x, rope, sessions, i)
        for step in steps:
            step.cache.length += length
        return [x[session.rows] for session in sessions]

    def _prefill_distinct(self, inputs: torch.Tensor, positions: torch.Tensor,
                          key_valid: torch.Tensor, cache: StageCache, first: torch.Tensor,
                          row_of: torch.Tensor) -> torch.Tensor:
        """A session's first step when rows repeat (a group's episodes share their prompt): each
        distinct row runs once, and its keys/values and outputs are copied to its repeats."""
        recorded = LayerList([RecordingKV() for _ in self.layers])
        x = self.body(inputs[first], positions[first], key_valid[first], recorded)
        for layer_cache, layer in zip(cache.layers, recorded.layers):
            layer_cache.write(0, layer.keys[row_of], layer.values[row_of])
        cache.length = inputs.shape[1]
        return x[row_of]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (last stage only)."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError(f"stage {self.index} is not the last stage and has no head")
        return self.lm_head(self.norm(hidden))

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                cache: StageKV | None = None,
                head_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states, or logits at the last stage. There, `head_positions` [B, new] selects
        where logits are needed (returned flat, [N, vocab]): the head is a large matmul and most
        positions need none."""
        x = self.body(inputs, positions, key_valid, cache)
        if not self.is_last:
            return x
        return self.head(x[head_positions] if head_positions is not None else x)

    def hf_names(self) -> dict[str, str]:
        """Map from this module's parameter names to Hugging Face checkpoint names."""
        names: dict[str, str] = {}
        for name, _ in self.named_parameters():
            if name.startswith("layers."):
                local, rest = name.split(".", 2)[1:]
                names[name] = f"model.layers.{self.layer_ids[int(local)]}.{rest}"
            elif name.startswith("lm_head."):
                names[name] = name
            else:
                names[name] = f"model.{name}"
        return names

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load this stage's slice of a full Hugging Face state dict (untying a tied head)."""
        own: dict[str, torch.Tensor] = {}
        for local, hf in self.hf_names().items():
            source = hf
            if hf == "lm_head.weight" and hf not in tensors:
                source = "model.embed_tokens.weight"  # tied checkpoint: the head is a copy
            if source not in tensors:
                raise KeyError(f"checkpoint has no tensor {source!r} needed by stage {self.index}")
            own[local] = tensors[source]
        self.load_state_dict(own, strict=True)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        names = self.hf_names()
        return {names[k]: v for k, v in self.state_dict().items()}


def build_stage(spec: ModelSpec, plan: StagePlan, index: int, tensors: dict[str, torch.Tensor],
                device: torch.device, dtype: torch.dtype) -> StageModule:
    """One stage from a Hugging Face state dict holding (at least) that stage's tensors."""
    if plan.num_layers != spec.num_layers:
        raise ValueError(f"stage plan covers {plan.num_layers} layers, the model has {spec.num_layers}")
    with torch.device("meta"):
        stage = StageModule(spec, plan, index)
    stage = stage.to_empty(device=device)
    stage.load_hf_state_dict(tensors)
    return stage.to(dtype)


def build_stages(spec: ModelSpec, plan: StagePlan, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> list[StageModule]:
    return [build_stage(spec, plan, index, tensors, device, dtype)
            for index in range(plan.num_stages)]
