"""Held-out evaluation over an inference chain: greedy pass@1 and sampled pass@k, each with a 95%
confidence interval (Wilson for pass@1; normal approximation over problems for pass@k).

An environment is evaluated the same way, a whole episode per sample: pass@1 is the greedy
episode success rate, and `episodes` adds the greedy episodes' mean turns, tool calls per episode
and the share of calls that were malformed. An episode the token budget cut short is a failure."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from decentrl.envs import Environment
from decentrl.evaluate.stats import Accuracy, pass_at_k
from decentrl.rollout.chain import InferenceChain
from decentrl.rollout.episodes import generate_episodes
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.tasks import Problem, Task, problems, render_prompt


@dataclass
class EpisodeStats:
    """Over greedy episodes: what the agent did, beside whether it succeeded."""

    mean_turns: float
    mean_tool_calls: float
    invalid_call_rate: float | None  # None: no tool call was made
    cut_by_budget: int  # episodes the token budget ended before the environment did


@dataclass
class Outcomes:
    """One batch's generations, judged."""

    solved: list[bool]
    texts: list[str]
    lengths: list[int]
    turns: list[int]  # per sample; 1 for a single-turn task
    tool_calls: list[int]
    invalid_calls: list[int]
    cut: list[bool]  # an episode the budget ended (False for a single-turn task)


@dataclass
class EvalResult:
    task: str
    split: str
    problems: int
    pass1: Accuracy  # greedy
    pass_k: Accuracy | None  # sampled, unbiased estimator, averaged over problems
    k: int
    mean_completion_tokens: float
    samples: list[dict[str, Any]]  # a few (question, completion, correct) for the report
    episodes: EpisodeStats | None = None  # for an environment

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pass1_label(result: EvalResult) -> str:
    return "episode success (greedy)" if result.episodes is not None else "pass@1 (greedy)"


def episode_rows(before: EvalResult | None, after: EvalResult | None) -> list[list[str]]:
    """Rows [metric, before, after] of the greedy episodes' statistics; none for a task."""
    if (before is None or before.episodes is None) and (after is None or after.episodes is None):
        return []

    def cells(read: Callable[[EvalResult, EpisodeStats], str]) -> list[str]:
        return [read(r, r.episodes) if r is not None and r.episodes is not None else "-"
                for r in (before, after)]

    return [
        ["turns per episode", *cells(lambda r, e: f"{e.mean_turns:.2f}")],
        ["tool calls per episode", *cells(lambda r, e: f"{e.mean_tool_calls:.2f}")],
        ["invalid-call rate", *cells(lambda r, e: "-" if e.invalid_call_rate is None
                                     else f"{100 * e.invalid_call_rate:.1f}%")],
        ["cut by the token budget", *cells(lambda r, e: f"{e.cut_by_budget} of {r.problems}")],
    ]


def _judge(chain: InferenceChain, task: Task | Environment, split: str,
           batch_problems: list[Problem], tokenizer: Any, max_new_tokens: int,
           sampling: SamplingConfig, seed: int | None) -> Outcomes:
    if isinstance(task, Environment):
        episodes = [task.episode(split, p.index) for p in batch_problems]  # type: ignore[arg-type]
        played = generate_episodes(chain, episodes, tokenizer, max_new_tokens, sampling, seed)
        return Outcomes(
            solved=[p.reward is not None and p.reward.solved for p in played],
            texts=[tokenizer.decode(p.generation.tokens, skip_special_tokens=True)
                   for p in played],
            lengths=[len(p.generation.tokens) for p in played],
            turns=[e.turns for e in episodes], tool_calls=[e.tool_calls for e in episodes],
            invalid_calls=[e.invalid_calls for e in episodes],
            cut=[p.reward is None for p in played])
    prompts = [render_prompt(task, p, tokenizer) for p in batch_problems]
    generations = generate(chain, prompts, max_new_tokens, sampling, {tokenizer.eos_token_id},
                           tokenizer.pad_token_id, seed)
    texts = [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in generations]
    count = len(batch_problems)
    return Outcomes(solved=[task.reward(p, text).solved for p, text in zip(batch_problems, texts)],
                    texts=texts, lengths=[len(g.tokens) for g in generations], turns=[1] * count,
                    tool_calls=[0] * count, invalid_calls=[0] * count, cut=[False] * count)


