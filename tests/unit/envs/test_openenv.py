"""The OpenEnv adapter (envs/openenv_env.py) on environments written in OpenEnv's own style
(openenv_fixtures.py): problems and their split, scripted episodes and their rewards, the
coordinator's replay of one from its tokens, and what the adapter refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from swarm_helpers import two_episode_steps

from decentrl.envs import Message, make_environment, make_task_or_environment, run_episode
from decentrl.envs.openenv_env import OpenEnvEnvironment, OpenEnvEpisode
from decentrl.model.loading import load_tokenizer
from decentrl.rollout.demonstrations import demonstration_rollout
from decentrl.rollout.episodes import replay_episode
from decentrl.tasks.base import Reward, split_of

FIXTURES = "tests.unit.envs.openenv_fixtures"
GUESS = f"openenv:{FIXTURES}:GuessNumberEnvironment"
REVERSE = f"openenv:{FIXTURES}:ReverseEnvironment"


def guess_environment(**options: Any) -> OpenEnvEnvironment:
    environment = make_environment(GUESS, **options)
    assert isinstance(environment, OpenEnvEnvironment)
    return environment


def bisecting_turns(episode: OpenEnvEpisode, low: int = 1, high: int = 20) -> list[str]:
    """Play the guessing game by bisection as JSON actions; the turns it wrote."""
    turns: list[str] = []

    def policy(messages: list[Message]) -> str:
        nonlocal low, high
        if turns:  # narrow the range by the environment's answer to the last guess
            guess = json.loads(turns[-1])["guess"]
            low, high = (guess + 1, high) if "higher" in messages[-1]["content"] else (low,
                                                                                       guess - 1)
        turns.append(json.dumps({"guess": (low + high) // 2}))
        return turns[-1]

    run_episode(episode, policy)
    return turns


def test_problems_are_seeds_drawn_in_their_split_by_hash() -> None:
    environment, again = guess_environment(), guess_environment()
    train = [environment.problem("train", index) for index in range(40)]
    heldout = [environment.problem("heldout", index) for index in range(12)]
    assert train == [again.problem("train", index) for index in range(40)]
    assert all(split_of(p.key, 0.1) == "train" for p in train)
    assert all(split_of(p.key, 0.1) == "heldout" for p in heldout)
    assert not {p.key for p in train} & {p.key for p in heldout}
    assert all(p.key == f"seed:{p.metadata['seed']}" for p in train)
    # The question is the first observation, by default its own fields as JSON, and the
    # episode starts with it.
    assert train[0].question == ('{"attempts_left": 5, "feedback": "Guess my number between 1 '
                                 'and 20."}')
    episode = environment.episode("train", 0)
    assert episode.problem == train[0]
    assert [m["role"] for m in episode.messages()] == ["system", "user"]
    assert '"guess" (integer, required)' in episode.messages()[0]["content"]


def test_a_multi_step_episode_shows_each_observation_and_ends_with_the_reward() -> None:
    environment = guess_environment()
    episode = environment.episode("train", 3)
    turns = bisecting_turns(episode)
    assert episode.stop_reason == "answer" and episode.reward is not None
    assert episode.reward.correct == 1.0 and episode.reward.solved
    assert episode.turns == episode.tool_calls == len(turns) and episode.invalid_calls == 0
    observations = [m["content"] for m in episode.messages()[2:] if m["role"] == "user"]
    assert len(observations) == len(turns) - 1  # the last observation ends the episode
    assert all(json.loads(o)["feedback"] in ("higher", "lower") for o in observations)
    # The same turns on a fresh episode of the same problem: the same conversation and reward,
    # as the coordinator's replay needs.
    replayed = environment.episode("train", 3)
    for turn in turns:
        replayed.respond(turn)
    assert replayed.messages() == episode.messages() and replayed.reward == episode.reward


def test_the_turn_limit_ends_an_episode_with_the_last_reward() -> None:
    episode = guess_environment(max_turns=2).episode("train", 0)
    secret_side = episode.respond('{"guess": 0}')
    assert not secret_side.done
    assert secret_side.messages[0]["content"] == '{"attempts_left": 4, "feedback": "higher"}'
    final = episode.respond('{"guess": 0}')
    assert final.done and final.messages == [] and episode.stop_reason == "turn_limit"
    assert final.reward is not None and final.reward.correct == 0.0
    with pytest.raises(RuntimeError, match="is over"):
        episode.respond('{"guess": 1}')


def test_a_one_step_environment_with_a_text_action() -> None:
    environment = make_environment(REVERSE, action_field="text")
    episode = environment.episode("train", 0)
    word = episode.problem.question.removeprefix("Reverse the word: ")
    assert "plain text" in episode.messages()[0]["content"]
    step = episode.respond(f"  {word[::-1]}\n")
    assert step.done and step.reward is not None and step.reward.correct == 1.0
    wrong = environment.episode("train", 0)
    assert wrong.respond(word).reward == Reward(correct=0.0, format=0.0)


@pytest.mark.parametrize("reply, error", [
    ("I guess ten", "error: the reply holds no JSON object"),
    ('{"guess": ten}', "error: the JSON object does not parse"),
    ('{"guess": "ten"}', "error: not a valid action: guess: Input should be a valid integer"),
    ('{"number": 10}', "error: not a valid action: guess: Field required; number: Extra"),
])
def test_a_reply_without_a_valid_action_is_an_invalid_call(reply: str, error: str) -> None:
    episode = guess_environment().episode("train", 0)
    step = episode.respond(reply)
    assert not step.done and step.turn_signal == pytest.approx(-0.1)
    assert step.messages[0]["role"] == "user" and step.messages[0]["content"].startswith(error)
    assert episode.invalid_calls == 1 and episode.tool_calls == 1


def test_an_action_the_environment_raises_on_is_an_invalid_call() -> None:
    episode = make_environment(f"openenv:{FIXTURES}:CrashingEnvironment").episode("train", 0)
    step = episode.respond('{"guess": 0}')
    assert step.messages[0]["content"] == ("error: the environment could not take this action "
                                           "(RuntimeError: zero is not on the board)")
    assert episode.invalid_calls == 1 and not step.done


def test_a_parse_function_and_a_renderer_by_import_path() -> None:
    environment = guess_environment(parse_action=f"{FIXTURES}:parse_guess",
                                    render_observation=f"{FIXTURES}:render_guess",
                                    invalid_call_penalty=0.5)
    episode = environment.episode("train", 0)
    assert episode.problem.question == "Guess my number between 1 and 20. (5 guesses left)"
    step = episode.respond("My guess is 0.")
    assert step.messages[0]["content"] == "higher (4 guesses left)"
    refused = episode.respond("no idea")
    assert refused.messages[0]["content"] == "error: ValueError: write the guess as a number"
    assert refused.turn_signal == -0.5
    field = guess_environment(observation_field="attempts_left").episode("train", 0)
    assert field.problem.question == "5"


def test_observations_are_cut_to_the_bound() -> None:
    environment = guess_environment(env_options={"rules_padding": 500},
                                    max_observation_chars=100)
    question = environment.problem("train", 0).question
    assert question.startswith('{"attempts_left": 5, "feedback": "Guess my number')
    assert len(question) < 150
    assert re.search(r"\[\.\.\. \d+ more characters cut\]$", question)


@pytest.mark.parametrize("name, options, refusal", [
    ("openenv:http://localhost:8000", {}, "URL, a Docker image or a Hub name"),
    ("openenv:ghcr.io/meta-pytorch/openenv-echo-env:latest", {}, "URL, a Docker image"),
    ("openenv:openenv/echo_env", {}, "URL, a Docker image or a Hub name"),
    ("openenv:openenv.core.env_client:EnvClient", {}, "is an OpenEnv client"),
    ("openenv:openenv.core.generic_client:GenericEnvClient", {}, "is an OpenEnv client"),
    (f"openenv:{FIXTURES}:UnseededEnvironment", {}, "not deterministic given the seed"),
    (f"openenv:{FIXTURES}:SeedlessEnvironment", {}, "its reset takes no seed"),
    (f"openenv:{FIXTURES}:JudgedEnvironment", {}, "asks a language model"),
    (f"openenv:{FIXTURES}:GuessEnvironment", {},
     ("has no 'GuessEnvironment'; its OpenEnv environments: CrashingEnvironment, "
      "GuessNumberEnvironment, JudgedEnvironment, ReverseEnvironment")),
    (f"openenv:{FIXTURES}", {}, "is not an import path <module>:<name>"),
    (f"openenv:{FIXTURES}:GuessAction", {}, "not an OpenEnv Environment subclass"),
    ("openenv:no_such_module:Env", {}, "does not import"),
    (GUESS, {"action_field": "text"}, "'text' is not a field of GuessAction"),
    (GUESS, {"max_turns": 0}, "max_turns must be an int in"),
    (GUESS, {"port": 8000}, "has no option 'port'"),
])
def test_what_cannot_be_replayed_or_named_is_refused(name: str, options: dict[str, Any],
                                                    refusal: str) -> None:
    with pytest.raises(ValueError, match=re.escape(refusal)):
        make_task_or_environment(name, options)


def test_the_coordinators_replay_recomputes_the_reward_and_refuses_a_tampered_transcript(
        tiny_printable_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_printable_dir)
    environment = guess_environment()
    turns = bisecting_turns(environment.episode("train", 5))
    assert len(turns) >= 2
    rollout = demonstration_rollout(environment.episode("train", 5), turns, tokenizer)
    replayed = replay_episode(environment.episode("train", 5), tokenizer, rollout)
    assert replayed.episode.reward is not None and replayed.episode.reward.correct == 1.0
    # A rollout that claims another answer from the environment ("lower" for "higher") is not
    # what a fresh episode answers: the replay refuses it.
    tokens, mask = rollout.completion_tokens, rollout.generated_mask()
    start = mask.index(False)
    end = mask.index(True, start)
    answer = tokenizer.decode(tokens[start:end], skip_special_tokens=False)
    said, other = ("higher", "lower") if "higher" in answer else ("lower", "higher")
    lie = tokenizer.encode(answer.replace(said, other), add_special_tokens=False)
    tampered = msgspec.structs.replace(
        rollout, completion_tokens=[*tokens[:start], *lie, *tokens[end:]],
        generated=[*mask[:start], *[False] * len(lie), *mask[end:]],
        behaviour_logprobs=[0.0] * (len(tokens) - (end - start) + len(lie)))
    with pytest.raises(ValueError, match="not what the environment answers"):
        replay_episode(environment.episode("train", 5), tokenizer, tampered)


def test_an_openenv_environment_trains_through_the_local_loop(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    """Episodes of the guessing game through generation, the coordinator's replay and training:
    the nearly uniform tiny model seldom writes a number, so its turns end in error observations
    that go in as forced tokens and must replay exactly for the groups to be accepted."""
    guess = {"name": GUESS, "options": {"parse_action": f"{FIXTURES}:parse_guess",
                                        "observation_field": "feedback", "max_turns": 3}}
    steps, after = two_episode_steps(tiny_model_dir, tmp_path, guess, eval_problems=2,
                                     temperature=1.0)
    assert all(r["groups"] == 2 for r in steps)  # groups the coordinator replayed and accepted
    assert after["task"] == GUESS and after["episodes"]["played"] == 8
    assert after["episodes"]["mean_turns"] > 0  # the environment answered some turns
