"""Held-out evaluation over an inference chain: pass@1 and sampled pass@k, each with a 95%
confidence interval (Wilson for greedy pass@1; for sampled ones, Wilson on the effective number
of trials, a problem's samples being a cluster: stats.effective_trials).

Two shapes. By default pass@1 is greedy, in batches of problems (the release comparison on the
coordinator's own machine, evaluate/suite.py). A run's own evaluation, local or swarm
(coordinator/loop.py), passes a `TrainingShape`: every session is a training group's (G samples of
one prompt, the rollout's sampling, a training-like seed), so that in a swarm the peers cannot tell
evaluation from training and the coordinator can spot-check it; pass@1 is then the mean success
of samples at the rollout's temperature (`EvalResult.pass1_temperature`), usually below greedy.
`TrainingShape.greedy` adds one greedy generation per problem (`EvalResult.greedy_pass1`), in
sessions of a training session's rows: a problem a row. Their temperature (0) tells a peer they
are evaluation, so their groups (one row each) go to `on_groups` for spot-checks too.

An environment is evaluated the same way, a whole episode per sample: pass@1 is the episode
success rate, and `episodes` adds the pass@1 episodes' mean turns, tool calls per episode and
the share of calls that were malformed. An episode the token budget cut short is a failure.

`EvalResult.levels` splits all of it by difficulty level (`tasks.base.difficulty_of`), and for
problems that carry an ideal chain of intermediate results (the calculator's multi-step stories)
tallies how many leading steps of it each pass@1 episode reached: where a chain breaks."""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from decentrl.envs import Environment
from decentrl.envs.base import Message
from decentrl.evaluate.stats import Accuracy, pass_at_k
from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.episodes import generate_episodes
from decentrl.rollout.generate import generate, rollout_group
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import RolloutGroup
from decentrl.tasks import Problem, Task, problems, render_prompt
from decentrl.tasks.base import difficulty_of

# How many leading steps of a problem's ideal chain (its intermediate results) a finished
# conversation reached, or None for a problem without one (envs/calculator.py
# `chain_steps_reached`).
ChainProgress = Callable[[Problem, list[Message]], int | None]


@dataclass
class EpisodeStats:
    """Over the pass@1 episodes: what the agent did, beside whether it succeeded."""

    mean_turns: float
    mean_tool_calls: float
    invalid_call_rate: float | None  # None: no tool call was made
    cut_by_budget: int  # episodes the token budget ended before the environment did
    played: int | None = None  # episodes in all (None in older files: one per problem)


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
    chain_steps: list[int | None]  # leading chain steps reached; None: no chain, or a task


@dataclass
class LevelStats:
    """One difficulty level's share of an evaluation: its problems, and what its pass@1 samples
    (and greedy rows) did."""

    problems: int
    pass1: Accuracy  # over the level's pass@1 samples, with EvalResult.pass1's interval
    greedy_pass1: Accuracy | None = None  # with a training shape's greedy rows
    episodes: EpisodeStats | None = None  # for an environment
    # Pass@1 episodes by the number of leading chain steps they reached ("0", "1", ... up to
    # the most any reached); None where no problem of the level has a chain.
    chain_steps: dict[str, int] | None = None


@dataclass
class EvalResult:
    task: str
    split: str
    problems: int
    pass1: Accuracy  # greedy, or sampled at pass1_temperature
    pass_k: Accuracy | None  # sampled, unbiased estimator, averaged over problems
    k: int
    mean_completion_tokens: float
    samples: list[dict[str, Any]]  # a few (question, completion, correct) for the report
    episodes: EpisodeStats | None = None  # for an environment
    pass1_temperature: float | None = None  # None: greedy pass@1
    # A training-shaped evaluation's greedy pass@1 beside its sampled one (TrainingShape.greedy).
    greedy_pass1: Accuracy | None = None
    # Per difficulty level, in `level_order`; empty in files from before levels.
    levels: dict[str, LevelStats] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# Under a table with sampled rows: what their intervals are (stats.Accuracy.from_scores).
SAMPLED_INTERVALS_NOTE = ("sampled rows: Wilson interval on the effective number of trials, a "
                          "problem's samples counted as one cluster")


def has_sampled_rows(result: EvalResult) -> bool:
    return result.pass1_temperature is not None or result.pass_k is not None


def pass1_label(result: EvalResult) -> str:
    how = ("greedy" if result.pass1_temperature is None
           else f"sampled at T={result.pass1_temperature:g}")
    return f"episode success ({how})" if result.episodes is not None else f"pass@1 ({how})"


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
        ["cut by the token budget", *cells(
            lambda r, e: f"{e.cut_by_budget} of {e.played or r.problems}")],
    ]


