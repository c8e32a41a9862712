"""Environments written for the `verifiers` library as decentrl environments (envs/verifiers_env.py):
their rows as problems with a held-out split, their env_response between turns, their rubric as
the reward, the coordinator's replay reproducing it and refusing a tampered transcript, and the
environments it could not replay refused when they are built."""

from __future__ import annotations

import logging
import string
from typing import Any

import msgspec
import pytest
from unit.envs import verifiers_fixtures as fixtures

from decentrl.config import RunConfig
from decentrl.coordinator.ingest import Ingestion, RejectedGroup
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.envs import make_environment, run_episode
from decentrl.envs.verifiers_checks import UnreplayableEnvironment
from decentrl.envs.verifiers_env import CUT_MARK, VerifiersEnvironment
from decentrl.model.tiny import tiny_tokenizer
from decentrl.rollout.demonstrations import demonstration_rollout
from decentrl.rollout.types import RolloutGroup, VersionSpan
from decentrl.tasks.base import Reward

FIXTURES = "verifiers:unit.envs.verifiers_fixtures"
TOKENIZER = tiny_tokenizer(string.digits + string.ascii_letters + string.punctuation + " \n")


def adapted(env: Any, **options: Any) -> VerifiersEnvironment:
    return VerifiersEnvironment("verifiers:test", env, **options)


@pytest.fixture(scope="module")
def sums() -> VerifiersEnvironment:
    return adapted(fixtures.load_sums())


@pytest.fixture(scope="module")
def guess() -> VerifiersEnvironment:
    return adapted(fixtures.load_guess())


def scripted(turns: list[str]) -> Any:
    remaining = iter(turns)
    return lambda messages: next(remaining)


def test_rows_are_problems_split_by_their_prompt(sums: VerifiersEnvironment) -> None:
    again = adapted(fixtures.load_sums())
    train = [sums.problem("train", i) for i in range(len(sums.rows["train"]))]
    heldout = [sums.problem("heldout", i) for i in range(len(sums.rows["heldout"]))]
    assert train == [again.problem("train", i) for i in range(len(train))]
    assert {p.key for p in train}.isdisjoint({p.key for p in heldout}) and heldout
    assert len(train) + len(heldout) == len(fixtures.SUM_PAIRS)
    # Every row once per pass, in a fixed shuffle; indices past the end wrap.
    assert sums.problem("train", len(train)).key == train[0].key
    assert train[0].question.startswith("What is ") and train[0].metadata["source"] == "dataset"
    episode = sums.episode("train", 0)
    assert [m["role"] for m in episode.messages()] == ["system", "user"]
    assert episode.messages()[0]["content"] == "Answer in <answer></answer>."


def test_an_eval_dataset_is_the_heldout_split() -> None:
    environment = adapted(fixtures.load_guess(with_eval=True))
    assert len(environment.rows["train"]) == len(fixtures.SECRETS)
    held = environment.problem("heldout", 0)
    assert held.answer == "10" and held.metadata["source"] == "eval_dataset"


def test_a_scripted_transcript_gets_the_rubrics_weighted_reward(sums: VerifiersEnvironment) -> None:
    problem = sums.problem("train", 3)
    right = run_episode(sums.episode("train", 3), scripted([f"<answer>{problem.answer}</answer>"]))
    wrong = run_episode(sums.episode("train", 3), scripted(["<answer>999</answer>"]))
    # correct_answer weighs 1.0 and the parser's format reward 0.2.
    assert right.reward == Reward(correct=pytest.approx(1.2), format=0.0) and right.reward.solved
    assert wrong.reward.correct == pytest.approx(0.2) and not wrong.reward.solved
    assert right.turns == 1 and right.stop_reason == "answer"


def test_env_responses_come_between_the_turns(guess: VerifiersEnvironment) -> None:
    episode = guess.episode("train", 0)
    secret = int(episode.problem.answer)
    result = run_episode(episode, scripted(["1", "20", "pass", str(secret)]))
    hints = [m["content"] for m in result.messages[2:] if m["role"] == "user"]
    assert hints == ["Higher." if secret > 1 else "Lower.", "Lower.", "Give a number."]
    # The final "Correct!" is the environment's state, not a message the model reads.
    assert result.messages[-1] == {"role": "assistant", "content": str(secret)}
    assert result.reward.solved and result.turns == 4 and result.stop_reason == "answer"


def test_turns_end_at_the_smaller_limit() -> None:
    environment = adapted(fixtures.load_guess(max_turns=3), max_turns=5)
    assert environment.max_turns == 3
    result = run_episode(environment.episode("train", 0), lambda messages: "0")
    assert result.turns == 3 and result.reward.total == 0.0
    capped = adapted(fixtures.load_guess(max_turns=6), max_turns=2)
    result = run_episode(capped.episode("train", 0), lambda messages: "0")
    assert result.turns == 2 and result.stop_reason == "turn_limit"


