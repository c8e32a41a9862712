"""Held-out evaluation over an inference chain: greedy pass@1 and sampled pass@k, each with a 95%
confidence interval (Wilson for pass@1; normal approximation over problems for pass@k)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from decentrl.evaluate.stats import Accuracy, pass_at_k
from decentrl.rollout.chain import InferenceChain
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.tasks import Problem, Task, problems, render_prompt


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _solved(chain: InferenceChain, task: Task, batch_problems: list[Problem], tokenizer: Any,
            max_new_tokens: int, sampling: SamplingConfig, seed: int | None
            ) -> tuple[list[bool], list[str], list[int]]:
    prompts = [render_prompt(task, p, tokenizer) for p in batch_problems]
    generations = generate(chain, prompts, max_new_tokens, sampling, {tokenizer.eos_token_id},
                           tokenizer.pad_token_id, seed)
    texts = [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in generations]
    solved = [task.reward(p, text).solved for p, text in zip(batch_problems, texts)]
    return solved, texts, [len(g.tokens) for g in generations]


def evaluate(chain: InferenceChain, task: Task, tokenizer: Any, num_problems: int,
             max_new_tokens: int, batch_size: int, pass_k: int = 1, seed: int = 0,
             split: str = "heldout", progress: Callable[[int, int], None] | None = None,
             concurrency: int = 1) -> EvalResult:
    """`progress`, if given, is called with (generations done, generations in all): one greedy
    generation per problem, and `pass_k` sampled ones when pass_k > 1.
    `concurrency` > 1 runs that many batches at once (over a swarm, so hop latency is hidden and
    every replica works); the result does not depend on it."""
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

    def run(job: tuple[int, list[Problem], SamplingConfig, int | None]
            ) -> tuple[list[bool], list[str], list[int]]:
        nonlocal done
        start, chunk, sampling, job_seed = job
        out = _solved(chain, task, chunk, tokenizer, max_new_tokens, sampling, job_seed)
        if progress is not None:
            with lock:
                done += len(chunk)
                progress(done, total)
        return out

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(run, jobs))
    greedy_solved: list[bool] = []
    lengths: list[int] = []
    samples: list[dict[str, Any]] = []
    sampled_correct = [0] * len(items)
    for (start, chunk, sampling, _), (solved, texts, n_tokens) in zip(jobs, results):
        if sampling.greedy:
            greedy_solved += solved
            lengths += n_tokens
            if len(samples) < 8:
                samples += [{"question": p.question, "completion": t, "correct": s}
                            for p, t, s in zip(chunk, texts, solved)][: 8 - len(samples)]
        else:
            for j, ok in enumerate(solved):
                sampled_correct[start + j // pass_k] += int(ok)
    pass_k_accuracy = None
    if pass_k > 1:
        pass_k_accuracy = Accuracy.from_values(
            [pass_at_k(pass_k, c, pass_k) for c in sampled_correct])
    return EvalResult(
        task=task.name, split=split, problems=len(items),
        pass1=Accuracy.from_counts(sum(greedy_solved), len(greedy_solved)),
        pass_k=pass_k_accuracy, k=pass_k,
        mean_completion_tokens=sum(lengths) / len(lengths), samples=samples,
    )
