"""The decoder layer every supported family shares, written plainly, so a stage can own any
contiguous slice of it and its own KV cache. What a family changes (norm placement and kind, q/k
norms, biases, activation, fused projections, sliding windows, attention scale and soft-capping,
layers without RoPE, residual scaling, a sparse mixture-of-experts MLP) is a field of its
ModelSpec (model/spec.py), decided when a layer is built. Parameter names match Hugging Face's,
so checkpoints load and export without a translation table; only a sparse layer's experts are
translated (model/stages.py, model/moe_checkpoint.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from decentrl.model.moe import MoESpec, SparseMoE
from decentrl.model.rope import apply_rotary
from decentrl.model.spec import ModelSpec, NormKind

# A KV cache grows by this many positions at a time: each growth copies what it holds, so a
# chunk well past one decoding step keeps the copies rare (one per 64 steps), and small enough
# that a session holds little more than it wrote.
KV_GROWTH = 64


def kv_capacity(length: int, max_length: int) -> int:
    """The positions a cache that must hold `length` of them has room for: `length` rounded up
    to a whole KV_GROWTH chunk, never past `max_length`."""
    return min(max_length, -(-length // KV_GROWTH) * KV_GROWTH)


class LayerCache:
    """Keys and values of one layer for a batch of sequences. It holds room for the positions
    written so far, grown in KV_GROWTH chunks as they are written (the earlier ones copied), never
    past `max_length`: a session opened for 4096 positions that wrote 100 holds 128."""

    def __init__(self, batch: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_length = max_length
        empty = (batch, num_kv_heads, 0, head_dim)
        self.keys = torch.zeros(empty, dtype=dtype, device=device)
        self.values = torch.zeros(empty, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, length: int) -> None:
        """Room for `length` positions, the ones held kept."""
        if length > self.max_length:
            raise ValueError(f"KV cache overflow: {length} positions > capacity {self.max_length}")
        if length <= self.capacity:
            return
        held, grown = self.capacity, kv_capacity(length, self.max_length)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], grown, old.shape[3]))
            new[:, :, :held] = old
            setattr(self, name, new)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + keys.shape[2]
        self.reserve(end)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]


class RMSNorm(nn.Module):
    """RMSNorm, normalised in fp32 as the reference implementations do (bf16 variance is too
    coarse), scaled as `kind` says (model/spec.py NormKind)."""

    def __init__(self, size: int, eps: float, kind: NormKind = "rms") -> None:
        super().__init__()
        # Gemma's weight is an offset from 1, so its identity is zeros.
        self.weight = nn.Parameter(torch.zeros(size) if kind == "rms_offset" else torch.ones(size))
        self.eps, self.kind = eps, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms":
            return self.weight * x.to(dtype)
        if self.kind == "rms_fp32":
            return (self.weight * x).to(dtype)
        return (x * (1.0 + self.weight.float())).to(dtype)


Rope = tuple[torch.Tensor, torch.Tensor] | None  # a layer's cos/sin tables; None: no RoPE


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        if spec.fused_projections:
            self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        else:
            self.q_proj = nn.Linear(spec.hidden_size, q_size, bias=spec.qkv_bias)
            self.k_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.qkv_bias)
            self.v_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm != "none":
            full = spec.qk_norm == "full"
            self.q_norm = RMSNorm(q_size if full else spec.head_dim, spec.rms_norm_eps,
                                  spec.norm_kind)
            self.k_norm = RMSNorm(kv_size if full else spec.head_dim, spec.rms_norm_eps,
                                  spec.norm_kind)

    def project(self, x: torch.Tensor, rope: Rope
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, heads, T, head_dim], keys and values [B, kv_heads, T, head_dim] of the new
        positions, normed and rotated as the family does. Row by row: rows batched together get
        what they would alone."""
        batch, length, _ = x.shape
        spec = self.spec
        if spec.fused_projections:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if spec.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, length, spec.num_heads, spec.head_dim)
        k = k.view(batch, length, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, length, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        if rope is None:
            return q, k, v
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
               ) -> torch.Tensor:
        """The attention output [B, T, heads x head_dim] of queries over keys/values (all the
        positions a query may see), before the output projection."""
        spec = self.spec
        batch, _, length, _ = q.shape
        groups = spec.num_heads // spec.num_kv_heads
        if spec.attention_softcap is not None:
            return self.attend_capped(q, k, v, mask).transpose(1, 2).reshape(batch, length, -1)
        if length == 1 and groups > 1:
            # One new position (decoding): the `groups` query heads that share a key/value head
            # become `groups` query rows of that head, [B, kv_heads, groups, head_dim]. The same
            # attention (a single query has a single mask row, which broadcasts), without
            # repeating keys/values; CPU bf16 SDPA runs it ~4x faster than enable_gqa with one
            # query row (Hugging Face decodes the same way).
            out = F.scaled_dot_product_attention(
                q.reshape(batch, spec.num_kv_heads, groups, spec.head_dim), k, v, attn_mask=mask,
                scale=spec.attention_scale)
            return out.reshape(batch, 1, -1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=groups > 1, scale=spec.attention_scale)
        return out.transpose(1, 2).reshape(batch, length, -1)

    def attend_capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                      ) -> torch.Tensor:
        """Attention [B, heads, T, head_dim] with soft-capped scores (Gemma 2), which SDPA cannot
        do: scores scaled, capped (cap * tanh(score / cap)), masked, softmax in fp32."""
        spec = self.spec
        cap = spec.attention_softcap
        assert cap is not None
        groups = spec.num_heads // spec.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = spec.attention_scale if spec.attention_scale is not None else spec.head_dim ** -0.5
        scores = torch.tanh(q @ k.transpose(2, 3) * scale / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor,
                cache: LayerCache | None, cache_start: int) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.write(cache_start, k, v)
        return self.o_proj(self.attend(q, k, v, mask))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fused = spec.fused_projections
        if self.fused:
            self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size,
                                          bias=spec.mlp_bias)
        else:
            self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size,
                                       bias=spec.mlp_bias)
            self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# Each placement's norms (their Hugging Face names): on attention's input, on its output, on the
