"""Supervised rows (demonstrations) through the training chain: the loss is the negative
log-likelihood of the assistant's tokens only, it leaves the policy loss of the rollouts beside it
unchanged, its gradient is the same however the work is cut into micro-batches and stages, it
raises the demonstrated tokens' likelihood, and the warm-up learning rate applies to the warm-up's
versions only. A run warms up on demonstrations, resumes its warm-up, evaluates after it and
interleaves demonstrations into RL steps. (A training peer's refusals of supervised rows are in
tests/swarm/test_swarm.py's BAD_REQUESTS.)"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from helpers import ADVANTAGES, MAX_NEW, SAMPLING, build, max_difference, weights
from swarm_helpers import tiny_run_config

from decentrl.config import RunConfig, SupervisedConfig, TrainConfig
from decentrl.coordinator.local_backend import local_run
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.envs import make_environment
from decentrl.envs.calculator import ALL_STORIES
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel, load_tokenizer
from decentrl.observe.metrics import read_metrics
from decentrl.observe.report import build_report
from decentrl.rollout.demonstrations import (
    DEMONSTRATION_INDICES,
    DemonstrationTooLong,
    demonstration_rollout,
    demonstrations,
)
from decentrl.rollout.types import Rollout


def trainer_for(model: LoadedModel, num_stages: int = 2, supervised: SupervisedConfig | None = None,
                **train: object) -> PipelineTrainer:
    config = TrainConfig(**{"lr": 1e-4, **train})
    return PipelineTrainer.local(build(model, num_stages), config,
                                 loss_config_from(config, MAX_NEW, supervised=supervised),
                                 SAMPLING, torch.float32, supervised=supervised)


def demonstration(rollout: Rollout) -> Rollout:
    """A rollout as a demonstration: its last two completion tokens are the environment's."""
    n = len(rollout.completion_tokens)
    return Rollout(prompt_tokens=rollout.prompt_tokens, completion_tokens=rollout.completion_tokens,
                   behaviour_logprobs=[0.0] * n, finished=True,
                   generated=[True] * (n - 2) + [False] * 2)


def mean_nll(trainer: PipelineTrainer, batch: TrainBatch) -> float:
    """The supervised rows' mean negative log-likelihood per assistant token, computed here."""
    logprobs = trainer._chain_logprobs([t.stage for t in trainer.stage_trainers], batch)
    mask = batch.completion_generated & batch.supervised[:, None]
    return float(-(logprobs * mask).sum() / mask.sum())


def test_a_supervised_batch_is_the_likelihood_of_the_assistant_tokens(
        tiny_model: LoadedModel, rollouts: list[Rollout]) -> None:
    demos = [demonstration(r) for r in rollouts[:4]]
    batch = build_batch([], [], [], tiny_model.tokenizer.pad_token_id, demos)
    assert batch.supervised.all() and batch.num_target_tokens == 0
    assert batch.num_supervised_tokens == sum(len(d.completion_tokens) - 2 for d in demos)
    trainer = trainer_for(tiny_model, micro_batch_size=3)
    expected = mean_nll(trainer, batch)
    metrics = trainer.train_step(batch)
    # The loss the trainer reports per micro-batch is that micro-batch's mean; with one
    # micro-batch holding every row it would be the batch's. Recompute with one micro-batch.
    whole = trainer_for(tiny_model, micro_batch_size=len(demos))
    assert whole.train_step(batch)["sft_nll"] == pytest.approx(expected, rel=1e-5)
    assert "policy_loss" not in metrics and 0.0 <= metrics["sft_token_accuracy"] <= 1.0
    # Environment tokens carry no loss: changing them changes nothing in the gradient's target.
    assert trainer.version == 1


