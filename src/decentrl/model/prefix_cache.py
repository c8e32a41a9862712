"""Shared prompt prefixes computed once across sessions (a stage peer's prefix cache). The groups
of one task share long prompt prefixes (an agentic environment's system prompt, tool schema and
worked example), so a session's first step finds the longest prefix of each row that an earlier
session already ran at these weights, copies its keys, values and output hidden states, and
computes only the rest with them as context.

Blocks, as vLLM's: a row's columns from its first real one (left padding excluded), in blocks
of BLOCK_SIZE columns, each keyed by a chained hash of its parent's key and the block's exact
input bits (token ids at stage 0, hidden states after), positions and key_valid bits, so a key
names the exact prefix. A block holds every layer's keys/values of its columns and the stage's
outputs there.

Why from the first real column: a session that carries groups of prompts of different lengths
left-pads them differently, and a row's real columns never see its padding (attention_mask), so
one prompt's blocks serve it under any padding. The padding columns before a reused prefix are
computed apart (each sees only itself). Not bit for bit, though: SDPA's reductions run over the
key axis in vector lanes and blocks whose alignment moves with the padding and with the number
of keys in the call, so a prefix computed in another call differs from the plain prefill in the
last bits of some values (the plain prefill itself differs with the prompt's total length). The
reused columns are the exact bits an earlier session computed;
tests/unit/model/test_prefix_cache.py shows greedy decoding token for token equal to the plain
prefill's and the values close.

Only one weight state's blocks are kept: the cache empties when the model's version changes, or
when any of its parameters is written in place (a rollback's state reuses a version number, a
spot-check rewinds the weights in place and back). Bounded by `capacity_tokens` positions; the
least recently used block goes first, and never a block before one that extends it: a lookup
touches its chain from the leaf to the root, so a parent is always more recent than its
children and the oldest block is a leaf (an evicted parent would leave its children unreachable
while they still took room)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from decentrl.model.stages import LayerList, RecordingKV, StageCache, StageModule, distinct_rows

# Columns per block: long enough that a key's hash and a block's bookkeeping are cheap beside its
# tensors, short enough that little of a shared prefix is left in a partial block.
BLOCK_SIZE = 32


@dataclass
class PrefixBlock:
    """One block of a prefix at one weight state."""

    keys: torch.Tensor  # [layers, kv_heads, BLOCK_SIZE, head_dim]
    values: torch.Tensor  # [layers, kv_heads, BLOCK_SIZE, head_dim]
    hidden: torch.Tensor  # [BLOCK_SIZE, hidden]: the stage's outputs


@dataclass
class RowPrefix:
    """One distinct row of a session's first step: where its real columns start, the keys of its
    full blocks, and how many of those the cache holds (its leading ones)."""

    start: int  # its leading padding columns
    keys: list[bytes]
    cached: int  # blocks

    def reused_end(self, block_size: int) -> int:
        """The column up to which the cache can fill this row."""
        return self.start + self.cached * block_size


@dataclass
class ContextColumns:
    """A row's columns before the ones a prefill computes, in pieces (its padding, then its
    cached prefix): keys and values [layers, kv_heads, columns, head_dim], outputs [columns,
    hidden]."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def add(self, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> None:
        self.keys.append(keys)
        self.values.append(values)
        self.hidden.append(hidden)


