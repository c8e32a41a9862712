"""Cutting the decoder into pipeline stages. Stage 0 owns the token embedding, the last stage owns
the final norm and the head, every stage owns a contiguous range of layers and its own KV cache.

Tied embeddings: a stage boundary separates the embedding (stage 0) from the head (last stage), so
keeping one shared matrix would need a gradient all-reduce across the first and last peers on every
step. We untie instead: the head starts as a copy of the embedding and the two then train
independently; an exported model says `tie_word_embeddings: false` and carries both matrices.

Mixture of experts: a stage holds its own layers' experts. They are read from a checkpoint in
either form transformers reads (per expert, or fused) and exported per expert, as save_pretrained
writes them (model/moe_checkpoint.py). A forward can return the experts every new position went
to, per sparse layer of the stage (`body_routed`, `forward_routed`, `body_sessions_routed`:
`Routed.experts`, [B, T, sparse layers, top_k]), and can replay such a record (`replay`, the same
shape; FREE_ROUTE rows route freely), so a learner's tokens go through the experts that sampled
them. A dense stage returns no record and pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import nn

from decentrl.model.blocks import (
    DecoderLayer,
    LayerCache,
    RMSNorm,
    Rope,
    SessionRows,
    attention_mask,
    kv_capacity,
)
from decentrl.model.moe import FREE_ROUTE, RoutingReplayError
from decentrl.model.moe_checkpoint import (
    checkpoint_tensors_of_experts,
    expert_tensors_from_checkpoint,
    layer_checkpoint_names,
)
from decentrl.model.rope import RopeSpec, rotary_tables
from decentrl.model.spec import ModelSpec

HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


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

    @classmethod
    def sized(cls, num_layers: int, stage_layers: Sequence[int]) -> StagePlan:
        """Stages of the given numbers of layers, from the first; ValueError unless they add up
        to the model's."""
        if sum(stage_layers) != num_layers:
            raise ValueError(f"stage layers {list(stage_layers)} add up to {sum(stage_layers)}, "
                             f"not the model's {num_layers} layers")
        starts = [sum(stage_layers[:stage]) for stage in range(len(stage_layers))]
        return cls(num_layers, tuple(starts))

    @classmethod
    def of(cls, num_layers: int, num_stages: int, stage_layers: Sequence[int] = ()
           ) -> StagePlan:
        """A run's plan: `stage_layers` where given (config `stage_layers`), else even."""
        if stage_layers:
            if len(stage_layers) != num_stages:
                raise ValueError(f"stage layers {list(stage_layers)} name {len(stage_layers)} "
                                 f"stages, not {num_stages}")
            return cls.sized(num_layers, stage_layers)
        return cls.even(num_layers, num_stages)

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return tuple(len(self.layers(stage)) for stage in range(self.num_stages))

    def layers(self, stage: int) -> range:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} does not exist in a {self.num_stages}-stage plan")
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else self.num_layers
        return range(self.starts[stage], end)


def routing_layers(spec: ModelSpec, layers: range) -> slice:
    """The part of a whole model's routing record (its third axis: every sparse layer, in
    order) that covers the sparse layers among `layers` (a stage's)."""
    return slice(spec.sparse_before(layers.start), spec.sparse_before(layers.stop))


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
    replay: torch.Tensor | None = None  # [B, T, sparse layers, top_k]: routing to replay


