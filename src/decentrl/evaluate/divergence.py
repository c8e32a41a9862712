"""How far a post-trained model has drifted from its base on general text: the KL divergence
between their next-token distributions, and each one's perplexity, on a fixed set of general chat
prompts with reference responses (general_prompts.json; nothing about the training tasks).

Definitions. Every prompt is rendered as a one-turn chat (the tokenizer's template, generation
prompt included) and followed by its reference response and the end-of-turn token, the way a
generation would end. Both models read exactly these tokens (teacher forcing), and at every
position that predicts a response token (the end-of-turn token included, since knowing when to
stop is part of the behaviour) we take the full next-token distributions p (model) and q (base):

  KL(p || q) = sum over the vocabulary of p(v) * (log p(v) - log q(v))   [nats per token]

- Direction: KL(model || base), the expectation under the model's own predictions. It is the
  divergence the RL objective's KL penalty holds down (reverse KL from the policy's side), and it
  weighs most where the post-trained model puts its mass: a model that has grown confident in
  something the base found unlikely scores high.
- Tokens: the reference responses, not samples from either model, so the contexts are the same
  for every model and run and the number carries no sampling noise; it is exact over the
  vocabulary, not a one-sample estimate.
- Interval: each prompt's mean KL over its response tokens is one value; we report their mean
  and its 95% normal-approximation interval over prompts (`mean_interval`), since prompts, not
  tokens, are the independent units.
- Perplexity: exp of the mean negative log-likelihood of the reference tokens (pooled over all
  tokens of all prompts), for the model and the base. A rise means the model has become worse at
  ordinary text; it says nothing about the tasks it was trained on.

The log-softmax runs in float32 whatever dtype the stages compute in, so the KL of a model against
itself is exactly 0. Rounding is not: SmolLM2-135M-Instruct in bf16 against itself in fp32 gives
about 0.001 nats per token on this set, the floor below which bf16 numbers mean nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from decentrl.evaluate.stats import mean_interval
from decentrl.model.blocks import positions_from_valid
from decentrl.model.stages import StageModule
from decentrl.rollout.generate import left_pad

GENERAL_PROMPTS_FILE = "general_prompts.json"
# Logits of every response token of a batch are held at once ([tokens, vocab] float32, twice, for
# model and base): 8 prompts of ~100 tokens with a 49k vocabulary is about 160 MB each.
DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class GeneralPrompt:
    prompt: str  # the user message
    response: str  # a reference assistant reply


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95% interval."""

    mean: float
    low: float
    high: float


@dataclass(frozen=True)
class GeneralResult:
    prompts: int
    tokens: int  # reference tokens scored (responses plus their end-of-turn tokens)
    perplexity: float  # the model's
    base_perplexity: float | None  # None without a base
    kl: Interval | None  # per-token KL(model || base) in nats; None without a base


def load_general_prompts() -> list[GeneralPrompt]:
    """The packaged general prompt set."""
    text = resources.files("decentrl.evaluate").joinpath(GENERAL_PROMPTS_FILE).read_text("utf-8")
    return [GeneralPrompt(item["prompt"], item["response"]) for item in json.loads(text)["prompts"]]


def encode(tokenizer: Any, item: GeneralPrompt) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids): the chat prompt ready for the assistant, then the reference
    response as the model would generate it, ending with the end-of-turn token."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    response = tokenizer.encode(item.response, add_special_tokens=False)
    return list(prompt), [*response, tokenizer.eos_token_id]


@torch.inference_mode()
def response_logprobs(stages: Sequence[StageModule], pairs: Sequence[tuple[list[int], list[int]]],
                      pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced next-token log-probs [N, vocab] (float32) at every position that predicts a
    response token, and those tokens [N]; rows in order, each row's response tokens in order."""
    sequences = [prompt + response for prompt, response in pairs]
    ids, valid = left_pad(sequences, pad_id, next(stages[0].parameters()).device)
    length = ids.shape[1]
    predicting = torch.zeros_like(valid)
    for row, (_, response) in enumerate(pairs):
        # Right-aligned rows: the response is the last len(response) tokens, each predicted by
        # the position before it.
        predicting[row, length - len(response) - 1:length - 1] = True
    targets = ids[:, 1:][predicting[:, :-1]]
    x = ids
    for stage in stages:
        x = stage(x, positions_from_valid(valid), valid,
                  head_positions=predicting if stage.is_last else None)
    return torch.log_softmax(x.float(), dim=-1), targets


def evaluate_general(model: Sequence[StageModule], base: Sequence[StageModule] | None,
                     tokenizer: Any, prompts: Sequence[GeneralPrompt],
                     batch_size: int = DEFAULT_BATCH_SIZE,
                     progress: Callable[[int, int], None] | None = None) -> GeneralResult:
    """Perplexity of `model` (and `base`) on the reference responses, and KL(model || base) per
    token with its interval over prompts. Model and base must share `tokenizer`. `progress`, if
    given, is called with (prompts done, prompts in all)."""
    if not prompts:
        raise ValueError("the general prompt set is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if base is not None and base[-1].spec.vocab_size != model[-1].spec.vocab_size:
        raise ValueError(f"model and base have different vocabularies ({model[-1].spec.vocab_size}"
                         f" and {base[-1].spec.vocab_size} tokens); KL needs a shared one")
    pairs = [encode(tokenizer, item) for item in prompts]
    if progress is not None:
        progress(0, len(pairs))
    model_nll, base_nll, tokens = 0.0, 0.0, 0
    kl_per_prompt: list[float] = []
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start:start + batch_size]
        lengths = [len(response) for _, response in batch]
        logprobs, targets = response_logprobs(model, batch, tokenizer.pad_token_id)
        model_nll -= float(logprobs.gather(1, targets[:, None]).sum())
        tokens += len(targets)
        if base is not None:
            base_logprobs, _ = response_logprobs(base, batch, tokenizer.pad_token_id)
            base_nll -= float(base_logprobs.gather(1, targets[:, None]).sum())
            kl = (logprobs.exp() * (logprobs - base_logprobs)).sum(-1)
            kl_per_prompt += [float(row.mean()) for row in kl.split(lengths)]
        if progress is not None:
            progress(start + len(batch), len(pairs))
    return GeneralResult(
        prompts=len(pairs), tokens=tokens, perplexity=math.exp(model_nll / tokens),
        base_perplexity=math.exp(base_nll / tokens) if base is not None else None,
        kl=Interval(*mean_interval(kl_per_prompt)) if base is not None else None,
    )
