"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral, with its routing recorded and
replayed (rollout routing replay).

One `SparseMoE` replaces a decoder layer's MLP: a router (`gate`) scores every expert, each token
goes to its `top_k` experts, and their SwiGLU outputs are summed with the routing weights. The
math is transformers 5.23's `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`: softmax of the
router logits in fp32, top-k, the top-k weights renormalised to sum to 1 (Mixtral always,
Qwen3-MoE only with `norm_topk_prob`).

Routing replay: the forward returns the experts it chose for every token, in a compact integer
dtype, so a generation peer can ship them with its rollout. Given such recorded indices back
(`replay`), the forward uses those experts instead of the router's top-k, weighted by the
current router's probabilities of them (renormalised as the family does), so the learner's
tokens go through the experts that produced them while the router still gets gradients; a row
of FREE_ROUTE (-1) leaves a token without a record (padding) to the router. The
record is a return value and the replay an argument: the module keeps no routing state between
calls. Replayed indices come from untrusted peers and are checked (`RoutingReplayError`).

Checkpoints (model/moe_checkpoint.py) name the tensors per expert; the module holds them fused
as transformers 5.23 does in memory: `gate.weight` [E, H], `experts.gate_up_proj` [E, 2I, H]
(gate rows, then up rows), `experts.down_proj` [E, H, I]."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from decentrl.errors import DecentrlError, SenderFault

MOE_FAMILIES = ("qwen3_moe", "mixtral")
# Mixture-of-experts families transformers has that we do not, with what stops them.
REFUSED_MOE_FAMILIES = {
    "qwen2_moe": "shared experts (a dense expert with a sigmoid gate beside the routed ones)",
    "olmoe": "a different router and q/k norms over the whole projection",
    "deepseek_v2": "shared experts and group-limited routing",
    "deepseek_v3": "shared experts, sigmoid scores with a correction bias and grouped routing",
    "granitemoe": "fused input/output expert projections with a different router",
    "jamba": "Mamba layers",
}
# Config fields that add shared experts; a checkpoint with them holds weights SparseMoE lacks.
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                        "n_shared_experts", "num_shared_experts")
# transformers' ACT2FN names of the activations an expert may use, as functions of ours.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
# The dtypes a replayed routing may come in.
INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# A replayed row of this in every slot: the token has no record, its router chooses.
FREE_ROUTE = -1
# The widest expert index each recording dtype holds.
INT8_MAX_EXPERTS = 128
INT16_MAX_EXPERTS = 32768


class UnsupportedMoEConfig(DecentrlError, ValueError):
    """A Hugging Face config asks for a mixture-of-experts feature SparseMoE does not have."""


class RoutingReplayError(SenderFault):
    """Recorded routing handed back for replay is malformed: wrong shape or dtype, an expert
    out of range, or one expert twice for a token. It comes from a peer, hence a SenderFault."""


@dataclass(frozen=True)
class MoESpec:
    """The sizes and routing rules of one family's sparse MoE MLP.

    `family` decides what else differs: the checkpoint names (moe_checkpoint.py) and the dtype
    the routing weights scale the expert outputs in (fp32 for Mixtral; Qwen3-MoE rounds them to
    the hidden states' dtype first), which matters only below fp32."""

    family: str
    hidden_size: int
    expert_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    activation: str

    def __post_init__(self) -> None:
        if self.family not in MOE_FAMILIES:
            raise UnsupportedMoEConfig(f"MoE family {self.family!r} is not supported; "
                                       f"supported: {MOE_FAMILIES}")
        for name in ("hidden_size", "expert_intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise UnsupportedMoEConfig(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise UnsupportedMoEConfig(f"num_experts_per_tok {self.top_k} exceeds num_experts "
                                       f"{self.num_experts}")
        if self.num_experts > INT16_MAX_EXPERTS:
            raise UnsupportedMoEConfig(f"{self.num_experts} experts: at most {INT16_MAX_EXPERTS} "
                                       "(recorded routing is shipped as int16)")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedMoEConfig(f"expert activation {self.activation!r} is not supported; "
                                       f"supported: {sorted(ACTIVATIONS)}")

    @property
    def routing_dtype(self) -> torch.dtype:
        """The integer dtype recorded expert indices are kept and shipped in: the narrowest that
        holds every index."""
        return torch.int8 if self.num_experts <= INT8_MAX_EXPERTS else torch.int16

    @property
    def renormalises(self) -> bool:
        """Whether a token's top-k routing weights are divided by their sum."""
        return self.family == "mixtral" or self.norm_topk_prob


