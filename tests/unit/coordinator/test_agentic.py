"""Episodes as rollouts, from the worker to the learner: a worker generates groups of episodes
(assistant turns sampled, the environment's replies forced in), the coordinator's ingestion scores
them by replaying each episode against a fresh one and refuses any whose environment tokens are
not the environment's, and the single-machine loop trains on them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from swarm_helpers import local_chain, tiny_run_config, two_episode_steps

from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.ingest import Ingestion, RejectedGroup
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.demo import demo_config
from decentrl.envs import Environment, make_task_or_environment
from decentrl.model.loading import LoadedModel, load_model
from decentrl.rollout.episodes import generate_episodes
from decentrl.rollout.types import RolloutGroup
from decentrl.tasks import make_task

CALCULATOR = {"name": "agentic-calculator",
              "options": {"stories": ["purchase"], "prefill_first_call": True, "max_turns": 3}}


GROUP, BUDGET = 8, 64


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LoadedModel:
    """The nearly uniform tiny model: it samples the end-of-turn token now and then (the sharp
    one never does), so its episodes have turns that end and environment replies."""
    return load_model(str(tiny_model_dir))


def agentic_config(model_dir: Path) -> RunConfig:
    return tiny_run_config(model_dir, 2, task=CALCULATOR, rollout={
        "group_size": GROUP, "prompts_per_step": 2, "max_new_tokens": BUDGET,
        "temperature": 1.0})


def worker_and_ingestion(config: RunConfig, model: LoadedModel
                         ) -> tuple[RolloutWorker, Ingestion, PromptScheduler]:
    environment = make_task_or_environment(config.task.name, config.task.options)
    assert isinstance(environment, Environment)
    scheduler = PromptScheduler(config.seed)
    worker = RolloutWorker(local_chain(model, 2), None, environment, model.tokenizer,
                           config.rollout, scheduler, config.seed)
    return worker, Ingestion(config, environment, model.tokenizer, scheduler), scheduler


def with_rollout(group: RolloutGroup, row: int, **changes: object) -> RolloutGroup:
    rollouts = list(group.rollouts)
    rollouts[row] = msgspec.structs.replace(rollouts[row], **changes)
    return msgspec.structs.replace(group, rollouts=rollouts)


def test_episode_groups_are_scored_by_replaying_them(plain: LoadedModel,
                                                     tiny_model_dir: Path) -> None:
    config = agentic_config(tiny_model_dir)
    worker, ingestion, scheduler = worker_and_ingestion(config, plain)
    [index] = scheduler.next(1)
    [group] = worker.generate_groups([index])
    # A random model never closes the prefilled call: a turn it ends is answered with an error
    # observation, forced in, and costs the invalid-call penalty.
    masks = [r.generated_mask() for r in group.rollouts]
    answered = [row for row, mask in enumerate(masks) if not all(mask)]
    assert len(answered) >= 2
    # The same episodes played again from the same seed give the rewards ingestion computes.
    environment = worker.task
    assert isinstance(environment, Environment)
    played = generate_episodes(local_chain(plain, 2),
                               [environment.episode("train", index) for _ in range(GROUP)],
                               plain.tokenizer, BUDGET, worker.sampling,
                               config.seed * 2**32 + index)
    assert [p.generation.tokens for p in played] == [r.completion_tokens for r in group.rollouts]
    assert [p.generation.generated for p in played] == masks
    expected = [(p.reward.total if p.reward is not None else 0.0)
                - 0.1 * p.episode.invalid_calls for p in played]  # the default penalty
    assert [row for row, p in enumerate(played) if p.episode.invalid_calls] == answered

    # A forced token changed, a sampled token passed off as the environment's, an environment
    # token passed off as sampled, a prompt that is not the episode's: each refused, and the
    # problem stays open to the genuine group.
    row = answered[0]
    forced_at = masks[row].index(False)
    tampered = [
        with_rollout(group, row, completion_tokens=[
            t if i != forced_at else (t + 1) % len(plain.tokenizer)
            for i, t in enumerate(group.rollouts[row].completion_tokens)]),
        with_rollout(group, row, generated=[i != 0 and g for i, g in enumerate(masks[row])]),
        with_rollout(group, row, generated=[True] * len(masks[row])),
        with_rollout(group, row, prompt_tokens=group.rollouts[row].prompt_tokens[1:]),
    ]
    for bad, message in zip(tampered, ["not what the environment answers", "marked as the "
                                       "environment's", "not what the environment answers",
                                       "prompt is not the episode's"]):
        with pytest.raises(RejectedGroup, match=message):
            ingestion.score(bad)
        assert ingestion.ingest(bad, learner_version=0) is None
    assert ingestion.stats.rejected == len(tampered) and ingestion.stats.accepted == 0
    accepted = ingestion.ingest(group, learner_version=0)
    assert accepted is not None
    scored, staleness = accepted
    assert scored.rewards == pytest.approx(expected) and staleness == 0
    assert scored.correct == [0.0] * GROUP
    # Environment tokens go into the batch as context without a loss.
    batch, _, _ = ingestion.make_batch([accepted])
    assert batch is not None
    for row, mask in enumerate(masks):
        length = len(mask)
        assert batch.completion_generated[row, :length].tolist() == mask


def test_a_single_turn_group_may_not_carry_environment_tokens(plain: LoadedModel,
                                                              tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, rollout={"group_size": 2, "max_new_tokens": 4})
    scheduler = PromptScheduler(config.seed)
    task = make_task(config.task.name, **config.task.options)
    worker = RolloutWorker(local_chain(plain, 2), None, task, plain.tokenizer, config.rollout,
                           scheduler, config.seed)
    [group] = worker.generate_groups(scheduler.next(1))
    ingestion = Ingestion(config, task, plain.tokenizer, scheduler)
    length = len(group.rollouts[0].completion_tokens)
    bad = with_rollout(group, 0, generated=[True] * (length - 1) + [False])
    with pytest.raises(RejectedGroup, match="single-turn rollout has no environment tokens"):
        ingestion.check(bad, learner_version=0)
    assert ingestion.ingest(group, learner_version=0) is not None


def test_ingestion_refuses_a_mask_of_the_wrong_length(plain: LoadedModel,
                                                      tiny_model_dir: Path) -> None:
    """The mask is checked once, where a peer's rollout comes in; replay and batching rely on it."""
    config = agentic_config(tiny_model_dir)
    worker, ingestion, scheduler = worker_and_ingestion(config, plain)
    [group] = worker.generate_groups(scheduler.next(1))
    mask = group.rollouts[0].generated_mask()
    short = with_rollout(group, 0, generated=mask[:-1])
    with pytest.raises(RejectedGroup, match=f"the generated mask has {len(mask) - 1} entries "
                                            f"for {len(mask)} completion tokens"):
        ingestion.check(short, 0)