class PrefixCache:
    """The prefix cache of one stage's model (one inference service's; verification and training
    never use it: they run other weights or need gradients)."""

    def __init__(self, model: StageModule, capacity_tokens: int,
                 block_size: int = BLOCK_SIZE) -> None:
        """`capacity_tokens`: positions held at most, in whole blocks (fewer than one block:
        off)."""
        if capacity_tokens < 0 or block_size < 1:
            raise ValueError(f"a prefix cache needs capacity_tokens >= 0 and block_size >= 1, got "
                             f"{capacity_tokens} and {block_size}")
        self.model, self.block_size = model, block_size
        self.max_blocks = capacity_tokens // block_size
        self.blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()  # least recently used first
        self._weights: tuple[int, int] | None = None
        self.reused_tokens = 0  # row x columns copied from the cache
        self.computed_tokens = 0  # row x columns the model ran in first steps (distinct rows)

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def held_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def prefill(self, inputs: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                cache: StageCache) -> torch.Tensor:
        """A session's first step, as `StageModule.body` computes it (the outputs of every column,
        `cache` filled), with the longest cached prefix of each row reused."""
        if cache.length != 0:
            raise ValueError(f"a prefill starts a session: its cache holds {cache.length} "
                             "positions, expected none")
        if key_valid.shape != positions.shape or inputs.shape[:2] != positions.shape:
            raise ValueError(f"inputs {tuple(inputs.shape)}, positions {tuple(positions.shape)} "
                             f"and key_valid {tuple(key_valid.shape)} must cover the same [B, T]")
        first, row_of = distinct_rows(inputs, positions, key_valid)
        width = inputs.shape[1]
        if not self.enabled:
            self.computed_tokens += first.shape[0] * width
            return self.model.body(inputs, positions, key_valid, cache)
        self._follow_weights()
        rows = self._look_up(inputs[first], positions[first], key_valid[first])
        reused = min(row.reused_end(self.block_size) for row in rows)
        if all(row.start >= reused for row in rows):  # nothing to reuse: the plain prefill
            self.computed_tokens += first.shape[0] * width
            hidden = self.model.body(inputs, positions, key_valid, cache)
            layers = [(layer.keys[first, :, :width], layer.values[first, :, :width])
                      for layer in cache.layers]
            self._store(rows, layers, hidden[first])
            return hidden
        distinct, hidden = self._prefill_after(rows, reused, inputs[first], positions[first],
                                               key_valid[first])
        for layer_cache, layer in zip(cache.layers, distinct.layers):
            layer_cache.write(0, layer.keys[row_of, :, :width], layer.values[row_of, :, :width])
        cache.length = width
        return hidden[row_of]

    # ---- lookup and reuse --------------------------------------------------------------------

    def _follow_weights(self) -> None:
        """Empty the cache if the weights changed since it was filled. In-place writes bump each
        parameter's version counter, so their sum changes with any write, whatever the version
        number says."""
        weights = (self.model.version, sum(p._version for p in self.model.parameters()))
        if weights != self._weights:
            self.blocks.clear()
            self._weights = weights

    def _look_up(self, inputs: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor
                 ) -> list[RowPrefix]:
        """Each row's block keys and its longest cached prefix (whose blocks become the most
        recently used, leaf first)."""
        inputs, positions, key_valid = inputs.cpu(), positions.cpu(), key_valid.cpu()
        rows = []
        for row in range(inputs.shape[0]):
            valid = key_valid[row].nonzero()
            start = int(valid[0]) if valid.numel() else key_valid.shape[1]
            keys: list[bytes] = []
            parent = b""
            for begin in range(start, key_valid.shape[1] - self.block_size + 1, self.block_size):
                block = slice(begin, begin + self.block_size)
                parent = block_key(parent, inputs[row, block], positions[row, block],
                                   key_valid[row, block])
                keys.append(parent)
            cached = 0
            while cached < len(keys) and keys[cached] in self.blocks:
                cached += 1
            self._touch(keys[:cached])
            rows.append(RowPrefix(start, keys, cached))
        return rows

    def _touch(self, chain: list[bytes]) -> None:
        """Make a chain of blocks the most recently used, its parents after their children."""
        for key in reversed(chain):
            self.blocks.move_to_end(key)

    def _prefill_after(self, rows: list[RowPrefix], reused: int, inputs: torch.Tensor,
                       positions: torch.Tensor, key_valid: torch.Tensor
                       ) -> tuple[StageCache, torch.Tensor]:
        """The distinct rows' first step with their columns [0, reused) filled from the cache
        (their padding columns there computed apart): the rows' cache and outputs."""
        model, width = self.model, inputs.shape[1]
        padding = [min(row.start, reused) for row in rows]
        context = self._padding_columns(padding, inputs, positions)
        for parts, row, pads in zip(context, rows, padding):
            take = reused - pads  # the row's real columns before `reused`, all cached
            if take == 0:
                continue
            blocks = [self.blocks[key] for key in row.keys[:-(-take // self.block_size)]]
            parts.add(torch.cat([b.keys for b in blocks], 2)[:, :, :take],
                      torch.cat([b.values for b in blocks], 2)[:, :, :take],
                      torch.cat([b.hidden for b in blocks])[:take])
            self.reused_tokens += take
        distinct = model.new_cache(inputs.shape[0], width)
        keys = torch.stack([torch.cat(parts.keys, 2) for parts in context], 1)
        values = torch.stack([torch.cat(parts.values, 2) for parts in context], 1)
        for layer_cache, layer_keys, layer_values in zip(distinct.layers, keys, values):
            layer_cache.write(0, layer_keys, layer_values)
        distinct.length = reused
        hidden = torch.stack([torch.cat(parts.hidden) for parts in context])
        if reused < width:
            rest = model.body(inputs[:, reused:], positions[:, reused:], key_valid, distinct)
            hidden = torch.cat([hidden, rest], 1)
            self.computed_tokens += inputs.shape[0] * (width - reused)
        self._store(rows, [(layer.keys[:, :, :width], layer.values[:, :, :width])
                           for layer in distinct.layers], hidden)
        return distinct, hidden

    def _padding_columns(self, padding: list[int], inputs: torch.Tensor,
                         positions: torch.Tensor) -> list[ContextColumns]:
        """Each row's leading padding columns [0, padding[row]) computed apart: a padding column
        sees only itself, so its outputs depend on its own input and position alone, and the
        distinct ones run once, as one row whose keys are all padding."""
        context = [ContextColumns() for _ in padding]
        if not any(padding):
            return context
        device = inputs.device
        rows = torch.cat([torch.full((count,), row, dtype=torch.long)
                          for row, count in enumerate(padding)]).to(device)
        columns = torch.cat([torch.arange(count) for count in padding]).to(device)
        column_inputs, column_positions = inputs[rows, columns], positions[rows, columns]
        first, column_of = distinct_rows(column_inputs, column_positions)
        recorded = LayerList([RecordingKV() for _ in self.model.layers])
        hidden = self.model.body(column_inputs[first][None], column_positions[first][None],
                                 torch.zeros(1, first.shape[0], dtype=torch.bool, device=device),
                                 recorded)
        self.computed_tokens += first.shape[0]
        keys = torch.stack([layer.keys[0] for layer in recorded.layers])[:, :, column_of]
        values = torch.stack([layer.values[0] for layer in recorded.layers])[:, :, column_of]
        hidden = hidden[0, column_of]
        end = 0
        for parts, count in zip(context, padding):
            if count:
                span = slice(end, end + count)
                parts.add(keys[:, :, span], values[:, :, span], hidden[span])
                end += count
        return context

    # ---- storing -----------------------------------------------------------------------------

    def _store(self, rows: list[RowPrefix], layers: list[tuple[torch.Tensor, torch.Tensor]],
               hidden: torch.Tensor) -> None:
        """Keep the new full blocks of the distinct rows: `layers` holds each layer's keys and
        values [rows, kv_heads, T, head_dim], `hidden` the outputs [rows, T, hidden]."""
        for index, row in enumerate(rows):
            for block in range(row.cached, len(row.keys)):
                if row.keys[block] in self.blocks:  # another row of this step stored it
                    continue
                if not self._make_room(row.keys[:block]):
                    break
                columns = slice(row.start + block * self.block_size,
                                row.start + (block + 1) * self.block_size)
                self.blocks[row.keys[block]] = PrefixBlock(
                    keys=torch.stack([keys[index, :, columns] for keys, _ in layers]),
                    values=torch.stack([values[index, :, columns] for _, values in layers]),
                    hidden=hidden[index, columns].clone())
            self._touch([key for key in row.keys if key in self.blocks])

    def _make_room(self, ancestors: list[bytes]) -> bool:
        """Evict least recently used blocks until one more fits; False if that would evict one of
        `ancestors` (the chain the new block extends)."""
        while len(self.blocks) >= self.max_blocks:
            oldest = next(iter(self.blocks))
            if oldest in ancestors:
                return False
            del self.blocks[oldest]
        return True


def block_key(parent: bytes, inputs: torch.Tensor, positions: torch.Tensor,
              key_valid: torch.Tensor) -> bytes:
    """The key of a block: its parent's key and the exact bits of its columns."""
    digest = hashlib.blake2b(parent, digest_size=16)
    for tensor in (inputs, positions, key_valid):
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()