def _number(config: Mapping[str, Any], *names: str) -> Any:
    """The first of `names` the config has (transformers maps `num_experts` to
    `num_local_experts` and back, so a config.json may hold either)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    raise UnsupportedMoEConfig(f"the config has none of {names}")


def moe_spec_from_hf_config(config: Mapping[str, Any]) -> MoESpec:
    """The MoE MLP of a Hugging Face config dict (config.json), refusing what SparseMoE cannot
    reproduce: other MoE families, shared experts, router jitter, unknown activations.
    Which layers are sparse is `sparse_layer_ids`."""
    family = config.get("model_type")
    if family in REFUSED_MOE_FAMILIES:
        raise UnsupportedMoEConfig(
            f"model_type {family!r} is not supported: {REFUSED_MOE_FAMILIES[family]}; the "
            f"nearest supported MoE families are {MOE_FAMILIES}")
    if family not in MOE_FAMILIES:
        raise UnsupportedMoEConfig(f"model_type {family!r} is not a mixture-of-experts family "
                                   f"we support; supported: {MOE_FAMILIES}")
    shared = [name for name in SHARED_EXPERT_FIELDS if config.get(name)]
    if shared:
        raise UnsupportedMoEConfig(f"shared experts ({', '.join(shared)}) are not supported: "
                                   f"{family} routes every token to routed experts only")
    jitter = config.get("router_jitter_noise") or 0.0
    if jitter:
        # Training-time multiplicative noise on the router's input: the learner's routing would
        # be random, so neither a replay nor a verifier's re-execution could reproduce it.
        raise UnsupportedMoEConfig(f"router_jitter_noise={jitter} is not supported (only 0): "
                                   "noisy routing cannot be reproduced or verified")
    if family == "qwen3_moe":
        intermediate = config["moe_intermediate_size"]
        norm_topk_prob = bool(config.get("norm_topk_prob", False))
    else:
        intermediate = config["intermediate_size"]
        norm_topk_prob = True
    num_experts = _number(config, "num_experts", "num_local_experts")
    if num_experts == 0:
        raise UnsupportedMoEConfig(f"{family} with num_experts=0 has no sparse layer; load it "
                                   "as the dense family it then is")
    return MoESpec(
        family=family,
        hidden_size=config["hidden_size"],
        expert_intermediate_size=intermediate,
        num_experts=num_experts,
        top_k=config["num_experts_per_tok"],
        norm_topk_prob=norm_topk_prob,
        activation=config.get("hidden_act", "silu"),
    )


def sparse_layer_ids(config: Mapping[str, Any]) -> frozenset[int]:
    """The decoder layers whose MLP is a SparseMoE; the others keep a dense MLP of
    `intermediate_size`. A dense family: none. Mixtral: every layer. Qwen3-MoE honours
    `mlp_only_layers` and `decoder_sparse_step` as transformers does: layer i is sparse unless
    listed, when (i + 1) is a multiple of the step."""
    num_layers = config["num_hidden_layers"]
    family = config.get("model_type")
    if family not in MOE_FAMILIES:
        if family in REFUSED_MOE_FAMILIES:
            moe_spec_from_hf_config(config)  # raises, naming what stops the family
        return frozenset()  # a dense family
    if family == "mixtral":
        return frozenset(range(num_layers))
    if not _number(config, "num_experts", "num_local_experts"):
        return frozenset()
    step = config.get("decoder_sparse_step") or 1
    if step < 1:
        raise UnsupportedMoEConfig(f"decoder_sparse_step must be at least 1, got {step}")
    dense = set(config.get("mlp_only_layers") or ())
    return frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


class MoEOutput(NamedTuple):
    """What a SparseMoE forward returns: its output and the experts each token went to."""

    hidden: torch.Tensor  # the input's shape and dtype
    experts: torch.Tensor  # [*input.shape[:-1], top_k] in MoESpec.routing_dtype, input's device


def checked_replay(replay: Any, leading_shape: torch.Size, spec: MoESpec,
                   device: torch.device) -> torch.Tensor:
    """Recorded expert indices for tokens of `leading_shape`, as int64 [tokens, top_k] on
    `device`, or a RoutingReplayError naming what is wrong: not an integer tensor, not
    [*leading_shape, top_k], an index outside [0, num_experts), an expert twice for one token,
    or a row that mixes FREE_ROUTE with experts. A row of FREE_ROUTE is allowed."""
    if not isinstance(replay, torch.Tensor):
        raise RoutingReplayError(f"routing replay must be a tensor, got {type(replay).__name__}")
    if replay.dtype not in INDEX_DTYPES:
        raise RoutingReplayError(f"routing replay must hold integer expert indices, got "
                                 f"{replay.dtype}")
    expected = (*leading_shape, spec.top_k)
    if tuple(replay.shape) != expected:
        raise RoutingReplayError(f"routing replay has shape {tuple(replay.shape)}; these tokens "
                                 f"need {expected} (top_k={spec.top_k} experts per token)")
    rows = replay.to(device=device, dtype=torch.long).reshape(-1, spec.top_k)
    free = rows == FREE_ROUTE
    partly_free = free.any(-1) & ~free.all(-1)
    if bool(partly_free.any()):
        token = int(partly_free.nonzero()[0, 0])
        raise RoutingReplayError(f"routing replay row {token} mixes {FREE_ROUTE} (route freely) "
                                 f"with experts: {rows[token].tolist()}")
    outside = ((rows < 0) | (rows >= spec.num_experts)) & ~free
    if bool(outside.any()):
        token, slot = (int(i) for i in outside.nonzero()[0])
        raise RoutingReplayError(f"routing replay names expert {int(rows[token, slot])} for "
                                 f"token {token}; experts are 0..{spec.num_experts - 1}")
    ordered = rows.sort(dim=-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & ~free[:, 1:]
    if bool(repeated.any()):
        token, slot = (int(i) for i in repeated.nonzero()[0])
        raise RoutingReplayError(f"routing replay names expert {int(ordered[token, slot])} "
                                 f"twice for token {token}; a token's experts are distinct")
    return rows


def routing_gaps(router_logits: torch.Tensor, claimed: torch.Tensor) -> torch.Tensor:
    """How far a claimed choice of experts falls short of the router's top-k, per token: the
    router's k-th best logit minus the lowest logit among the `claimed` experts, at least 0 (0
    when the claim is the top-k). A logit gap is a log-probability gap of the router's softmax,
    so the unit is nats. `router_logits` [N, E], `claimed` [N, k] (checked, int64); a row of
    FREE_ROUTE claims nothing and scores 0. A near tie at the k-th expert scores near 0 whichever
    side a peer's rounding put it on (trust/verify.py tolerates that)."""
    logits = router_logits.float()
    kth = torch.topk(logits, claimed.shape[-1], dim=-1).values[:, -1]
    weakest = logits.gather(-1, claimed.clamp(min=0)).min(dim=-1).values
    gaps = (kth - weakest).clamp(min=0)
    return gaps.masked_fill((claimed == FREE_ROUTE).all(dim=-1), 0.0)