# MLP's input, on its output. None: no norm there.
LAYER_NORMS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
}


@dataclass(frozen=True)
class SessionRows:
    """One session's rows in a batch of several sessions' new positions."""

    rows: slice  # its rows in the batch
    caches: Sequence[LayerCache]  # its KV cache, one per layer of the stage
    start: int  # positions its cache held before these
    masks: Sequence[torch.Tensor]  # one per layer of the stage, [rows, 1, T, start + T]


class LayerOutput(NamedTuple):
    """A decoder layer's output, and on a sparse layer the experts each position went to."""

    hidden: torch.Tensor  # [B, T, H]
    experts: torch.Tensor | None  # [B, T, top_k] (model/moe.py's dtype); None on a dense layer


class DecoderLayer(nn.Module):
    """One decoder layer: attention and MLP, each a residual branch with the family's norms. With
    `moe` (a sparse layer of a mixture of experts) the MLP is a SparseMoE: its forward takes a
    recorded routing to replay (`replay`, [B, T, top_k]) and returns the experts it used."""

    def __init__(self, spec: ModelSpec, moe: MoESpec | None = None) -> None:
        super().__init__()
        self.norm_names = LAYER_NORMS[spec.norm_placement]
        for name in self.norm_names:
            if name is not None:
                self.add_module(name, RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_kind))
        self.self_attn = Attention(spec)
        self.mlp: MLP | SparseMoE = SparseMoE(moe) if moe is not None else MLP(spec)
        self.residual_multiplier = spec.residual_multiplier

    def norm(self, where: int, x: torch.Tensor) -> torch.Tensor:
        """`x` through the norm at place `where` of LAYER_NORMS, if the family has one there."""
        name = self.norm_names[where]
        return x if name is None else self._modules[name](x)

    def add(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        if self.residual_multiplier == 1.0:
            return x + branch
        return x + branch * self.residual_multiplier

    def add_mlp(self, x: torch.Tensor, replay: torch.Tensor | None) -> LayerOutput:
        if not isinstance(self.mlp, SparseMoE):
            return LayerOutput(self.add(x, self.norm(3, self.mlp(self.norm(2, x)))), None)
        routed = self.mlp(self.norm(2, x), replay)
        return LayerOutput(self.add(x, self.norm(3, routed.hidden)), routed.experts)

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor,
                cache: LayerCache | None = None, cache_start: int = 0,
                replay: torch.Tensor | None = None) -> LayerOutput:
        attended = self.self_attn(self.norm(0, x), rope, mask, cache, cache_start)
        return self.add_mlp(self.add(x, self.norm(1, attended)), replay)

    def forward_sessions(self, x: torch.Tensor, rope: Rope, sessions: Sequence[SessionRows],
                         layer: int, replay: torch.Tensor | None = None) -> LayerOutput:
        """The layer over the rows of several sessions stacked in `x` [R, T, H]: projections and
        the MLP run as one batch; each session attends over its own cache with its own mask,
        since sessions hold different numbers of positions."""
        q, k, v = self.self_attn.project(self.norm(0, x), rope)
        attended = []
        for session in sessions:
            rows = session.rows
            keys, values = session.caches[layer].write(session.start, k[rows], v[rows])
            attended.append(self.self_attn.attend(q[rows], keys, values, session.masks[layer]))
        x = self.add(x, self.norm(1, self.self_attn.o_proj(torch.cat(attended))))
        return self.add_mlp(x, replay)

def attention_mask(key_valid: torch.Tensor, query_start: int, query_length: int,
                   window: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, Tq, Tk]: causal, hides padded keys, and always lets a query see itself
    (a left-padding query with no visible key would otherwise turn the softmax into NaN). With a
    sliding `window`, a query sees only the keys of its last `window` columns, itself included
    (as Hugging Face counts them: columns, padding included; a row's real tokens are contiguous,
    so that is its last `window` positions)."""
    key_length = key_valid.shape[1]
    query_pos = torch.arange(query_start, query_start + query_length, device=key_valid.device)
    key_pos = torch.arange(key_length, device=key_valid.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        causal &= key_pos[None, :] > query_pos[:, None] - window
    itself = key_pos[None, :] == query_pos[:, None]
    return ((causal[None] & key_valid[:, None, :]) | itself[None])[:, None]


def positions_from_valid(valid: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: the first real token of every row is position 0."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)