def test_supervised_rows_leave_the_policy_loss_unchanged(tiny_model: LoadedModel,
                                                         rollouts: list[Rollout]) -> None:
    pad = tiny_model.tokenizer.pad_token_id
    plain = build_batch(rollouts, ADVANTAGES, [0] * len(rollouts), pad)
    mixed = build_batch(rollouts, ADVANTAGES, [0] * len(rollouts), pad,
                        [demonstration(r) for r in rollouts[:3]])
    assert mixed.num_policy_sequences == plain.num_sequences
    assert mixed.num_target_tokens == plain.num_target_tokens
    plain_metrics = trainer_for(tiny_model, micro_batch_size=len(rollouts)).train_step(plain)
    # supervised coef 0: the demonstrations add nothing to the gradient either.
    silent = SupervisedConfig(coef=0.0)
    trainer = trainer_for(tiny_model, micro_batch_size=len(rollouts), supervised=silent)
    reference = trainer_for(tiny_model, micro_batch_size=len(rollouts))
    reference.train_step(plain)
    mixed_metrics = trainer.train_step(mixed)
    assert mixed_metrics["policy_loss"] == pytest.approx(plain_metrics["policy_loss"], abs=1e-6)
    assert max_difference(weights(trainer), weights(reference)) < 1e-6
    assert mixed_metrics["sft_nll"] > 0


def test_the_supervised_gradient_is_the_same_however_the_work_is_cut(
        tiny_model: LoadedModel, rollouts: list[Rollout]) -> None:
    batch = build_batch(rollouts[:5], ADVANTAGES[:5], [0] * 5, tiny_model.tokenizer.pad_token_id,
                        [demonstration(r) for r in rollouts[3:]])
    results = []
    for stages, micro in ((1, batch.num_sequences), (2, 1), (3, 4)):
        trainer = trainer_for(tiny_model, stages, micro_batch_size=micro)
        norm = trainer.train_step(batch)["grad_norm"]
        results.append((weights(trainer), norm))
    (one, one_norm) = results[0]
    for many, norm in results[1:]:
        assert max_difference(many, one) < 1e-6
        assert norm == pytest.approx(one_norm, rel=1e-5)


def test_warm_up_steps_raise_the_demonstrations_likelihood(tiny_model: LoadedModel,
                                                           rollouts: list[Rollout]) -> None:
    batch = build_batch([], [], [], tiny_model.tokenizer.pad_token_id,
                        [demonstration(r) for r in rollouts])
    trainer = trainer_for(tiny_model, lr=1e-2)
    before = mean_nll(trainer, batch)
    for _ in range(5):
        trainer.train_step(batch)
    # Near-uniform start (~4.4 nats per token) on random tokens; five Adam steps of 1e-2 took
    # off 0.45 nats per token when measured, thousands of times any numerical noise.
    assert mean_nll(trainer, batch) < before - 0.3


def test_the_warm_up_learning_rate_applies_to_its_versions_only(tiny_model: LoadedModel,
                                                                rollouts: list[Rollout]) -> None:
    batch = build_batch([], [], [], tiny_model.tokenizer.pad_token_id,
                        [demonstration(r) for r in rollouts[:2]])
    trainer = trainer_for(tiny_model, supervised=SupervisedConfig(steps=2, lr=5e-4),
                          lr=1e-5)
    rates = []
    for _ in range(3):
        trainer.train_step(batch)
        rates.append(trainer.stage_trainers[0].optimizer.param_groups[0]["lr"])
    assert rates == [5e-4, 5e-4, 1e-5]


def test_a_warm_up_batch_takes_one_update_whatever_the_policy_batches_take(
        tiny_model: LoadedModel, rollouts: list[Rollout]) -> None:
    """The warm-up's versions are its steps (its learning rate and the keyframe after it count
    them): minibatches and passes are the policy loss's."""
    demos = build_batch([], [], [], tiny_model.tokenizer.pad_token_id,
                        [demonstration(r) for r in rollouts[:4]])
    sampled = build_batch(rollouts[:4], ADVANTAGES[:4], [0] * 4,
                          tiny_model.tokenizer.pad_token_id)
    trainer = trainer_for(tiny_model, supervised=SupervisedConfig(steps=1, lr=5e-4), lr=1e-5,
                          minibatches_per_batch=2, epochs_per_batch=2, micro_batch_size=2)
    trainer.train_step(demos)
    assert trainer.version == 1
    assert trainer.stage_trainers[0].optimizer.param_groups[0]["lr"] == 5e-4
    trainer.train_step(sampled)
    assert trainer.version == 5
    assert trainer.stage_trainers[0].optimizer.param_groups[0]["lr"] == 1e-5


# ------------------------------------------------------------------- the warm-up in the run's loop

MULTI_STEP = {"name": "agentic-calculator", "options": {"stories": ["shopping", "ages"]}}


