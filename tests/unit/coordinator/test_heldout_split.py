"""Held-out problems never reach training, checked on what a real run did rather than on how the
scheduler numbers problems: a tiny local run (curriculum on, with replays) records every prompt its
rollout worker rendered and the problem it rendered it from, every prompt that reached a training
batch, and every problem its held-out evaluations asked. Its training and evaluation share one
task of one-digit sums (about a hundred problems), so a leak would be likely if anything let one
through."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import tiny_run_config

from decentrl.coordinator import ingest, worker
from decentrl.coordinator.local_backend import local_run
from decentrl.evaluate import runner
from decentrl.learn.batch import build_batch
from decentrl.rollout.types import Rollout
from decentrl.tasks import Problem, Task, make_task, render_prompt, split_of

ONE_DIGIT_SUMS = {"name": "sums", "options": {"max_digits": 1}}


def test_every_trained_prompt_is_a_train_problem_and_the_evaluation_asks_held_out_ones(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # prompt -> the keys of the problems the worker rendered it from
    generated: defaultdict[tuple[int, ...], set[str]] = defaultdict(set)
    evaluated: dict[str, tuple[int, ...]] = {}  # problem key -> its prompt
    trained: set[tuple[int, ...]] = set()

    def worker_render(task: Task, problem: Problem, tokenizer: Any) -> list[int]:
        prompt = render_prompt(task, problem, tokenizer)
        generated[tuple(prompt)].add(problem.key)
        return prompt

    def evaluation_render(task: Task, problem: Problem, tokenizer: Any) -> list[int]:
        prompt = render_prompt(task, problem, tokenizer)
        evaluated[problem.key] = tuple(prompt)
        return prompt

    def recorded_batch(rollouts: list[Rollout], *args: Any, **kwargs: Any) -> Any:
        trained.update(tuple(rollout.prompt_tokens) for rollout in rollouts)
        return build_batch(rollouts, *args, **kwargs)

    monkeypatch.setattr(worker, "render_prompt", worker_render)
    monkeypatch.setattr(runner, "render_prompt", evaluation_render)
    monkeypatch.setattr(ingest, "build_batch", recorded_batch)
    config = tiny_run_config(
        tiny_model_dir, 2, name="split", host={"run_dir": str(tmp_path), "threads": 1}, task=ONE_DIGIT_SUMS,
        curriculum={"enabled": True, "replay_share": 0.5},
        rollout={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
        train={"mode": "sync", "steps": 4, "micro_batch_size": 4,
               "zero_variance_groups": "keep"},
        eval={"task": ONE_DIGIT_SUMS, "problems": 8, "pass_k": 2, "max_new_tokens": 4})
    assert local_run(config).run().steps == 4

    fraction = make_task(config.task.name, **config.task.options).heldout_fraction
    # (One-digit sums have few held-out problems: the evaluation's 8 draws repeat some.)
    assert len(trained) >= 4 and len(evaluated) >= 2
    for prompt in trained:  # what reached training: prompts of train problems only
        assert generated[prompt], "a trained prompt that no rollout was generated for"
        assert all(split_of(key, fraction) == "train" for key in generated[prompt])
    # The evaluations (before and after) asked held-out problems only, and none was trained on.
    assert all(split_of(key, fraction) == "heldout" for key in evaluated)
    assert not trained & set(evaluated.values())
    assert not set(evaluated) & set().union(*generated.values())