def level_order(level: str) -> list[str | int]:
    """Sort key of a level's name with its numbers compared as numbers: "2 steps" before
    "10 steps" (tasks.base.difficulty_of's buckets name their size)."""
    # Split on a capture group: text at even places, numbers at odd ones, so keys compare.
    return [int(part) if place % 2 else part
            for place, part in enumerate(re.split(r"(\d+)", level))]


# Where a training-shaped evaluation's seed indices start (see `training_shaped_jobs`).
EVAL_SEED_OFFSET = 2**31
# Where its greedy sessions' seed indices start: past the sampled sessions' (problem index x
# draws, far below 2^30), still below 2^32 so that the seed keeps the training seeds' form.
GREEDY_SEED_OFFSET = EVAL_SEED_OFFSET + 2**30
# The id tail of a greedy session's groups, and how its jobs are told apart.
GREEDY_TAG = "greedy"


@dataclass(frozen=True)
class TrainingShape:
    """Evaluation sessions shaped as a run's generation sessions, so that the peers serving a
    swarm run's evaluation cannot tell it from training (and the coordinator can spot-check it
    like training): `problems_per_session` problems per session (a swarm's: the run's groups
    per session), `group_size` samples of each, drawn with the rollout's `sampling` from a seed
    of the training seeds' form. pass@1 is then the mean of those samples' success (at the rollout's temperature, not
    greedy). A session's rows are its problems' groups one after the other, as in training.
    `greedy`: also one greedy generation per problem, `problems_per_session * group_size`
    problems per session (a training session's rows), for `EvalResult.greedy_pass1`."""

    group_size: int
    sampling: SamplingConfig
    problems_per_session: int = 1
    greedy: bool = False


@dataclass(frozen=True)
class Job:
    """One session: `problems` from index `first` of the evaluation's list, each `repeats`
    times in a row, and whether its samples make pass@1 (or only pass@k)."""

    first: int
    problems: list[Problem]
    repeats: int
    sampling: SamplingConfig
    seed: int | None
    for_pass1: bool
    # A training-shaped session: its groups' id tail (which of each problem's sampled sessions,
    # or "greedy"); None: not training-shaped, no groups.
    tag: str | None = None


# Called with the groups (a problem's samples each, in the session's row order) of a
# training-shaped session, and the session.
OnGroups = Callable[[list[RolloutGroup], InferenceSession], None]
# Called with a session's error and how many times its job failed so far: returns to run the job
# again (the sessions already done are kept), raises to end the evaluation.
Retry = Callable[[Exception, int], None]


