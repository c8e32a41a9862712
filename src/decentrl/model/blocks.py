"""The Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) written plainly, so a stage can own any
contiguous slice of it and its own KV cache. Parameter names match Hugging Face's, so checkpoints
load and export without a translation table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    max_positions: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only plain RoPE)")
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config["rms_norm_eps"]),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            max_positions=config.get("max_position_embeddings", 4096),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementation does; bf16 variance is too coarse.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, 1, T, head_dim] for the half-rotation RoPE convention of HF Llama."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, q_size, bias=spec.attention_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.attention_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, heads, T, head_dim], keys and values [B, kv_heads, T, head_dim] of the new
        positions, rotated. Row by row: rows batched together get what they would alone."""
        batch, length, _ = x.shape
        spec = self.spec
        q = self.q_proj(x).view(batch, length, spec.num_heads, spec.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
               ) -> torch.Tensor:
        """The attention output [B, T, heads x head_dim] of queries over keys/values (all the
        positions a query may see), before the output projection."""
        spec = self.spec
        batch, _, length, _ = q.shape
        groups = spec.num_heads // spec.num_kv_heads
        if length == 1 and groups > 1:
            # One new position (decoding): the `groups` query heads that share a key/value head
            # become `groups` query rows of that head, [B, kv_heads, groups, head_dim]. The same
            # attention (a single query has a single mask row, which broadcasts), without
            # repeating keys/values; CPU bf16 SDPA runs it ~4x faster than enable_gqa with one
            # query row (Hugging Face decodes the same way).
            out = F.scaled_dot_product_attention(
                q.reshape(batch, spec.num_kv_heads, groups, spec.head_dim), k, v, attn_mask=mask
            )
            return out.reshape(batch, 1, -1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=spec.num_kv_heads != spec.num_heads
        )
        return out.transpose(1, 2).reshape(batch, length, -1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                cache: LayerCache | None, cache_start: int) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.write(cache_start, k, v)
        return self.o_proj(self.attend(q, k, v, mask))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class SessionRows:
    """One session's rows in a batch of several sessions' new positions."""

    rows: slice  # its rows in the batch
    caches: Sequence[LayerCache]  # its KV cache, one per layer of the stage
    start: int  # positions its cache held before these
    mask: torch.Tensor  # [rows, 1, T, start + T]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                cache: LayerCache | None = None, cache_start: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, cache_start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_sessions(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                         sessions: Sequence[SessionRows], layer: int) -> torch.Tensor:
        """The layer over the rows of several sessions stacked in `x` [R, T, H]: projections and
        the MLP run as one batch; each session attends over its own cache with its own mask,
        since sessions hold different numbers of positions."""
        q, k, v = self.self_attn.project(self.input_layernorm(x), rope)
        attended = []
        for session in sessions:
            rows = session.rows
            keys, values = session.caches[layer].write(session.start, k[rows], v[rows])
            attended.append(self.self_attn.attend(q[rows], keys, values, session.mask))
        x = x + self.self_attn.o_proj(torch.cat(attended))
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask(key_valid: torch.Tensor, query_start: int, query_length: int) -> torch.Tensor:
    """Boolean mask [B, 1, Tq, Tk]: causal, hides padded keys, and always lets a query see itself
    (a left-padding query with no visible key would otherwise turn the softmax into NaN)."""
    key_length = key_valid.shape[1]
    query_pos = torch.arange(query_start, query_start + query_length, device=key_valid.device)
    key_pos = torch.arange(key_length, device=key_valid.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    itself = key_pos[None, :] == query_pos[:, None]
    return ((causal[None] & key_valid[:, None, :]) | itself[None])[:, None]


def positions_from_valid(valid: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: the first real token of every row is position 0."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)
