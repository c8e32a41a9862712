"""Batched token-by-token generation over an inference chain, with the KV cache.

Multi-turn episodes run in the same loop: when a row samples a stop token, `on_stop` may hand
back the tokens that continue its conversation (an environment's reply, then the next assistant
header). Those are fed to the row one per step, as forced tokens, while the other rows go on
sampling, so every row still advances one position per step: one session, one batch, and the
version of every position is the step's, as in single-turn generation. A forced token was not
sampled: it carries no behaviour log-prob and no gradient (`Generation.generated` says which).

A row also stops when its sampled tokens end with one of `stop_sequences` (a tool call's closing
tag, so that a turn ends with its call instead of running on past it).

With `record_routing` (a mixture of experts, train.routing_replay), each row also keeps the
experts each of its completion tokens went to when the next step read it (the step after it was
sampled): the learner replays them. A row's last token is read by no step: FREE_ROUTE."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decentrl.model.moe import FREE_ROUTE
from decentrl.rollout.chain import InferenceChain, InferenceSession, StepResult
from decentrl.rollout.routing import routing_record
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout, RolloutGroup, VersionSpan, oldest_versions


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]  # behaviour log-prob of each sampled token; 0.0 for a forced one
    finished: bool  # ended with a stop token rather than at max_new_tokens
    spans: list[VersionSpan]  # the weights that sampled the tokens (only spans that cover one)
    generated: list[bool]  # per token: sampled by the model (True) or forced by on_stop (False)
    # [tokens, sparse layers, top_k]: each token's experts (record_routing); None: not recorded
    routing: torch.Tensor | None = None

    @property
    def versions(self) -> tuple[int, ...]:
        """Per stage, the oldest weight version that sampled a token of this row."""
        return tuple(oldest_versions(self.spans))


def rollout_group(group_id: str, task: str, problem_index: int, prompt: list[int],
                  rows: list[Generation], sampling_seed: int) -> RolloutGroup:
    """The group of `rows`, samples of `prompt` generated together in one session seeded with
    `sampling_seed`: what a spot-check re-executes (trust/verify.py)."""
    rollouts = [Rollout(prompt_tokens=prompt, completion_tokens=g.tokens,
                        behaviour_logprobs=g.logprobs, finished=g.finished,
                        generated=None if all(g.generated) else g.generated,
                        routing=None if g.routing is None else routing_record(g.routing))
                for g in rows]
    # The rows share the session's steps: each row's spans are a prefix of the longest's.
    spans = max(rows, key=lambda g: len(g.tokens)).spans
    return RolloutGroup(group_id=group_id, task=task, problem_index=problem_index,
                        stage_versions=oldest_versions(spans), version_spans=spans,
                        sampling_seed=sampling_seed, rollouts=rollouts)


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


def ends_turn(tokens: Sequence[int], generated: Sequence[bool], stop_ids: set[int],
              stop_sequences: Sequence[Sequence[int]]) -> bool:
    """Whether the last token of `tokens` stops its row: a sampled stop token, or a sampled token
    that completes one of `stop_sequences`."""
    if not tokens or not generated[-1]:
        return False
    if tokens[-1] in stop_ids:
        return True
    return any(0 < len(stop) <= len(tokens) and list(tokens[-len(stop):]) == list(stop)
               for stop in stop_sequences)


# Called with (row, the row's tokens so far, the stop token included) when the row samples a stop
# token: the tokens to force next, or None to end the row there.
OnStop = Callable[[int, list[int]], list[int] | None]


def generate(chain: InferenceChain, prompts: list[list[int]], max_new_tokens: int,
             sampling: SamplingConfig, stop_ids: set[int], pad_id: int,
             seed: int | None = None,
             on_session: Callable[[InferenceSession], None] | None = None,
             on_stop: OnStop | None = None,
             stop_sequences: Sequence[Sequence[int]] = (),
             record_routing: bool = False) -> list[Generation]:
    """Sample up to `max_new_tokens` per prompt (forced tokens count). Every step draws with its
    own seed derived from `seed` (None: torch's global generator), so a seed gives the same
    samples on any chain. Stage weights may change between steps: each generation's spans say
    which versions sampled which of its tokens. `on_session` is handed the session (a swarm
    session records who computed what, for spot-checks); `on_stop` continues a row past a stop
    token or a stop sequence; `record_routing` keeps each token's experts (see the module
    docstring)."""
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
    forced: list[list[int]] = [[] for _ in range(batch)]  # per row, tokens still to force
    is_forced = torch.zeros(batch, dtype=torch.bool)
    tokens_out, logprobs_out, versions_out, forced_out = [], [], [], []
    routing_out: list[torch.Tensor] = []  # per step after the first, [B, layers, top_k]
    # Each row's tokens so far on the host, for stop sequences and on_stop: appended a step at a
    # time, since stacking the whole history at every step is quadratic in the episode's length.
    row_tokens_so_far: list[list[int]] = [[] for _ in range(batch)]
    row_sampled_so_far: list[list[bool]] = [[] for _ in range(batch)]
    routing_template: torch.Tensor | None = None
    session = chain.open_session(batch, prompt_length + max_new_tokens)
    if on_session is not None:
        on_session(session)
    try:
        result = session.step(ids, positions, valid[:, :prompt_length], sampling,
                              step_seed(seed, 0))
        tokens, logprobs, versions = result.tokens, result.logprobs, result.versions
        if record_routing:
            if result.routing is None:
                raise ValueError("record_routing needs a chain that records routing: a mixture "
                                 "of experts' stages in this process (LocalChain)")
            # The prefill's: what a row's experts look like, for the tokens no step read.
            routing_template = step_routing(result)
        for step in range(max_new_tokens):
            tokens = tokens.masked_fill(done, pad_id)
            if on_stop is not None:
                tokens, logprobs, is_forced = force_tokens(tokens, logprobs, forced, done)
            tokens_out.append(tokens)
            logprobs_out.append(logprobs)
            versions_out.append(versions)
            forced_out.append(is_forced)
            done_before = done
            stopped = torch.isin(tokens, stop) & ~is_forced.to(device) & ~done
            if on_stop is not None or stop_sequences:
                for row, (token, was_forced) in enumerate(zip(tokens.tolist(),
                                                              is_forced.tolist())):
                    row_tokens_so_far[row].append(token)
                    row_sampled_so_far[row].append(not was_forced)
                for row in (~stopped & ~done).nonzero()[:, 0].tolist():
                    stopped[row] = ends_turn(row_tokens_so_far[row], row_sampled_so_far[row],
                                             set(), stop_sequences)
            if on_stop is not None:
                for row in stopped.nonzero()[:, 0].tolist():
                    continuation = on_stop(row, list(row_tokens_so_far[row]))
                    if continuation:
                        forced[row] = list(continuation)
                        stopped[row] = False
            done = done | stopped
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding padding (cheaper than reshaping the batch and caches);
            # their keys are masked out and their tokens dropped below.
            valid[:, prompt_length + step] = ~done_before
            result = session.step(tokens[:, None], next_position,
                                  valid[:, :prompt_length + step + 1], sampling,
                                  step_seed(seed, step + 1))
            tokens, logprobs, versions = result.tokens, result.logprobs, result.versions
            if record_routing:
                routing_out.append(step_routing(result))
            next_position = next_position + 1
    finally:
        session.close()
    all_tokens = torch.stack(tokens_out, 1).cpu()
    all_logprobs = torch.stack(logprobs_out, 1).float().cpu()
    all_forced = torch.stack(forced_out, 1)
    all_routing = (None if routing_template is None else
                   completion_routing(routing_out, all_tokens.shape[1], routing_template))
    spans = version_spans(versions_out)
    longest_stop = max((len(stop) for stop in stop_sequences), default=1)
    results = []
    for row in range(batch):
        row_tokens = all_tokens[row].tolist()
        row_forced = all_forced[row].tolist()
        length = len(row_tokens)
        finished = False
        row_generated = [not f for f in row_forced]
        # Only a row that stopped is finished: one whose turn ended on the budget's last token
        # was continued by on_stop and then cut, its environment reply never fed.
        for i in range(len(row_tokens) if bool(done[row]) else 0):
            start = max(0, i + 1 - longest_stop)  # ends_turn reads no further back than this
            # A stop the row went on from (an episode's turn end) is not its end.
            if ends_turn(row_tokens[start:i + 1], row_generated[start:i + 1], stop_ids,
                         stop_sequences) and (i + 1 == len(row_tokens) or not row_forced[i + 1]):
                length, finished = i + 1, True
                break
        results.append(Generation(row_tokens[:length], all_logprobs[row, :length].tolist(),
                                  finished, [span for span in spans if span.start < length],
                                  row_generated[:length],
                                  None if all_routing is None else all_routing[row, :length]))
    return results


def step_routing(result: StepResult) -> torch.Tensor:
    """The experts [B, layers, top_k] of the last position a step read."""
    if result.routing is None:
        raise ValueError("the chain stopped recording routing mid-session")
    return result.routing[:, -1].cpu()


def completion_routing(steps: list[torch.Tensor], tokens: int, template: torch.Tensor
                       ) -> torch.Tensor:
    """[B, tokens, layers, top_k]: completion token j's experts are those of the step that read
    it (steps[j]); a token no step read (the last) gets FREE_ROUTE. `template` [B, layers,
    top_k] gives the shape and dtype."""
    unread = torch.full((template.shape[0], tokens - len(steps), *template.shape[1:]),
                        FREE_ROUTE, dtype=template.dtype)
    return torch.cat([*(step[:, None] for step in steps), unread], 1)


def force_tokens(tokens: torch.Tensor, logprobs: torch.Tensor, forced: list[list[int]],
                 done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's tokens with each row's next forced token (if it has one) in place of its
    sample, the log-probs with 0.0 there, and which rows were forced."""
    is_forced = torch.tensor([bool(queue) and not bool(finished)
                              for queue, finished in zip(forced, done.tolist())])
    if not bool(is_forced.any()):
        return tokens, logprobs, is_forced
    tokens, logprobs = tokens.clone(), logprobs.clone()
    for row in is_forced.nonzero()[:, 0].tolist():
        tokens[row] = forced[row].pop(0)
        logprobs[row] = 0.0
    return tokens, logprobs, is_forced
