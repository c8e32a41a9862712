"""Batched token-by-token generation over an inference chain, with the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import VersionSpan, oldest_versions


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]  # behaviour log-prob of each token, under the sampled distribution
    finished: bool  # ended with a stop token rather than at max_new_tokens
    spans: list[VersionSpan]  # the weights that sampled the tokens (only spans that cover one)

    @property
    def versions(self) -> tuple[int, ...]:
        """Per stage, the oldest weight version that sampled a token of this row."""
        return tuple(oldest_versions(self.spans))


def version_spans(step_versions: list[tuple[int, ...]]) -> list[VersionSpan]:
    """Spans from the versions of each step (step i sampled completion token i): a new span
    wherever they change."""
    spans: list[VersionSpan] = []
    for index, versions in enumerate(step_versions):
        if not spans or tuple(spans[-1].versions) != versions:
            spans.append(VersionSpan(start=index, versions=list(versions)))
    return spans


def step_seed(seed: int | None, step: int) -> int | None:
    """A well-mixed seed for decoding step `step`. Not `seed + step`: torch's CPU generator
    (MT19937) seeded with nearby integers draws correlated first numbers, so a row would get
    alike draws at every step (always a tail token, say) and samples would skew."""
    if seed is None:
        return None
    return splitmix64(splitmix64(seed) ^ step) >> 1  # 63 bits: manual_seed takes an int64


def splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] and the mask of real tokens [B, P], prompts aligned to the right."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        valid[row, length - len(prompt):] = True
    return ids.to(device), valid.to(device)


def generate(chain: InferenceChain, prompts: list[list[int]], max_new_tokens: int,
             sampling: SamplingConfig, stop_ids: set[int], pad_id: int,
             seed: int | None = None,
             on_session: Callable[[InferenceSession], None] | None = None) -> list[Generation]:
    """Sample up to `max_new_tokens` per prompt. Every step draws with its own seed derived from
    `seed` (None: torch's global generator), so a seed gives the same samples on any chain.
    Stage weights may change between steps: each generation's spans say which versions sampled
    which of its tokens. `on_session` is handed the session (a swarm session records who computed
    what, for spot-checks)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = chain.device
    ids, prompt_valid = left_pad(prompts, pad_id, device)
    batch, prompt_length = ids.shape
    valid = torch.cat([prompt_valid, torch.ones(batch, max_new_tokens, dtype=torch.bool,
                                                device=device)], dim=1)
    positions = (prompt_valid.long().cumsum(-1) - 1).clamp(min=0)
    next_position = positions[:, -1:] + 1
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens_out, logprobs_out, versions_out = [], [], []
    session = chain.open_session(batch, prompt_length + max_new_tokens)
    if on_session is not None:
        on_session(session)
    try:
        tokens, logprobs, versions = session.step(ids, positions, valid[:, :prompt_length],
                                                  sampling, step_seed(seed, 0))
        for step in range(max_new_tokens):
            tokens = tokens.masked_fill(done, pad_id)
            tokens_out.append(tokens)
            logprobs_out.append(logprobs)
            versions_out.append(versions)
            done_before = done
            done = done | torch.isin(tokens, stop)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding padding (cheaper than reshaping the batch and caches);
            # their keys are masked out and their tokens dropped below.
            valid[:, prompt_length + step] = ~done_before
            tokens, logprobs, versions = session.step(tokens[:, None], next_position,
                                                      valid[:, :prompt_length + step + 1],
                                                      sampling, step_seed(seed, step + 1))
            next_position = next_position + 1
    finally:
        session.close()
    all_tokens = torch.stack(tokens_out, 1).cpu()
    all_logprobs = torch.stack(logprobs_out, 1).float().cpu()
    spans = version_spans(versions_out)
    results = []
    for row in range(batch):
        row_tokens = all_tokens[row].tolist()
        length = len(row_tokens)
        finished = False
        for i, token in enumerate(row_tokens):
            if token in stop_ids:
                length, finished = i + 1, True
                break
        results.append(Generation(row_tokens[:length], all_logprobs[row, :length].tolist(),
                                  finished, [span for span in spans if span.start < length]))
    return results