def evaluate(chain: InferenceChain, task: Task | Environment, tokenizer: Any, num_problems: int,
             max_new_tokens: int, batch_size: int, pass_k: int = 1, seed: int = 0,
             split: str = "heldout", progress: Callable[[int, int], None] | None = None,
             concurrency: int = 1) -> EvalResult:
    """`progress`, if given, is called with (generations done, generations in all): one greedy
    generation per problem, and `pass_k` sampled ones when pass_k > 1.
    `concurrency` > 1 runs that many batches at once (over a swarm, so hop latency is hidden and
    every replica works); the result does not depend on it."""
    if num_problems < 1 or batch_size < 1:
        raise ValueError(f"num_problems and batch_size must be >= 1, got {num_problems} and "
                         f"{batch_size}")
    items = problems(task, split, num_problems)  # type: ignore[arg-type]
    greedy = SamplingConfig(temperature=0.0)
    sampled = SamplingConfig(temperature=1.0)
    # Jobs: greedy batches, and for pass@k, sub-batches of k samples per problem (problem-major,
    # so each problem's samples sit together). Each sampled job has its own seed.
    jobs: list[tuple[int, list[Problem], SamplingConfig, int | None]] = []
    for start in range(0, len(items), batch_size):
        jobs.append((start, items[start:start + batch_size], greedy, None))
    if pass_k > 1:
        per_batch = max(1, batch_size // pass_k)
        for sub in range(0, len(items), per_batch):
            repeated = [p for p in items[sub:sub + per_batch] for _ in range(pass_k)]
            jobs.append((sub, repeated, sampled, seed * 1_000_003 + sub))
    done, total = 0, sum(len(chunk) for _, chunk, _, _ in jobs)
    lock = threading.Lock()

    def run(job: tuple[int, list[Problem], SamplingConfig, int | None]) -> Outcomes:
        nonlocal done
        start, chunk, sampling, job_seed = job
        out = _judge(chain, task, split, chunk, tokenizer, max_new_tokens, sampling, job_seed)
        if progress is not None:
            with lock:
                done += len(chunk)
                progress(done, total)
        return out

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(run, jobs))
    greedy = Outcomes([], [], [], [], [], [], [])
    samples: list[dict[str, Any]] = []
    sampled_correct = [0] * len(items)
    for (start, chunk, sampling, _), out in zip(jobs, results):
        if sampling.greedy:
            for field in vars(greedy):
                getattr(greedy, field).extend(getattr(out, field))
            if len(samples) < 8:
                samples += [{"question": p.question, "completion": t, "correct": s}
                            for p, t, s in zip(chunk, out.texts, out.solved)][: 8 - len(samples)]
        else:
            for j, ok in enumerate(out.solved):
                sampled_correct[start + j // pass_k] += int(ok)
    pass_k_accuracy = None
    if pass_k > 1:
        pass_k_accuracy = Accuracy.from_values(
            [pass_at_k(pass_k, c, pass_k) for c in sampled_correct])
    episodes = None
    if isinstance(task, Environment):
        calls = sum(greedy.tool_calls)
        episodes = EpisodeStats(
            mean_turns=sum(greedy.turns) / len(items),
            mean_tool_calls=calls / len(items),
            invalid_call_rate=sum(greedy.invalid_calls) / calls if calls else None,
            cut_by_budget=sum(greedy.cut))
    return EvalResult(
        task=task.name, split=split, problems=len(items),
        pass1=Accuracy.from_counts(sum(greedy.solved), len(greedy.solved)),
        pass_k=pass_k_accuracy, k=pass_k,
        mean_completion_tokens=sum(greedy.lengths) / len(greedy.lengths), samples=samples,
        episodes=episodes,
    )