def test_the_coordinator_replays_the_reward_and_refuses_a_tampered_transcript(
        guess: VerifiersEnvironment) -> None:
    secret = guess.problem("train", 0).answer
    honest, other = (demonstration_rollout(guess.episode("train", 0), turns, TOKENIZER)
                     for turns in (["1", "20", secret], ["10", secret]))
    group = RolloutGroup(group_id="g", task=guess.name, problem_index=0, stage_versions=[0],
                         sampling_seed=0, rollouts=[honest, other],
                         version_spans=[VersionSpan(start=0, versions=[0])])
    ingestion = Ingestion(RunConfig(), guess, TOKENIZER, PromptScheduler(0))
    scored = ingestion.score(group)
    assert scored.rewards == [1.0, 1.0] and scored.correct == [1.0, 1.0]

    # The first hint's first token changed: not what the environment answers.
    forced_at = honest.generated_mask().index(False)
    forged = list(honest.completion_tokens)
    forged[forced_at] = (forged[forced_at] + 1) % len(TOKENIZER)
    tampered = msgspec.structs.replace(honest, completion_tokens=forged)
    with pytest.raises(RejectedGroup, match="not what the environment answers"):
        ingestion.score(msgspec.structs.replace(group, rollouts=[tampered, other]))


def test_a_non_deterministic_environment_is_refused() -> None:
    with pytest.raises(UnreplayableEnvironment, match="not deterministic given the transcript"):
        adapted(fixtures.load_sums(noisy=True))


@pytest.mark.parametrize("game, reason", [
    ("judged", "JudgeRubric asks a judge model"),
    ("tools", "ToolEnv calls tools through structured API tool calls"),
])
def test_judged_and_tool_environments_are_refused(game: str, reason: str) -> None:
    with pytest.raises(UnreplayableEnvironment, match=reason):
        make_environment(FIXTURES, env_args={"game": game})


def test_a_raising_reward_function_scores_zero_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    environment = adapted(fixtures.load_sums(reward_fails=True), probe_problems=0)
    problem = environment.problem("train", 0)
    with caplog.at_level(logging.WARNING, logger="decentrl.envs.verifiers_env"):
        result = run_episode(environment.episode("train", 0),
                             scripted([f"<answer>{problem.answer}</answer>"]))
    # No partial sum: the format reward that did not raise does not count either.
    assert result.reward == Reward(correct=0.0, format=0.0)
    assert "scores 0" in caplog.text and "the grader is down" in caplog.text


def test_a_slow_environment_call_is_cut_and_scores_zero(caplog: pytest.LogCaptureFixture) -> None:
    environment = adapted(fixtures.load_guess(sleep_s=30.0), call_timeout_s=0.2,
                          probe_problems=0)
    with caplog.at_level(logging.WARNING, logger="decentrl.envs.verifiers_env"):
        result = run_episode(environment.episode("train", 0), lambda messages: "0")
    assert result.turns == 1 and result.reward.total == 0.0
    assert "env_response took over 0.2 s" in caplog.text


def test_oversized_environment_messages_are_cut() -> None:
    environment = adapted(fixtures.load_guess(padding=5000), max_env_chars=100)
    episode = environment.episode("train", 0)
    step = episode.respond("0")
    [hint] = step.messages
    assert len(hint["content"]) == 100 + len(CUT_MARK) and hint["content"].endswith(CUT_MARK)
    # The environment's own history holds the message as the model saw it.
    step = episode.respond("0")
    assert episode.messages()[3] == hint and len(step.messages[0]["content"]) <= 100 + 6


def test_names_and_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"unknown verifiers environment 'no_such_env': name one "
                                         r"as verifiers:<module>"):
        make_environment("verifiers:no_such_env")
    with pytest.raises(ValueError, match="has no option 'turns'; its options: env_args"):
        make_environment(FIXTURES, turns=3)
    with pytest.raises(ValueError, match="max_turns must be in"):
        adapted(fixtures.load_guess(), max_turns=0)


def test_a_worker_plays_it_and_the_coordinator_scores_it(tiny_model_dir: Any) -> None:
    """Through the rollout loop: a worker samples episodes of the guessing game from the tiny
    model, the environment's hints forced in, and ingestion accepts the group with the rewards
    it recomputes by replaying each episode."""
    from swarm_helpers import local_chain, tiny_run_config

    from decentrl.coordinator.worker import RolloutWorker
    from decentrl.envs import make_task_or_environment
    from decentrl.model.loading import load_model

    config = tiny_run_config(tiny_model_dir, 2, task={"name": FIXTURES, "options": {
        "env_args": {"game": "guess"}, "probe_problems": 0}}, rollout={
        "group_size": 8, "max_new_tokens": 64, "temperature": 1.0})
    model = load_model(str(tiny_model_dir))
    environment = make_task_or_environment(config.task.name, config.task.options)
    scheduler = PromptScheduler(config.seed)
    worker = RolloutWorker(local_chain(model, 2), None, environment, model.tokenizer,
                           config.rollout, scheduler, config.seed)
    [group] = worker.generate_groups(scheduler.next(1))
    assert group.task == FIXTURES
    assert any(not all(r.generated_mask()) for r in group.rollouts)  # hints were forced in
    accepted = Ingestion(config, environment, model.tokenizer, scheduler).ingest(group, 0)
    assert accepted is not None
    assert accepted[0].rewards == [0.0] * 8  # the nearly uniform model never guesses right