class Experts(nn.Module):
    """Every expert's SwiGLU MLP, stacked: expert e computes
    down_e(act(gate_e x) * up_e x) with gate_e, up_e the two halves of gate_up_proj[e]."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        experts, hidden, inner = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """sum_j weights[n, j] * expert_{chosen[n, j]}(tokens[n]) for tokens [N, H], chosen [N, k]
        (int64) and weights [N, k]. The (token, slot) pairs are grouped by expert, so each expert
        runs once on all its tokens; the loop is over the experts hit, never over tokens. Experts
        add into the output in ascending order, as transformers' eager forward does."""
        top_k = chosen.shape[-1]
        flat = chosen.reshape(-1)
        # Stable: an expert's pairs keep token order, so a replay reproduces a record bit for bit.
        order = torch.argsort(flat, stable=True)
        token_of = order // top_k
        weight_of = weights.reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        output = torch.zeros_like(tokens)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = slice(start, start + count)
            start += count
            rows = token_of[pairs]
            gate, up = F.linear(tokens[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out = F.linear(self.act(gate) * up, self.down_proj[expert]) * weight_of[pairs]
            output.index_add_(0, rows, out.to(output.dtype))
        return output


class SparseMoE(nn.Module):
    """A decoder layer's sparse MLP: the router `gate`, top-k routing (or a replayed one) and
    the `experts`. Stateless between calls: the routing comes back in the output."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)

    def route(self, tokens: torch.Tensor, replay: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [N, k] int64, weights [N, k]) of tokens [N, H]: the router's top-k, or the
        replayed experts (already checked; the router's top-k in rows of FREE_ROUTE), weighted
        by the router's probabilities of them."""
        logits = self.gate(tokens)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if replay is None:
            chosen = torch.topk(probs, self.spec.top_k, dim=-1).indices
        elif bool((replay == FREE_ROUTE).any()):
            top = torch.topk(probs, self.spec.top_k, dim=-1).indices
            chosen = torch.where(replay == FREE_ROUTE, top, replay)
        else:
            chosen = replay
        # The very values topk returns: a replayed record reproduces its forward bit for bit.
        weights = probs.gather(-1, chosen)
        if self.spec.renormalises:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.spec.family == "qwen3_moe":
            weights = weights.to(logits.dtype)
        return chosen, weights

    def forward(self, hidden: torch.Tensor, replay: torch.Tensor | None = None) -> MoEOutput:
        """hidden [..., H] -> MoEOutput(hidden [..., H], experts [..., k]). With `replay` (a
        previous call's `experts` for the same tokens, or a peer's record of them), those
        experts are used instead of the router's choice, except in rows of FREE_ROUTE (tokens
        without a record: padding, a prompt the sampler did not record). `experts` are always
        the ones that ran."""
        leading = hidden.shape[:-1]
        tokens = hidden.reshape(-1, self.spec.hidden_size)
        replayed = (None if replay is None
                    else checked_replay(replay, leading, self.spec, hidden.device))
        chosen, weights = self.route(tokens, replayed)
        output = self.experts(tokens, chosen, weights)
        record = chosen.to(self.spec.routing_dtype).reshape(*leading, self.spec.top_k)
        return MoEOutput(output.reshape(hidden.shape), record)