def warm_up_config(model_dir: Path, run_dir: Path, **train: object) -> RunConfig:
    # Room for the demonstrations in characters (up to ~590 tokens): a longer one is refused.
    return tiny_run_config(
        model_dir, 2, host={"run_dir": str(run_dir), "threads": 1}, task=MULTI_STEP,
        rollout={"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 640},
        supervised={"steps": 2, "rows_per_step": 2, "interleave_rows": 1},
        train={"steps": 3, "micro_batch_size": 4, "zero_variance_groups": "keep",
               "mode": "sync", **train},
        eval={"task": MULTI_STEP, "problems": 2, "max_new_tokens": 16, "pass_k": 1})


def test_a_run_warms_up_on_demonstrations_then_interleaves_them(tiny_printable_dir: Path,
                                                                 tmp_path: Path) -> None:
    # A budget spent before the first step: no warm-up step, no evaluation after it.
    stopped = local_run(warm_up_config(tiny_printable_dir, tmp_path, time_budget_s=1e-6)).run()
    assert stopped.steps == 0 and not (stopped.path / "eval_warmup.json").exists()
    # Resumed with time to spare: the warm-up, its evaluation, then RL with a demonstration.
    summary = local_run(warm_up_config(tiny_printable_dir, tmp_path, time_budget_s=600)).run()
    assert summary.steps == 3
    records = read_metrics(summary.path / "metrics.jsonl")
    assert [(r.step, r.version, r.rows) for r in records.supervised] == [(1, 1, 2), (2, 2, 2)]
    assert all(r.tokens > 0 and r.sft_nll > 0 for r in records.supervised)
    [rl] = records.steps
    assert (rl.step, rl.version, rl.supervised_rows) == (3, 3, 1) and rl.sft_nll is not None
    assert [e.label for e in records.evals] == ["before", "after warm-up", "after"]
    warmed = json.loads((summary.path / "eval_warmup.json").read_text())
    assert warmed["task"] == "agentic-calculator"
    assert summary.warmup is not None and summary.warmup.problems == 2
    report = build_report(summary.path).read_text()
    assert "2 supervised warm-up steps, then 1 steps" in report
    assert "## Supervised warm-up" in report and "Before -> after the warm-up." in report


WARM_UP_EVALUATION_S = 6.0


class SlowWarmUpEvaluation(RunHooks):
    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        if label == "after warm-up":
            time.sleep(WARM_UP_EVALUATION_S)


def test_the_evaluation_after_the_warm_up_is_not_counted_in_the_budget(
        tiny_printable_dir: Path, tmp_path: Path) -> None:
    # The warm-up's two tiny steps take well under the 5 s budget; its evaluation takes longer
    # than the whole budget, and RL still gets its step.
    config = warm_up_config(tiny_printable_dir, tmp_path, time_budget_s=5.0)
    summary = local_run(config, hooks=[SlowWarmUpEvaluation()]).run()
    assert summary.steps == 3 and summary.warmup is not None
    assert [r.step for r in read_metrics(summary.path / "metrics.jsonl").steps] == [3]


def test_warm_up_needs_an_environment_that_demonstrates(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, host={"run_dir": str(tmp_path)},
                             supervised={"steps": 1}, train={"steps": 2})
    with pytest.raises(ValueError, match="task 'sums' cannot write"):
        local_run(config)


def test_warm_up_must_leave_rl_steps(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"supervised.steps \(5\) must be fewer than "
                                         r"train.steps \(5\)"):
        tiny_run_config(tiny_model_dir, 2, supervised={"steps": 5}, train={"steps": 5})


def test_demonstrations_are_train_problems_fixed_by_seed_and_step(tiny_printable_dir: Path
                                                                   ) -> None:
    environment = make_environment("agentic-calculator", stories=list(ALL_STORIES),
                                   heldout_fraction=0.5)
    tokenizer = load_tokenizer(tiny_printable_dir)
    splits: list[str] = []
    problem, episode = environment.problem, environment.episode
    environment.problem = lambda split, index: splits.append(split) or problem(split, index)
    environment.episode = lambda split, index: splits.append(split) or episode(split, index)
    rows = demonstrations(environment, tokenizer, seed=0, step=1, count=12, max_new_tokens=4096)
    assert len(rows) == 12 and set(splits) == {"train"}
    assert demonstrations(environment, tokenizer, seed=0, step=1, count=12,
                          max_new_tokens=4096) == rows
    assert demonstrations(environment, tokenizer, seed=0, step=2, count=12,
                          max_new_tokens=4096) != rows
    for row in rows:
        # The environment's tokens (its replies) are context; the assistant's the loss.
        assert any(row.generated) and not all(row.generated)
        assert row.completion_tokens[-1] == tokenizer.eos_token_id and row.generated[-1]


def test_a_demonstration_longer_than_the_budget_is_replaced(tiny_printable_dir: Path) -> None:
    # Half the demonstrations check a wrong candidate first: about 250 characters longer.
    environment = make_environment("agentic-countdown", revisions=[1, 1])
    tokenizer = load_tokenizer(tiny_printable_dir)
    drawn = demonstrations(environment, tokenizer, seed=0, step=1, count=8, max_new_tokens=4096)
    lengths = [len(row.completion_tokens) for row in drawn]
    budget = (min(lengths) + max(lengths)) // 2
    fitting = [row for row in drawn if len(row.completion_tokens) <= budget]
    assert 0 < len(fitting) < 8
    rows = demonstrations(environment, tokenizer, seed=0, step=1, count=8, max_new_tokens=budget)
    assert len(rows) == 8 and all(len(row.completion_tokens) <= budget for row in rows)
    # The problems and wordings drawn are the same; the longer ones are left out and more drawn.
    assert rows[:len(fitting)] == fitting
    assert demonstrations(environment, tokenizer, seed=0, step=1, count=8,
                          max_new_tokens=budget) == rows
    longest = max(range(8), key=lambda i: lengths[i])
    rng = random.Random("demonstrations:0:1")
    for _ in range(longest + 1):
        index = rng.randrange(DEMONSTRATION_INDICES)
        turns = environment.demonstration(environment.problem("train", index), rng)
    with pytest.raises(DemonstrationTooLong, match=f"takes {lengths[longest]} tokens, the "
                                                   f"budget is {lengths[longest] - 1}"):
        demonstration_rollout(environment.episode("train", index), turns, tokenizer,
                              max_new_tokens=lengths[longest] - 1)
    assert demonstration_rollout(environment.episode("train", index), turns, tokenizer,
                                 max_new_tokens=lengths[longest]) == drawn[longest]
    # A budget no demonstration fits is an error, not an endless draw.
    with pytest.raises(ValueError, match=r"16 of 16 demonstrations of agentic-countdown are "
                                         r"longer than rollout.max_new_tokens \(50\)"):
        demonstrations(environment, tokenizer, seed=0, step=1, count=2, max_new_tokens=50)


def test_a_run_refuses_demonstrations_its_budget_cannot_hold(tiny_printable_dir: Path,
                                                             tmp_path: Path) -> None:
    config = warm_up_config(tiny_printable_dir, tmp_path)
    short = config.model_copy(update={"rollout": config.rollout.model_copy(
        update={"max_new_tokens": 16})})
    with pytest.raises(ValueError, match=r"longer than rollout.max_new_tokens \(16\)"):
        local_run(short).run()


def test_a_demonstration_that_does_not_solve_its_problem_is_refused(tiny_printable_dir: Path
                                                                    ) -> None:
    environment = make_environment("agentic-calculator", stories=["purchase"])
    tokenizer = load_tokenizer(tiny_printable_dir)
    problem = environment.problem("train", 0)
    turns = environment.demonstration(problem, random.Random(0))
    wrong = [*turns[:-1], "It is <answer>1</answer>"]
    with pytest.raises(ValueError, match="does not solve problem 0"):
        demonstration_rollout(environment.episode("train", 0), wrong, tokenizer)
    # A call turn that runs on past its closing tag would be cut there by generation.
    with pytest.raises(ValueError, match="turn 1 would not end where its text ends"):
        demonstration_rollout(environment.episode("train", 0),
                              [turns[0] + " and more", *turns[1:]], tokenizer)
    with pytest.raises(ValueError, match="not over after the demonstration's 1 turns"):
        demonstration_rollout(environment.episode("train", 0), turns[:1], tokenizer)
