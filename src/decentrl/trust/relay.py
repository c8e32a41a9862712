"""What the coordinator checks in an inference stage's reply before it uses it or relays it to the
next stage, whole: hidden states of the model's width, floating, finite and within a magnitude
bound; at the last stage, token ids in the vocabulary and log-probs that are log-probabilities;
from a stage with mixture-of-experts layers, the experts its positions went to (distinct expert
indices of the model's routing dtype). A reply that fails was the producing replica's doing (it
signed it), so the coordinator blames that replica and never forwards the reply: the honest next
stage would refuse it, or overflow on it, and strike the coordinator that relayed it."""

from __future__ import annotations

import torch

from decentrl.errors import SenderFault
from decentrl.model.moe import MoESpec, RoutingReplayError, checked_replay

# The largest |value| a relayed hidden state may carry. Honest residual streams have a few
# "massive activation" channels, far over the rest: measured on SmolLM2-135M (prompts of 46 and
# 201 tokens, every layer boundary), 24,960 in bf16 and 24,926 in fp32 from layer 12 on. 2^20 is
# 40x over that, and ~10^11 under where the next stage's fp32 RMSNorm (a sum of squares over the
# hidden width) would overflow to inf and turn its output into NaN. An fp16 stage (only on
# request: dtype = "fp16") overflows at 65,504, which SmolLM2's honest activations already come
# within 3x of: no bound protects that dtype.
MAX_ACTIVATION = 2.0**20


class BadReply(SenderFault):
    """A reply whose content breaks the protocol; the message names the check it failed."""


def check_hidden_states(hidden: torch.Tensor | None, batch: int, length: int,
                        hidden_size: int) -> torch.Tensor:
    """`hidden`, if it is the hidden states [batch, length, hidden_size] a stage must reply:
    floating, every value finite and within MAX_ACTIVATION; else BadReply."""
    expected = (batch, length, hidden_size)
    if hidden is None:
        raise BadReply(f"no hidden states {list(expected)}")
    if not hidden.is_floating_point():
        raise BadReply(f"hidden states must be floating, got {hidden.dtype}")
    if tuple(hidden.shape) != expected:
        raise BadReply(f"hidden states must be {list(expected)}, got {list(hidden.shape)}")
    if not bool(torch.isfinite(hidden).all()):
        raise BadReply("hidden states carry non-finite values (NaN or inf)")
    largest = float(hidden.abs().max()) if hidden.numel() else 0.0
    if largest > MAX_ACTIVATION:
        raise BadReply(f"hidden states reach |{largest:.3g}|, over the bound {MAX_ACTIVATION:.3g} "
                       "no honest activation reaches")
    return hidden


def check_samples(tokens: torch.Tensor | None, logprobs: torch.Tensor | None, batch: int,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs as float32) if they are what the last stage must reply: int64 token
    ids [batch] in [0, vocab_size) and floating log-probs [batch], finite and <= 0; else
    BadReply."""
    if tokens is None or logprobs is None:
        raise BadReply(f"the last stage must reply tokens and logprobs [{batch}]")
    if tokens.dtype != torch.long or tuple(tokens.shape) != (batch,):
        raise BadReply(f"tokens must be int64 [{batch}], got {tokens.dtype} "
                       f"{list(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise BadReply(f"sampled token ids must be in [0, {vocab_size})")
    if not logprobs.is_floating_point() or tuple(logprobs.shape) != (batch,):
        raise BadReply(f"logprobs must be floating [{batch}], got {logprobs.dtype} "
                       f"{list(logprobs.shape)}")
    logprobs = logprobs.float()
    if not bool(torch.isfinite(logprobs).all()) or bool((logprobs > 0).any()):
        raise BadReply("logprobs must be finite and <= 0")
    return tokens, logprobs


def check_experts(experts: torch.Tensor | None, batch: int, length: int, layers: int,
                  moe: MoESpec) -> torch.Tensor:
    """`experts`, if it is the routing a stage with `layers` sparse layers must reply for
    [batch, length] positions: [batch, length, layers, top_k] of the model's routing dtype,
    every index an expert, a token's experts distinct; else BadReply."""
    expected = (batch, length, layers, moe.top_k)
    if experts is None:
        raise BadReply(f"no experts {list(expected)} from a stage with {layers} sparse layers")
    if experts.dtype != moe.routing_dtype:
        raise BadReply(f"experts must be {moe.routing_dtype}, got {experts.dtype}")
    if tuple(experts.shape) != expected:
        raise BadReply(f"experts must be {list(expected)}, got {list(experts.shape)}")
    try:
        rows = checked_replay(experts, experts.shape[:-1], moe, experts.device)
    except RoutingReplayError as error:
        raise BadReply(f"experts: {error}") from error
    if bool((rows < 0).any()):  # a replay may leave a row free; a record never does
        raise BadReply("experts name no expert for some token")
    return experts