class Routed(NamedTuple):
    """A stage's output (hidden states, or logits at the last stage) and the experts each new
    position went to in the stage's sparse layers, [B, T, sparse layers, top_k] in
    model/moe.py's dtype; None for a stage without sparse layers."""

    output: torch.Tensor
    experts: torch.Tensor | None


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
        self.layers = nn.ModuleList(DecoderLayer(spec, spec.moe_of(layer))
                                    for layer in self.layer_ids)
        # Each layer's index among the stage's sparse layers (None: a dense MLP), and the
        # stage's slice of a whole-model routing record (whose third axis is every sparse layer
        # of the model, in order).
        sparse = [layer in spec.sparse_layers for layer in self.layer_ids]
        self.sparse_slot = [sum(sparse[:i]) if is_sparse else None
                            for i, is_sparse in enumerate(sparse)]
        self.routing_layers = routing_layers(spec, self.layer_ids)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_kind) \
            if self.is_last else None
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if self.is_last else None
        # The distinct RoPEs and sliding windows of this stage's layers, and each layer's index
        # into them: a forward computes each table and mask once, whatever the number of layers.
        self.ropes: list[RopeSpec] = []
        self.windows: list[int | None] = []
        self.layer_rope: list[int | None] = []
        self.layer_window: list[int] = []
        for layer in self.layer_ids:
            rope, window = spec.rope_of(layer), spec.window_of(layer)
            if rope is not None and rope not in self.ropes:
                self.ropes.append(rope)
            if window not in self.windows:
                self.windows.append(window)
            self.layer_rope.append(None if rope is None else self.ropes.index(rope))
            self.layer_window.append(self.windows.index(window))

    def new_cache(self, batch: int, max_length: int) -> StageCache:
        """An empty cache for `batch` sequences of up to `max_length` positions. Refused past a
        longrope RoPE's original context: there its frequencies switch from short to long for
        every position, so the cached ones would be stale (transformers' Phi-3 re-runs the whole
        prefix at the switch; a stage holds only its own layers' keys and values)."""
        for rope in self.ropes:
            if rope.kind == "longrope" and max_length > rope.original_max_positions:
                raise ValueError(
                    f"{self.spec.model_type}: a KV-cached session of {max_length} positions would "
                    f"cross original_max_position_embeddings ({rope.original_max_positions}), "
                    "where longrope switches every position to its long factors; sessions are "
                    f"limited to {rope.original_max_positions} positions")
        param = next(self.parameters())
        return StageCache(self.spec, len(self.layers), batch, max_length, param.dtype, param.device)

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Stage 0: the token ids' embeddings, scaled as the family does; after: `inputs`."""
        if self.embed_tokens is None:
            return inputs
        x = self.embed_tokens(inputs)
        multiplier = self.spec.embedding_multiplier
        if multiplier != 1.0:
            if self.spec.embedding_multiplier_rounded:
                multiplier = torch.tensor(multiplier, dtype=x.dtype).item()
            x = x * multiplier
        return x

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """Each layer's cos/sin tables at `positions` [B, T] (None for a layer without RoPE)."""
        tables = [rotary_tables(positions, rope, dtype) for rope in self.ropes]
        return [None if index is None else tables[index] for index in self.layer_rope]

    def layer_masks(self, key_valid: torch.Tensor, start: int, length: int
                    ) -> list[torch.Tensor]:
        """Each layer's attention mask for `length` new positions after `start` cached ones."""
        masks = [attention_mask(key_valid, start, length, window) for window in self.windows]
        return [masks[index] for index in self.layer_window]

    @property
    def num_sparse(self) -> int:
        """The stage's sparse (mixture-of-experts) layers."""
        return self.routing_layers.stop - self.routing_layers.start

    def layer_replays(self, replay: torch.Tensor | None, new: torch.Size
                      ) -> list[torch.Tensor | None]:
        """Each layer's routing to replay [B, T, top_k] from the stage's record `replay`
        [B, T, sparse layers, top_k] of `new` (B, T) positions (None for a dense layer). The
        layers' SparseMoE checks the rest (model/moe.py checked_replay); a replay a dense stage
        cannot use, or of another shape, is a RoutingReplayError."""
        if replay is None:
            return [None] * len(self.layers)
        if not isinstance(replay, torch.Tensor):
            raise RoutingReplayError(f"routing replay must be a tensor, got "
                                     f"{type(replay).__name__}")
        if not self.num_sparse:
            raise RoutingReplayError(f"stage {self.index} has no mixture-of-experts layer to "
                                     "replay routing in")
        if replay.dim() != 4 or tuple(replay.shape[:3]) != (*new, self.num_sparse):
            raise RoutingReplayError(
                f"routing replay has shape {tuple(replay.shape)}; stage {self.index} needs "
                f"[{new[0]}, {new[1]}, {self.num_sparse}, top_k] (rows, new positions, its sparse "
                "layers, experts per token)")
        return [None if slot is None else replay[:, :, slot] for slot in self.sparse_slot]

    def stage_routing(self, routing: torch.Tensor) -> torch.Tensor | None:
        """This stage's part [.., .., its sparse layers, top_k] of a whole model's routing record
        [.., .., every sparse layer, top_k]; None for a stage without sparse layers."""
        if routing.dim() != 4 or routing.shape[2] != len(self.spec.sparse_layers):
            raise RoutingReplayError(f"a routing record of shape {tuple(routing.shape)} is not "
                                     f"[rows, positions, {len(self.spec.sparse_layers)} sparse "
                                     "layers, top_k]")
        return routing[:, :, self.routing_layers] if self.num_sparse else None

    def body(self, inputs: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             cache: StageKV | None = None, replay: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding (stage 0) and this stage's layers. `inputs` covers the new positions only;
        `key_valid` [B, cached + new] marks real tokens; `cache` holds the earlier positions;
        `replay` is routing to replay (see body_routed)."""
        return self.body_routed(inputs, positions, key_valid, cache, replay).output

    def body_routed(self, inputs: torch.Tensor, positions: torch.Tensor,
                    key_valid: torch.Tensor, cache: StageKV | None = None,
                    replay: torch.Tensor | None = None) -> Routed:
        """`body`, and the experts each new position went to. With `replay` [B, T, sparse
        layers, top_k] (a record of these positions), those experts run instead of the
        routers' choice, except in rows of FREE_ROUTE."""
        start = cache.length if cache is not None else 0
        if key_valid.shape[1] != start + inputs.shape[1]:
            raise ValueError(f"key_valid covers {key_valid.shape[1]} positions, expected "
                             f"{start} cached + {inputs.shape[1]} new")
        replays = self.layer_replays(replay, inputs.shape[:2])
        if isinstance(cache, StageCache) and start == 0 and inputs.shape[0] > 1:
            first, row_of = distinct_rows(inputs, positions, key_valid,
                                          *(() if replay is None else (replay,)))
            if first.shape[0] < inputs.shape[0]:
                return self._prefill_distinct(inputs, positions, key_valid, cache, first, row_of,
                                              replay)
        x = self.embed(inputs)
        ropes = self.layer_ropes(positions, x.dtype)
        masks = self.layer_masks(key_valid, start, inputs.shape[1])
        records = []
        for i, layer in enumerate(self.layers):
            x, experts = layer(x, ropes[i], masks[i],
                               cache.layers[i] if cache is not None else None, start, replays[i])
            if experts is not None:
                records.append(experts)
        if cache is not None:
            cache.length = start + inputs.shape[1]
        return Routed(x, torch.stack(records, dim=2) if records else None)

    def body_sessions(self, steps: Sequence[SessionStep]) -> list[torch.Tensor]:
        """The body over the steps of several sessions at once (continuous batching on a peer):
        one batch through the projections and MLPs, each session's attention over its own cache.
        Every step feeds the same number of new positions; each gets the hidden states it would
        get alone, and its cache moves on as alone."""
        return [routed.output for routed in self.body_sessions_routed(steps)]

    def body_sessions_routed(self, steps: Sequence[SessionStep]) -> list[Routed]:
        """`body_sessions`, and each session's experts (as `body_routed`); a step's `replay`
        replays its rows' routing, the other steps' rows route freely."""
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
                                        self.layer_masks(step.key_valid, start, length)))
            row += batch
        x = self.embed(torch.cat([step.inputs for step in steps]))
        ropes = self.layer_ropes(torch.cat([step.positions for step in steps]), x.dtype) \
            if not any(rope.depends_on_length for rope in self.ropes) \
            else self._session_ropes([step.positions for step in steps], x.dtype)
        replays = self.layer_replays(self._session_replay(steps), x.shape[:2])
        records = []
        for i, layer in enumerate(self.layers):
            x, experts = layer.forward_sessions(x, ropes[i], sessions, i, replays[i])
            if experts is not None:
                records.append(experts)
        for step in steps:
            step.cache.length += length
        routing = torch.stack(records, dim=2) if records else None
        return [Routed(x[session.rows], None if routing is None else routing[session.rows])
                for session in sessions]

    def _session_replay(self, steps: Sequence[SessionStep]) -> torch.Tensor | None:
        """The steps' replays stacked as their rows are, FREE_ROUTE for a step without one;
        None when no step has one."""
        given = [step.replay for step in steps if step.replay is not None]
        if not given:
            return None
        shape = given[0].shape[2:]
        return torch.cat([step.replay if step.replay is not None else
                          torch.full((*step.inputs.shape[:2], *shape), FREE_ROUTE,
                                     dtype=given[0].dtype, device=given[0].device)
                          for step in steps])

    def _session_ropes(self, positions: Sequence[torch.Tensor], dtype: torch.dtype
                       ) -> list[Rope]:
        """Each layer's tables for sessions batched together, each session's computed alone:
        dynamic NTK and longrope choose their frequencies from a forward's longest position, so
        one session's length must not change another's."""
        alone = [self.layer_ropes(rows, dtype) for rows in positions]
        return [None if tables[0] is None else
                (torch.cat([t[0] for t in tables]), torch.cat([t[1] for t in tables]))
                for tables in zip(*alone)]

    def _prefill_distinct(self, inputs: torch.Tensor, positions: torch.Tensor,
                          key_valid: torch.Tensor, cache: StageCache, first: torch.Tensor,
                          row_of: torch.Tensor, replay: torch.Tensor | None) -> Routed:
        """A session's first step when rows repeat (a group's episodes share their prompt): each
        distinct row runs once, and its keys/values, outputs and experts are copied to its
        repeats (rows replaying different routings are distinct)."""
        recorded = LayerList([RecordingKV() for _ in self.layers])
        x, experts = self.body_routed(inputs[first], positions[first], key_valid[first], recorded,
                                      None if replay is None else replay[first])
        for layer_cache, layer in zip(cache.layers, recorded.layers):
            layer_cache.write(0, layer.keys[row_of], layer.values[row_of])
        cache.length = inputs.shape[1]
        return Routed(x[row_of], None if experts is None else experts[row_of])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (last stage only)."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError(f"stage {self.index} is not the last stage and has no head")
        logits = self.lm_head(self.norm(hidden))
        spec = self.spec
        if spec.logits_divisor != 1.0:
            logits = logits / spec.logits_divisor
        if spec.final_logit_softcap is not None:
            logits = torch.tanh(logits / spec.final_logit_softcap) * spec.final_logit_softcap
        return logits

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                cache: StageKV | None = None, head_positions: torch.Tensor | None = None,
                replay: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states, or logits at the last stage. There, `head_positions` [B, new] selects
        where logits are needed (returned flat, [N, vocab]): the head is a large matmul and most
        positions need none. `replay`: routing to replay (see body_routed)."""
        return self.forward_routed(inputs, positions, key_valid, cache, head_positions,
                                   replay).output

    def forward_routed(self, inputs: torch.Tensor, positions: torch.Tensor,
                       key_valid: torch.Tensor, cache: StageKV | None = None,
                       head_positions: torch.Tensor | None = None,
                       replay: torch.Tensor | None = None) -> Routed:
        """`forward`, and the experts of every new position (all of them, whatever
        `head_positions` selects)."""
        x, experts = self.body_routed(inputs, positions, key_valid, cache, replay)
        if not self.is_last:
            return Routed(x, experts)
        return Routed(self.head(x[head_positions] if head_positions is not None else x), experts)

    def sparse_prefixes(self) -> dict[int, str]:
        """The checkpoint prefix ("model.layers.3") of each of the stage's sparse layers, by the
        layer's index in the stage."""
        return {i: f"model.layers.{self.layer_ids[i]}" for i, slot in enumerate(self.sparse_slot)
                if slot is not None}

    def hf_names(self) -> dict[str, str]:
        """Map from this module's parameter names to Hugging Face checkpoint names (a sparse
        layer's experts under the fused names transformers holds in memory; a checkpoint may
        hold them per expert: `checkpoint_names`)."""
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

    def checkpoint_names(self, available: Collection[str]) -> set[str]:
        """The checkpoint tensors this stage is built from, of a checkpoint holding the names
        `available`: a sparse layer's experts in whichever form the checkpoint holds them."""
        experts = self._expert_names()
        names = {hf for local, hf in self.hf_names().items() if local not in experts}
        for prefix in self.sparse_prefixes().values():
            assert self.spec.moe is not None
            names.update(layer_checkpoint_names(self.spec.moe, prefix, available))
        return names

    def _expert_names(self) -> set[str]:
        """The state dict names of the sparse layers' routers and experts."""
        return {f"layers.{i}.mlp.{name}" for i in self.sparse_prefixes()
                for name in self.layers[i].mlp.state_dict()}

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load this stage's slice of a full Hugging Face state dict (untying a tied head; a
        sparse layer's experts from either checkpoint form), copied into the stage's own tensors
        one at a time, in their dtype (`tensors` may read each from disk as it is asked)."""
        own: dict[str, torch.Tensor | str] = {}  # a tensor, or the checkpoint name to read
        experts = self._expert_names()
        for i, prefix in self.sparse_prefixes().items():
            assert self.spec.moe is not None
            for name, tensor in expert_tensors_from_checkpoint(tensors, prefix,
                                                               self.spec.moe).items():
                own[f"layers.{i}.mlp.{name}"] = tensor
        for local, hf in self.hf_names().items():
            if local in experts:
                continue
            source = hf
            if hf == HEAD and self.spec.tie_word_embeddings:
                # A tied checkpoint's head is its embedding (as transformers loads it, whatever
                # lm_head.weight the file may also hold): the head is a copy.
                source = EMBEDDING
            if source not in tensors:
                raise KeyError(f"checkpoint has no tensor {source!r} needed by stage {self.index}")
            own[local] = source
        state = self.state_dict()
        if set(own) != set(state):
            raise KeyError(f"stage {self.index}: the checkpoint gives {sorted(set(own) - set(state))}"
                           f" and lacks {sorted(set(state) - set(own))}")
        with torch.no_grad():
            for local, target in state.items():
                given = own.pop(local)
                source = tensors[given] if isinstance(given, str) else given
                if source.shape != target.shape:
                    raise ValueError(f"stage {self.index}: {local} is {tuple(source.shape)} in "
                                     f"the checkpoint, {tuple(target.shape)} in the model")
                target.copy_(source)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's tensors under their checkpoint names; a sparse layer's experts one matrix
        per expert, as save_pretrained writes them."""
        names, experts = self.hf_names(), self._expert_names()
        state = self.state_dict()
        out = {names[k]: v for k, v in state.items() if k not in experts}
        for i, prefix in self.sparse_prefixes().items():
            assert self.spec.moe is not None
            layer = {name[len(f"layers.{i}.mlp."):]: tensor for name, tensor in state.items()
                     if name.startswith(f"layers.{i}.mlp.")}
            out.update(checkpoint_tensors_of_experts(layer, prefix, self.spec.moe))
        return out


def build_stage(spec: ModelSpec, plan: StagePlan, index: int,
                tensors: Mapping[str, torch.Tensor],
                device: torch.device, dtype: torch.dtype) -> StageModule:
    """One stage from a Hugging Face state dict holding (at least) that stage's tensors."""
    if plan.num_layers != spec.num_layers:
        raise ValueError(f"stage plan covers {plan.num_layers} layers, the model has {spec.num_layers}")
    with torch.device("meta"):
        stage = StageModule(spec, plan, index).to(dtype)  # cast before any memory is taken
    stage = stage.to_empty(device=device)
    stage.load_hf_state_dict(tensors)
    return stage


def build_stages(spec: ModelSpec, plan: StagePlan, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> list[StageModule]:
    return [build_stage(spec, plan, index, tensors, device, dtype)
            for index in range(plan.num_stages)]
