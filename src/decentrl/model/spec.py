"""What a decoder is made of: its sizes and every feature the supported families differ by, each a
field whose default is what Llama does. A family module (model/families/) reads a Hugging Face
config into one; the decoder (model/blocks.py, model/stages.py) builds itself from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from decentrl.errors import DecentrlError
from decentrl.model.moe import MoESpec
from decentrl.model.rope import RopeSpec

# Where a layer's norms sit. "pre" (Llama): on the input of attention and of the MLP. "post"
# (OLMo 2): on each sublayer's output, before the residual add. "sandwich" (Gemma 2/3): both.
NormPlacement = Literal["pre", "post", "sandwich"]
# How an RMSNorm scales. "rms" (Llama): normalise in fp32, cast back, times the weight. "rms_fp32"
# (OLMo 2): times the weight in fp32, then cast back. "rms_offset" (Gemma): times (1 + weight) in
# fp32, then cast back.
NormKind = Literal["rms", "rms_fp32", "rms_offset"]
# Norms on queries and keys. "head" (Qwen3, Gemma 3): RMSNorm over head_dim, one weight shared by
# the heads. "full" (OLMo 2): RMSNorm over the whole q (and k) projection's width.
QKNorm = Literal["none", "head", "full"]
Activation = Literal["silu", "gelu_pytorch_tanh"]
LayerType = Literal["full_attention", "sliding_attention"]
FULL_ATTENTION: LayerType = "full_attention"
SLIDING_ATTENTION: LayerType = "sliding_attention"


class UnsupportedModel(DecentrlError, ValueError):
    """A model decentrl cannot run as its config describes it: an unknown family, or a feature
    of a known one that is not implemented. The message names it."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    # The RoPE of each layer type in `layer_types` (model/rope.py rope_specs). Not hashed: a
    # mapping is not hashable, and the other fields already tell specs apart.
    rope: Mapping[str, RopeSpec] = field(hash=False)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: Activation = "silu"
    norm_placement: NormPlacement = "pre"
    norm_kind: NormKind = "rms"
    qk_norm: QKNorm = "none"
    # Each layer's attention, by layer index; empty: every layer attends to every earlier key.
    layer_types: tuple[LayerType, ...] = ()
    # Keys a sliding_attention query sees: itself and the sliding_window - 1 columns before it.
    sliding_window: int | None = None
    # The attention scores' scale; None: 1 / sqrt(head_dim).
    attention_scale: float | None = None
    # Soft-capping: cap * tanh(x / cap) on the attention scores and on the final logits.
    attention_softcap: float | None = None
    final_logit_softcap: float | None = None
    embedding_multiplier: float = 1.0
    # Gemma: the multiplier is rounded to the compute dtype before it scales the embeddings, as
    # transformers keeps it (sqrt(3072) = 55.43 is 55.5 in bf16).
    embedding_multiplier_rounded: bool = False
    # Each sublayer's output is scaled by this before it is added to the residual stream.
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    # Layers that apply no RoPE at all (their attention sees no positions but the causal order).
    no_rope_layers: frozenset[int] = frozenset()
    # Phi-3: q, k and v are one projection (`self_attn.qkv_proj`, rows in that order), and so are
    # the MLP's gate and up (`mlp.gate_up_proj`, gate rows first).
    fused_projections: bool = False
    # Whether the checkpoint's head is its embedding. The stages untie it (model/stages.py).
    tie_word_embeddings: bool = False
    # Mixture of experts (model/moe.py): the sparse MLP of the layers in `sparse_layers`; the
    # other layers keep the dense MLP of `intermediate_size`. None and empty: a dense model.
    moe: MoESpec | None = None
    sparse_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        def refuse(problem: str) -> UnsupportedModel:
            return UnsupportedModel(f"{self.model_type}: {problem}")

        for name, kind in (("hidden_act", Activation), ("norm_placement", NormPlacement),
                           ("norm_kind", NormKind), ("qk_norm", QKNorm)):
            if getattr(self, name) not in get_args(kind):
                raise refuse(f"{name} {getattr(self, name)!r} is not supported (supported: "
                             f"{get_args(kind)})")
        if self.num_heads % self.num_kv_heads:
            raise refuse(f"{self.num_heads} attention heads do not share {self.num_kv_heads} "
                         "key/value heads evenly")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise refuse(f"layer_types names {len(self.layer_types)} layers, the model has "
                         f"{self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(get_args(LayerType)))
        if unknown:
            raise refuse(f"layer types {unknown} are not supported (supported: "
                         f"{get_args(LayerType)})")
        if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window or 0) >= 1:
            raise refuse(f"sliding_attention layers need a sliding_window >= 1, got "
                         f"{self.sliding_window}")
        missing = sorted({self.layer_type(i) for i in range(self.num_layers)} - set(self.rope))
        if missing:
            raise refuse(f"no RoPE given for layer types {missing}")
        if any(not 0 <= layer < self.num_layers for layer in self.no_rope_layers):
            raise refuse(f"no_rope_layers {sorted(self.no_rope_layers)} name layers outside "
                         f"0..{self.num_layers - 1}")
        if (self.moe is None) != (not self.sparse_layers):
            raise refuse("a mixture of experts needs both its MoESpec and its sparse layers")
        if any(not 0 <= layer < self.num_layers for layer in self.sparse_layers):
            raise refuse(f"sparse_layers {sorted(self.sparse_layers)} name layers outside "
                         f"0..{self.num_layers - 1}")
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise refuse(f"the experts' hidden size {self.moe.hidden_size} is not the model's "
                         f"{self.hidden_size}")

    def layer_type(self, layer: int) -> LayerType:
        """The attention of layer `layer` (an index into the whole model)."""
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None: it sees every earlier key."""
        return self.sliding_window if self.layer_type(layer) == SLIDING_ATTENTION else None

    def moe_of(self, layer: int) -> MoESpec | None:
        """The sparse MLP of layer `layer`; None for a layer with a dense MLP."""
        return self.moe if layer in self.sparse_layers else None

    def sparse_before(self, layer: int) -> int:
        """How many sparse layers come before layer `layer`: where its stage's slice of a
        whole-model routing record starts."""
        return sum(1 for sparse in self.sparse_layers if sparse < layer)

    def rope_of(self, layer: int) -> RopeSpec | None:
        """The RoPE layer `layer` applies; None for a layer without positional encoding."""
        return None if layer in self.no_rope_layers else self.rope[self.layer_type(layer)]