def greedy_jobs(items: list[Problem], batch_size: int, pass_k: int, seed: int) -> list[Job]:
    """Greedy batches for pass@1, and for pass@k sub-batches of k samples per problem
    (problem-major, so each problem's samples sit together), each with its own seed."""
    jobs = [Job(start, items[start:start + batch_size], 1, SamplingConfig(temperature=0.0),
                None, True) for start in range(0, len(items), batch_size)]
    if pass_k > 1:
        per_batch = max(1, batch_size // pass_k)
        jobs += [Job(sub, items[sub:sub + per_batch], pass_k, SamplingConfig(temperature=1.0),
                     seed * 1_000_003 + sub, False) for sub in range(0, len(items), per_batch)]
    return jobs


def training_shaped_jobs(items: list[Problem], shape: TrainingShape, pass_k: int, seed: int
                         ) -> list[Job]:
    """Each problem's `group_size` samples as many times as pass@k needs (once for pass@1), in
    sessions of `problems_per_session` problems. A seed has the form of a training session's
    (run seed * 2^32 + an index), from 2^31 on: past the problem indices (run seed * 1_000_003 +
    problems scheduled, coordinator/scheduler.py) a run reaches in practice, so a training session's
    seed does not recur in an evaluation. Each
    evaluation of a run draws the same seeds: the before and after compare on the same noise."""
    draws, size = -(-pass_k // shape.group_size), shape.problems_per_session
    jobs = [Job(first, items[first:first + size], shape.group_size, shape.sampling,
                seed * 2**32 + EVAL_SEED_OFFSET + items[first].index * draws + draw, True,
                str(draw))
            for draw in range(draws) for first in range(0, len(items), size)]
    if shape.greedy:
        # No greedy token depends on the seed, but a spot-check re-executes a seeded session.
        rows = size * shape.group_size
        jobs += [Job(first, items[first:first + rows], 1, SamplingConfig(temperature=0.0),
                     seed * 2**32 + GREEDY_SEED_OFFSET + items[first].index, False, GREEDY_TAG)
                 for first in range(0, len(items), rows)]
    return jobs


def _judge(chain: InferenceChain, task: Task | Environment, split: str, job: Job, tokenizer: Any,
           max_new_tokens: int, on_groups: OnGroups | None,
           chain_progress: ChainProgress | None) -> Outcomes:
    rows = [p for p in job.problems for _ in range(job.repeats)]
    sessions: list[InferenceSession] = []
    if isinstance(task, Environment):
        episodes = [task.episode(split, p.index) for p in rows]  # type: ignore[arg-type]
        played = generate_episodes(chain, episodes, tokenizer, max_new_tokens, job.sampling,
                                   job.seed, sessions.append)
        generations, prompts = [p.generation for p in played], [p.prompt for p in played]
        outcomes = Outcomes(
            solved=[p.reward is not None and p.reward.solved for p in played],
            texts=[tokenizer.decode(g.tokens, skip_special_tokens=True) for g in generations],
            lengths=[len(g.tokens) for g in generations],
            turns=[e.turns for e in episodes], tool_calls=[e.tool_calls for e in episodes],
            invalid_calls=[e.invalid_calls for e in episodes],
            cut=[p.reward is None for p in played],
            chain_steps=[chain_progress(e.problem, e.messages()) if chain_progress is not None
                         else None for e in episodes])
    else:
        prompts = [render_prompt(task, p, tokenizer) for p in rows]
        generations = generate(chain, prompts, max_new_tokens, job.sampling,
                               {tokenizer.eos_token_id}, tokenizer.pad_token_id, job.seed,
                               sessions.append)
        texts = [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in generations]
        count = len(rows)
        outcomes = Outcomes(
            solved=[task.reward(p, text).solved for p, text in zip(rows, texts)], texts=texts,
            lengths=[len(g.tokens) for g in generations], turns=[1] * count,
            tool_calls=[0] * count, invalid_calls=[0] * count, cut=[False] * count,
            chain_steps=[None] * count)
    if on_groups is not None and job.tag is not None and job.seed is not None:
        rows_of = [slice(number * job.repeats, (number + 1) * job.repeats)
                   for number in range(len(job.problems))]
        on_groups([rollout_group(f"eval/{task.name}/{problem.index}/{job.tag}", task.name,
                                 problem.index, prompts[rows.start], generations[rows], job.seed)
                   for problem, rows in zip(job.problems, rows_of)], sessions[0])
    return outcomes


def pass1_accuracy(solved: list[list[bool]], sampled: bool) -> Accuracy:
    """pass@1 over problems' pass@1 samples: greedy (one sample each), the share solved with its
    Wilson interval; sampled, the mean of each problem's success rate with Wilson's interval on
    the samples' effective number of trials (at most one per sample, at least one per problem)."""
    if sampled:
        return Accuracy.from_scores([sum(samples) / len(samples) for samples in solved],
                                    max_trials=sum(map(len, solved)))
    flat = [sample for samples in solved for sample in samples]
    return Accuracy.from_counts(sum(flat), len(flat))


def episode_stats(outcomes: Outcomes, rows: list[int]) -> EpisodeStats:
    """What the agent did in these rows of `outcomes`."""
    calls = sum(outcomes.tool_calls[row] for row in rows)
    return EpisodeStats(
        mean_turns=sum(outcomes.turns[row] for row in rows) / len(rows),
        mean_tool_calls=calls / len(rows),
        invalid_call_rate=(sum(outcomes.invalid_calls[row] for row in rows) / calls if calls
                           else None),
        cut_by_budget=sum(outcomes.cut[row] for row in rows), played=len(rows))


def chain_step_counts(steps: list[int | None]) -> dict[str, int] | None:
    """Episodes per number of chain steps reached, every count from 0 to the most reached."""
    reached = Counter(step for step in steps if step is not None)
    if not reached:
        return None
    return {str(step): reached[step] for step in range(max(reached) + 1)}


def evaluate(chain: InferenceChain, task: Task | Environment, tokenizer: Any, num_problems: int,
             max_new_tokens: int, batch_size: int, pass_k: int = 1, seed: int = 0,
             split: str = "heldout", progress: Callable[[int, int], None] | None = None,
             concurrency: int = 1, shape: TrainingShape | None = None,
             on_groups: OnGroups | None = None, retry: Retry | None = None,
             chain_progress: ChainProgress | None = None) -> EvalResult:
    """`progress`, if given, is called with (generations done, generations in all).
    Without `shape`: one greedy generation per problem for pass@1, in batches of `batch_size`,
    and `pass_k` sampled ones when pass_k > 1. With `shape`: training-shaped sessions (see
    `TrainingShape`; `batch_size` is unused), each session's groups handed to `on_groups` once
    generated (a greedy session's too: a group of one row per problem).
    `concurrency` > 1 runs that many sessions at once (over a swarm, so hop latency is hidden
    and every replica works); the result does not depend on it. A session that fails is run
    again while `retry` returns. `chain_progress` reads each finished episode's chain steps
    (default: envs/calculator.py's `chain_steps_reached`, None for problems without a chain)."""
    if num_problems < 1 or batch_size < 1:
        raise ValueError(f"num_problems and batch_size must be >= 1, got {num_problems} and "
                         f"{batch_size}")
    items = problems(task, split, num_problems)  # type: ignore[arg-type]
    jobs = (greedy_jobs(items, batch_size, pass_k, seed) if shape is None
            else training_shaped_jobs(items, shape, pass_k, seed))
    environment = isinstance(task, Environment)
    if environment and chain_progress is None:
        # Here, not at the top: the calculator imports reasoning-gym (about two seconds).
        from decentrl.envs.calculator import chain_steps_reached
        chain_progress = chain_steps_reached
    done, total = 0, sum(len(job.problems) * job.repeats for job in jobs)
    lock = threading.Lock()

    def run(job: Job) -> Outcomes:
        nonlocal done
        failures = 0
        while True:
            try:
                out = _judge(chain, task, split, job, tokenizer, max_new_tokens, on_groups,
                             chain_progress)
                break
            except Exception as error:
                failures += 1
                if retry is None:
                    raise
                retry(error, failures)
        if progress is not None:
            with lock:
                done += len(out.solved)
                progress(done, total)
        return out

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(run, jobs))
    pass1 = Outcomes([], [], [], [], [], [], [], [])
    pass1_problem: list[int] = []  # which problem each row of `pass1` is
    pass1_solved: list[list[bool]] = [[] for _ in items]
    sampled_solved: list[list[bool]] = [[] for _ in items]
    greedy_solved: list[list[bool]] = [[] for _ in items]
    samples: list[dict[str, Any]] = []
    for job, out in zip(jobs, results):
        for row, solved in enumerate(out.solved):
            problem = job.first + row // job.repeats
            if job.tag == GREEDY_TAG:
                greedy_solved[problem].append(solved)
            elif job.for_pass1:
                pass1_solved[problem].append(solved)
                pass1_problem.append(problem)
                if shape is not None:  # a training shape's samples make pass@k too
                    sampled_solved[problem].append(solved)
            else:
                sampled_solved[problem].append(solved)
        if job.for_pass1:
            for name in vars(pass1):
                getattr(pass1, name).extend(getattr(out, name))
            # The first sample of each problem, for the report.
            samples += [{"question": p.question, "completion": out.texts[i * job.repeats],
                         "correct": out.solved[i * job.repeats]}
                        for i, p in enumerate(job.problems)][: max(0, 8 - len(samples))]
    pass_k_accuracy = None
    if pass_k > 1:
        # The samples make at most len(s) // pass_k independent pass@k trials: disjoint k-sets.
        pass_k_accuracy = Accuracy.from_scores(
            [pass_at_k(len(s), sum(s), pass_k) for s in sampled_solved],
            max_trials=sum(len(s) // pass_k for s in sampled_solved))
    greedy = shape is not None and shape.greedy
    level_of = [difficulty_of(problem) for problem in items]
    levels: dict[str, LevelStats] = {}
    for level in sorted(set(level_of), key=level_order):
        members = [i for i, name in enumerate(level_of) if name == level]
        rows = [row for row, problem in enumerate(pass1_problem) if level_of[problem] == level]
        levels[level] = LevelStats(
            problems=len(members),
            pass1=pass1_accuracy([pass1_solved[i] for i in members], shape is not None),
            greedy_pass1=(pass1_accuracy([greedy_solved[i] for i in members], False) if greedy
                          else None),
            episodes=episode_stats(pass1, rows) if environment else None,
            chain_steps=chain_step_counts([pass1.chain_steps[row] for row in rows]))
    return EvalResult(
        task=task.name, split=split, problems=len(items),
        pass1=pass1_accuracy(pass1_solved, shape is not None),
        pass_k=pass_k_accuracy, k=pass_k,
        mean_completion_tokens=sum(pass1.lengths) / len(pass1.lengths), samples=samples,
        episodes=episode_stats(pass1, list(range(len(pass1.solved)))) if environment else None,
        pass1_temperature=None if shape is None else shape.sampling.temperature,
        greedy_pass1=pass1_accuracy(greedy_solved, False) if greedy else None,
        levels=levels)