def test_the_local_loop_trains_on_episodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    steps, after = two_episode_steps(tiny_model_dir, tmp_path, CALCULATOR, eval_problems=3)
    # Every episode costs at least one invalid call (the prefilled call is never closed), so the
    # mean reward is negative: the returns carry the environment's turn signals.
    assert all(r["reward"] < 0 for r in steps)
    # Evaluated as episodes, a group of 4 sampled ones per problem as in training; the nearly
    # uniform model never solves one, and the 60-token budget cuts every one short.
    assert after["task"] == "agentic-calculator" and after["problems"] == 3
    assert after["pass1_temperature"] == 1.0 and after["pass1"]["mean"] == 0.0
    assert after["episodes"]["played"] == 12 and after["episodes"]["cut_by_budget"] == 12


def test_a_task_trains_as_one_turn_episodes_through_its_adapter(plain: LoadedModel,
                                                                tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, task={"name": "task:sums",
                                                      "options": {"max_digits": 1}},
                             rollout={"group_size": GROUP, "max_new_tokens": BUDGET,
                                      "temperature": 1.0})
    environment = make_task_or_environment(config.task.name, config.task.options)
    assert isinstance(environment, Environment)
    scheduler = PromptScheduler(config.seed)
    worker = RolloutWorker(local_chain(plain, 2), None, environment, plain.tokenizer,
                           config.rollout, scheduler, config.seed)
    [group] = worker.generate_groups(scheduler.next(1))
    assert group.task == "task:sums"
    assert all(r.generated is None for r in group.rollouts)  # one turn: nothing forced
    accepted = Ingestion(config, environment, plain.tokenizer, scheduler).ingest(group, 0)
    assert accepted is not None
    # The episode's reward is the task's own for a finished reply, and 0 for one the budget cut.
    task = make_task("sums", max_digits=1)
    problem = task.problem("train", group.problem_index)
    expected = [task.reward(problem, plain.tokenizer.decode(
        r.completion_tokens, skip_special_tokens=True)).total if r.finished else 0.0
        for r in group.rollouts]
    assert accepted[0].rewards == pytest.approx(expected)
    assert any(r.finished for r in group.rollouts) and not all(r.finished for r in group.rollouts)


def test_the_agentic_demo_config_trains_and_evaluates_the_environment() -> None:
    config = parse_config(demo_config("agentic-calculator"))
    assert config.task.name == config.eval.task.name == "agentic-calculator"
    assert config.task.options["prefill_first_call"] and config.task.options["worked_example"]
    # The rest is the sums demo's swarm: the same stages, replicas and emulated links.
    sums = parse_config(demo_config("sums"))
    assert (config.num_stages, config.swarm) == (sums.num_stages, sums.swarm)
    assert sums.task.name == "sums" and sums.supervised.steps == 0
    # Every level of the calculator, learned first from demonstrations; countdown likewise.
    assert len(config.task.options["stories"]) == 7 and config.supervised.steps > 0
    assert config.supervised.interleave_rows > 0 and config.curriculum.enabled
    countdown = parse_config(demo_config("agentic-countdown"))
    assert countdown.task.name == countdown.eval.task.name == "agentic-countdown"
    assert countdown.supervised == config.supervised
    # Countdown searches: demonstrations that revise up to three times, room for them in the
    # budget (test_demonstrations.py, in SmolLM2's tokens), no level starved by the curriculum.
    assert countdown.task.options == countdown.eval.task.options
    assert len(countdown.task.options["revisions"]) == 4 and countdown.rollout.max_new_tokens == \
        countdown.eval.max_new_tokens == 512
    assert countdown.curriculum.min_level_share == 0.25 and config.curriculum.min_level_share == 0
    with pytest.raises(ValueError, match="the demo runs one of sums, agentic-calculator"):
        demo_config("task:sums")
