"""Scripted demonstrations of the environments' own problems, the calculator's ideal chains, the
countdown solver, and the reward shaping that pays for the path without being gamed."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable

import pytest

from decentrl.envs import make_environment
from decentrl.envs.base import (
    Demonstrating,
    Episode,
    EpisodeResult,
    Message,
    play_demonstration,
    run_episode,
)
from decentrl.envs.calculator import (
    ALL_STORIES,
    MULTI_STEP_STORIES,
    ONE_STEP_STORIES,
    PYTHON_TOOL,
    CalculatorEnvironment,
    chain_steps_reached,
    story_chain,
)
from decentrl.envs.countdown import (
    DEFAULT_REVISIONS,
    INTEGER_RE,
    REVISE_PHRASES,
    CountdownEnvironment,
    CountdownEpisode,
    check_expression,
    overused_numbers,
    revisions_drawn,
    solve_countdown,
    wrong_candidates,
)
from decentrl.envs.sandbox import run_expression
from decentrl.envs.tool_calls import CLOSE_TAG, parse_tool_calls, written_call
from decentrl.tasks.base import DIFFICULTY, Problem, difficulty_of

CHAIN_LENGTHS = {"purchase": 1, "distance": 1, "shopping": 2, "travel": 2, "saving": 2,
                 "baking": 3, "ages": 3}
COUNTDOWN_LEVELS = {"min_numbers": 2, "max_numbers": 4}
SHAPED = {"valid_call_bonus": 0.05, "used_result_bonus": 0.05, "max_shaping": 0.2}


def episode_return(result: EpisodeResult) -> float:
    """What ingestion trains on (coordinator/ingest.py): the final reward plus the turn signals."""
    return result.reward.total + sum(s for s in result.turn_signals if s is not None)


def played(environment: Demonstrating, split: str, index: int, seed: int = 0) -> EpisodeResult:
    episode = environment.episode(split, index)
    return play_demonstration(episode, environment.demonstration(episode.problem,
                                                                 random.Random(seed)))


def assert_ideal(result: EpisodeResult, episode: Episode) -> None:
    assert result.stop_reason == "answer" and result.reward.correct == 1.0
    assert result.invalid_calls == 0 and result.tool_calls == result.turns - 1
    question_at = max(i for i, m in enumerate(result.messages) if m["role"] == "user")
    turns = [m["content"] for m in result.messages[question_at:] if m["role"] == "assistant"]
    tools = episode.tools  # type: ignore[attr-defined]
    for turn in turns[:-1]:
        # Generation stops a turn at the closing tag: a demonstration turn must end there.
        assert turn.endswith(CLOSE_TAG) and len(parse_tool_calls(turn, tools)) == 1
    assert parse_tool_calls(turns[-1], tools) == [] and "<answer>" in turns[-1]


def scripted_turns(turns: list[str]) -> Callable[[list[Message]], str]:
    remaining = list(turns)
    return lambda messages: remaining.pop(0)


# --- the calculator's chains ---------------------------------------------------------------------


@pytest.mark.parametrize("story", ALL_STORIES)
def test_every_story_has_an_ideal_chain_that_uses_each_result(story: str) -> None:
    environment = CalculatorEnvironment(stories=[story])
    for index in range(6):
        problem = environment.problem("train", index)
        steps = story_chain(story, problem.metadata["numbers"])
        assert len(steps) == CHAIN_LENGTHS[story]
        assert problem.metadata["chain"] == [step.value for step in steps]
        assert problem.answer == str(steps[-1].value) and problem.metadata["story"] == story
        expected = "1 step" if len(steps) == 1 else f"{len(steps)} steps"
        assert problem.metadata[DIFFICULTY] == difficulty_of(problem) == expected
        for position, step in enumerate(steps):
            # The sandbox recomputes every step, independently of the generator.
            assert run_expression(step.expression).output == str(step.value)
            if position:
                assert str(steps[position - 1].value) in step.expression.split()


def test_one_environment_mixes_every_level_and_the_old_names_stay() -> None:
    environment = CalculatorEnvironment(stories=ALL_STORIES)
    levels = Counter(difficulty_of(environment.problem("train", i)) for i in range(200))
    assert set(levels) == {"1 step", "2 steps", "3 steps"}
    assert set(ALL_STORIES) == set(ONE_STEP_STORIES) | set(MULTI_STEP_STORIES)
    with pytest.raises(ValueError, match="unknown story 'dragons'"):
        story_chain("dragons", [1, 2])


# --- calculator demonstrations -------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {},
    {"prefill_first_call": True},
    {"worked_example": True},
    {"prefill_first_call": True, "worked_example": True, "max_turns": 6, "max_tool_calls": 6},
])
def test_calculator_demonstrations_solve_every_story(options: dict[str, object]) -> None:
    environment = CalculatorEnvironment(stories=ALL_STORIES, **options)
    assert isinstance(environment, Demonstrating)
    count = 30 if not options else 8
    stories = set()
    for split in ("train", "heldout"):
        for index in range(count if split == "train" else count // 2):
            episode = environment.episode(split, index)
            turns = environment.demonstration(episode.problem, random.Random(index))
            if options.get("prefill_first_call"):
                assert turns[0].startswith(episode.turn_prefix())
            result = play_demonstration(episode, turns)
            assert_ideal(result, episode)
            chain = episode.problem.metadata["chain"]
            assert result.tool_calls == len(chain)
            assert chain_steps_reached(episode.problem, result.messages) == len(chain)
            stories.add(episode.problem.metadata["story"])
    if not options:
        assert stories == set(ALL_STORIES)


def test_demonstrations_vary_their_wording_not_their_calls() -> None:
    environment = CalculatorEnvironment(stories=["ages"])
    problem = environment.problem("train", 0)
    demonstrations = [environment.demonstration(problem, random.Random(seed))
                      for seed in range(20)]
    assert len({tuple(turns) for turns in demonstrations}) > 5
    calls = {tuple(turn[turn.index("<tool_call>"):] for turn in turns[:-1])
             for turns in demonstrations}
    assert len(calls) == 1
    assert {turns[-1].rsplit("\n", 1)[1] for turns in demonstrations} == {
        f"<answer>{problem.answer}</answer>"}
    # The same rng gives the same demonstration.
    assert environment.demonstration(problem, random.Random(3)) == demonstrations[3]


def test_a_demonstration_needs_room_for_its_chain() -> None:
    environment = CalculatorEnvironment(stories=["ages"], max_turns=3)
    with pytest.raises(ValueError, match="a 3 steps story needs max_turns >= 4 and "
                                         "max_tool_calls >= 3; this environment has 3 and 4"):
        environment.demonstration(environment.problem("train", 0), random.Random(0))


def test_play_demonstration_refuses_turns_that_do_not_fit_the_episode() -> None:
    environment = CalculatorEnvironment(stories=["shopping"], prefill_first_call=True)
    episode = environment.episode("train", 0)
    turns = environment.demonstration(episode.problem, random.Random(0))
    with pytest.raises(ValueError, match="goes on after the 2 turns of its demonstration"):
        play_demonstration(environment.episode("train", 0), turns[:2])
    with pytest.raises(ValueError, match="ended \\(answer\\) after 3 of the 4 turns"):
        play_demonstration(environment.episode("train", 0), [*turns, "and more"])
    with pytest.raises(ValueError, match="turn 1 of the demonstration does not start with"):
        play_demonstration(environment.episode("train", 0), ["Let me see.", *turns[1:]])


def test_chain_steps_reached_says_which_step_breaks() -> None:
    environment = CalculatorEnvironment(stories=["baking"], worked_example=True)
    episode = environment.episode("train", 0)
    turns = environment.demonstration(episode.problem, random.Random(0))
    chain = episode.problem.metadata["chain"]
    # The second call gets its subtraction wrong: the chain breaks at step 2.
    wrong_second = turns[1].replace(f"- {episode.problem.metadata['numbers'][2]}", "- 1")
    result = run_episode(episode, scripted_turns([turns[0], wrong_second, "I give up."]))
    assert chain_steps_reached(episode.problem, result.messages) == 1
    # Tool messages before the question (the worked example's) do not count; later ones count
    # in order only.
    messages: list[Message] = [
        {"role": "tool", "content": str(chain[0])},
        {"role": "user", "content": episode.problem.question},
        {"role": "tool", "content": f"{chain[1]} and {chain[0]}"},
        {"role": "tool", "content": f"{chain[2]}"},
    ]
    assert chain_steps_reached(episode.problem, messages) == 1
    countdown = CountdownEnvironment().problem("train", 0)
    assert chain_steps_reached(countdown, messages) is None


# --- countdown -----------------------------------------------------------------------------------


def test_countdown_levels_from_two_to_four_numbers() -> None:
    environment = CountdownEnvironment(config=COUNTDOWN_LEVELS)
    levels = Counter(difficulty_of(environment.problem("train", i)) for i in range(100))
    assert set(levels) == {"2 numbers", "3 numbers", "4 numbers"}
    with pytest.raises(ValueError, match="min_numbers must be greater than 1"):
        CountdownEnvironment(config={"min_numbers": 1})


@pytest.mark.parametrize("numbers, target", [
    ([4, 14, 3], 53), ([11, 9, 15, 2], 16), ([25, 5, 4], 80), ([3, 7], 21), ([6, 4, 3], 2),
    ([1, 5, 5, 5], 24),  # only through a fraction: 5 * (5 - 1 / 5)
])
def test_the_solver_finds_an_expression_the_check_confirms(numbers: list[int],
                                                           target: int) -> None:
    expression = solve_countdown(numbers, target)
    assert expression is not None
    assert check_expression(expression, numbers, target).solves


def test_the_solver_says_when_there_is_no_solution() -> None:
    assert solve_countdown([2, 3], 100) is None


def test_countdown_demonstrations_solve_200_train_problems() -> None:
    environment = CountdownEnvironment(config=COUNTDOWN_LEVELS)
    rng = random.Random(0)
    revisions = 0
    for split, count in (("train", 200), ("heldout", 20)):
        for index in range(count):
            episode = environment.episode(split, index)
            result = play_demonstration(episode, environment.demonstration(episode.problem, rng))
            assert_ideal(result, episode)
            checks = [m["content"] for m in result.messages if m["role"] == "tool"]
            # Every check but the last misses; the last confirms the answer.
            assert all(c.endswith("no") for c in checks[:-1]) and checks[-1].endswith("yes")
            assert len(checks) <= 2  # by default, one wrong candidate at most
            revisions += len(checks) > 1
    assert 30 < revisions < 110  # about 0.3 of 220 (DEFAULT_REVISIONS)


def test_countdown_demonstrations_with_the_prefill_and_without_a_solver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    environment = CountdownEnvironment(prefill_first_call=True, max_turns=2)
    for index in range(5):
        result = played(environment, "train", index, seed=index)
        assert result.reward.solved and result.turns == 2  # no room for a wrong candidate
    # Where the solver finds nothing, reasoning-gym's own solution is the demonstration's.
    monkeypatch.setattr("decentrl.envs.countdown.solve_countdown", lambda numbers, target: None)
    episode = environment.episode("train", 0)
    turns = environment.demonstration(episode.problem, random.Random(0))
    assert turns[-1].endswith(f"<answer>{episode.problem.answer}</answer>")
    assert play_demonstration(episode, turns).reward.solved


def test_by_default_3_demonstrations_in_10_revise_once_on_the_same_draw_as_before() -> None:
    # Before `revisions`, a demonstration revised when rng.random() < 0.3: the same draw decides.
    for seed in range(200):
        assert revisions_drawn(DEFAULT_REVISIONS, random.Random(seed)) == int(
            random.Random(seed).random() < 0.3)
    # Weights need not sum to 1, and a count of weight 0 is never drawn.
    drawn = Counter(revisions_drawn((0.0, 2.0, 0.0, 2.0), random.Random(s)) for s in range(400))
    assert set(drawn) == {1, 3} and 160 < drawn[3] < 240


def checked_expression(turn: str) -> str:
    return json.loads(turn[turn.index("<tool_call>") + len("<tool_call>"):turn.index(CLOSE_TAG)])[
        "arguments"]["expression"]


@pytest.mark.parametrize("levels", [{"min_numbers": 3, "max_numbers": 4},
                                    {"min_numbers": 2, "max_numbers": 2}])
def test_countdown_demonstrations_check_and_revise_several_times(levels: dict[str, int]) -> None:
    environment = CountdownEnvironment(config=levels, prefill_first_call=True, max_turns=6,
                                       max_tool_calls=6, revisions=[0, 0, 1, 1])
    wrong_counts: Counter[int] = Counter()
    for index in range(12):
        episode = environment.episode("train", index)
        turns = environment.demonstration(episode.problem, random.Random(index))
        assert environment.demonstration(episode.problem, random.Random(index)) == turns
        result = play_demonstration(episode, turns)
        assert_ideal(result, episode)
        numbers, target = episode.problem.metadata["numbers"], episode.problem.metadata["target"]
        checks = list(zip(turns[:-1], [m["content"] for m in result.messages
                                       if m["role"] == "tool"], strict=True))
        wrong = checks[:-1]
        wrong_counts[len(wrong)] += 1
        values, distances = [], []
        for position, (turn, report) in enumerate(wrong):
            used = [int(n) for n in INTEGER_RE.findall(checked_expression(turn))]
            # A plausible candidate: the given numbers, each at most once, at least two of them
            # (most of them on 3 and 4 numbers); the tool says it misses.
            assert overused_numbers(used, numbers) is None
            assert len(used) >= max(2, len(numbers) - 1)
            value = report.split("\n")[0].removeprefix("value: ")
            assert report.endswith(f"reaches the target {target}: no") and value != str(target)
            # The next turn reads the value the tool gave and revises.
            next_turn = turns[position + 1]
            prose = next_turn[:next_turn.index("\n<tool_call>")]
            assert prose in {phrase.format(value=value, target=target,
                                           expression=checked_expression(next_turn))
                             for phrase in REVISE_PHRASES}
            values.append(value)
            distances.append(abs(int(value) - target))
        assert len(set(values)) == len(values)  # each check tells something new
        assert distances == sorted(distances, reverse=True)  # closing in
        assert checks[-1][1].endswith("reaches the target " f"{target}: yes")
    if levels["min_numbers"] == 3:
        assert set(wrong_counts) == {2, 3}  # as revisions says
    else:
        # Two numbers make few values: at most two wrong ones (a + b, a * b, a - b), fewer when
        # the numbers make fewer.
        assert max(wrong_counts) <= 2 and wrong_counts[2] > 0


def test_wrong_candidates_are_near_misses_the_tool_confirms_as_misses() -> None:
    numbers, target = [3, 7, 25, 4], 53
    candidates = wrong_candidates(numbers, target, 3, random.Random(0))
    assert len(candidates) == 3
    distances = [abs(c.value - target) for c in candidates]
    assert distances == sorted(distances, reverse=True)
    assert len({c.value for c in candidates}) == 3
    for candidate in candidates:
        check = check_expression(candidate.expression, numbers, target)
        assert not check.solves and check.result.ok
        assert check.result.output.startswith(f"value: {candidate.value}\n")
        assert "each at most once: yes" in check.result.output
    # Drawn from the rng alone: the same draw, the same candidates.
    assert wrong_candidates(numbers, target, 3, random.Random(0)) == candidates
    # Two numbers whose sum is the target: the product and the difference miss, nothing else.
    assert {c.value for c in wrong_candidates([5, 3], 8, 4, random.Random(1))} == {15, 2}


def test_the_turn_and_call_limits_cap_the_revisions() -> None:
    for limits, most in (({"max_turns": 4, "max_tool_calls": 6}, 2),
                         ({"max_turns": 6, "max_tool_calls": 2}, 1),
                         ({"max_turns": 2, "max_tool_calls": 6}, 0)):
        environment = CountdownEnvironment(config={"min_numbers": 4, "max_numbers": 4},
                                           revisions=[0, 0, 0, 1], **limits)
        for index in range(3):
            result = played(environment, "train", index, seed=index)
            assert result.reward.solved and result.tool_calls == most + 1


@pytest.mark.parametrize("revisions", [[], [0, 0], [1, -1], "many", [1] * 7, [True],
                                       [1, float("inf")], None])
def test_bad_revisions_are_refused(revisions: object) -> None:
    with pytest.raises(ValueError, match="revisions must be a list of 1 to 6 weights >= 0"):
        make_environment("agentic-countdown", revisions=revisions)


def test_task_environments_do_not_demonstrate() -> None:
    assert not isinstance(make_environment("task:sums"), Demonstrating)
    assert isinstance(make_environment("agentic-countdown"), Demonstrating)


# --- reward shaping ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["agentic-calculator", "agentic-countdown"])
@pytest.mark.parametrize("options, message", [
    ({"valid_call_bonus": -0.1}, "valid_call_bonus must be in \\[0, 1\\], got -0.1"),
    ({"used_result_bonus": "a lot"}, "used_result_bonus must be in \\[0, 1\\], got 'a lot'"),
    ({"max_shaping": 1.0}, "max_shaping must be in \\[0, 1\\) so that shaping never rivals"),
    ({"max_shaping": True}, "max_shaping must be in"),
])
def test_shaping_options_are_checked(name: str, options: dict[str, object],
                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_environment(name, **options)


def test_without_shaping_a_demonstration_returns_exactly_one() -> None:
    result = played(CalculatorEnvironment(stories=["ages"]), "train", 0)
    assert result.turn_signals == [0.0] * 4 and episode_return(result) == 1.0


@pytest.mark.parametrize("story", ["purchase", "shopping", "ages"])
def test_a_correct_demonstration_earns_one_plus_its_shaping(story: str) -> None:
    environment = CalculatorEnvironment(stories=[story], valid_call_bonus=0.01,
                                        used_result_bonus=0.02)
    # A result that is also a number of the question is no result (tested below).
    index = next(i for i in range(50) if not set(environment.problem("train", i).metadata[
        "chain"]) & set(environment.problem("train", i).metadata["numbers"]))
    result = played(environment, "train", index)
    steps = CHAIN_LENGTHS[story]
    # Each call is valid, each later call uses the result before it, and so does the answer.
    assert episode_return(result) == pytest.approx(1 + 0.01 * steps + 0.02 * steps)
    # Shaping is a function of the turns: playing them again pays the same signals.
    assert played(environment, "train", index).turn_signals == result.turn_signals
    capped = played(CalculatorEnvironment(stories=[story], **SHAPED), "train", index)
    assert episode_return(capped) == pytest.approx(1 + min(0.2, 0.1 * steps))


def test_a_result_that_is_a_given_number_is_not_paid_for() -> None:
    environment = CalculatorEnvironment(stories=["shopping"], valid_call_bonus=0.01,
                                        used_result_bonus=0.02)
    problem = environment.problem("train", 0)
    assert problem.metadata["chain"] == [198, 2] and 2 in problem.metadata["numbers"]
    # 200 - 198 uses 198; the answer 2 is one of the question's numbers.
    assert played(environment, "train", 0).turn_signals == pytest.approx([0.01, 0.03, 0.0])


def test_a_correct_answer_without_calls_earns_one() -> None:
    environment = CalculatorEnvironment(stories=["ages"], **SHAPED)
    episode = environment.episode("train", 0)
    result = run_episode(episode, scripted_turns([f"<answer>{episode.problem.answer}</answer>"]))
    assert result.turn_signals == [0.0] and episode_return(result) == 1.0


def last_tool_output(messages: list[Message]) -> str:
    return messages[-1]["content"].split("\n")[0] if messages[-1]["role"] == "tool" else "1"


def python_call(expression: str) -> str:
    return written_call(PYTHON_TOOL.name, {"expression": expression})


def repeating_the_given_numbers(problem: Problem) -> Callable[[list[Message]], str]:
    numbers = problem.metadata["numbers"]
    turn = iter(range(1000))

    def policy(messages: list[Message]) -> str:
        k = next(turn)
        return python_call(f"{numbers[k % len(numbers)]} * {numbers[(k + 1) % len(numbers)]}")

    return policy


# Policies that make valid calls and never answer correctly, with the return each gets where it
# does not depend on the problem.
HACKS: dict[str, tuple[Callable[[Problem], Callable[[list[Message]], str]], float | None]] = {
    # A call repeated earns once.
    "the same call every turn": (lambda problem: lambda messages: python_call("2 * 3"), 0.05),
    "chaining on its own results": (lambda problem: lambda messages: python_call(
        f"{last_tool_output(messages)} * 7"), 0.2),
    # 1 is no result to build on, and the call repeats.
    "1 + 0 loops": (lambda problem: lambda messages: python_call(
        f"{last_tool_output(messages)} + 0"), 0.05),
    "repeating the given numbers": (repeating_the_given_numbers, None),
}


@pytest.mark.parametrize("hack", HACKS)
def test_valid_calls_without_a_correct_answer_cannot_score_well(hack: str) -> None:
    environment = CalculatorEnvironment(stories=ALL_STORIES, max_turns=8, max_tool_calls=8,
                                        **SHAPED)
    correct = episode_return(played(environment, "train", 0))
    policy_of, expected = HACKS[hack]
    for index in range(3):
        episode = environment.episode("train", index)
        result = run_episode(episode, policy_of(episode.problem))
        assert result.stop_reason == "turn_limit" and result.invalid_calls == 0
        assert result.reward.correct == 0.0
        assert episode_return(result) <= 0.2 + 1e-9
        assert episode_return(result) < correct - 0.8
        if expected is not None:
            assert episode_return(result) == pytest.approx(expected)


def test_answering_with_a_result_after_valid_calls_stays_within_the_cap() -> None:
    environment = CalculatorEnvironment(stories=["ages"], max_turns=8, max_tool_calls=8,
                                        **SHAPED)
    turns = [python_call("123 * 457"), python_call("56211 + 1"), python_call("56212 * 3"),
             "<answer>168636</answer>"]
    result = run_episode(environment.episode("train", 0), scripted_turns(turns))
    assert result.stop_reason == "answer" and not result.reward.solved
    # 0.05, 0.1, 0.1 and 0.05 earned; paid up to 0.2 in all.
    assert result.turn_signals == pytest.approx([0.05, 0.1, 0.05, 0.0])


def test_the_penalty_and_the_bonus_add_up_in_one_turn() -> None:
    environment = CalculatorEnvironment(stories=["purchase"], **SHAPED)
    result = run_episode(environment.episode("train", 0), scripted_turns(
        [python_call("123 * 457") + "<tool_call>not json</tool_call>", "<answer>56211</answer>"]))
    assert result.turn_signals == pytest.approx([0.05 - 0.1, 0.05])


def test_a_countdown_checks_result_is_its_value() -> None:
    environment = CountdownEnvironment(**SHAPED)
    episode = environment.episode("train", 0)
    assert isinstance(episode, CountdownEpisode)
    report = "value: 18\nuses only the given numbers, each at most once: no (5 is used 2 times " \
             "but given 1 time(s))\nreaches the target 53: no"
    assert episode.result_text(report) == "value: 18"


# --- the demos' recipes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["agentic-calculator", "agentic-countdown"])
def test_the_longest_demonstrations_fit_the_demo_recipes_budget(name: str) -> None:
    """In SmolLM2's tokens: a demonstration longer than rollout.max_new_tokens is replaced by
    another (rollout/demonstrations.py), so the recipe must hold its longest whole."""
    from decentrl.config import parse_config
    from decentrl.demo import demo_config
    from decentrl.envs import make_task_or_environment
    from decentrl.model.loading import DEFAULT_MODEL, load_tokenizer, resolve_model
    from decentrl.rollout.demonstrations import demonstration_rollout

    config = parse_config(demo_config(name))
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    options = dict(config.task.options)
    most = len(options.get("revisions", ())) - 1
    if most > 0:
        options["revisions"] = [0] * most + [1]  # the most wrong candidates the recipe draws
    environment = make_task_or_environment(config.task.name, options)
    assert isinstance(environment, Demonstrating)
    longest: dict[str, int] = {}
    rng = random.Random(0)
    for index in range(90):
        problem = environment.problem("train", index)
        row = demonstration_rollout(environment.episode("train", index),
                                    environment.demonstration(problem, rng), tokenizer)
        level = difficulty_of(problem)
        longest[level] = max(longest.get(level, 0), len(row.completion_tokens))
    assert max(longest.values()) <= config.rollout.max_new_tokens, longest
    if name == "agentic-countdown":
        assert most == 3
        # Three wrong candidates on 4 numbers: ~435 tokens, where 256 held two checks at most.
        assert 256 < longest["4 numbers"] <= config.rollout.max_new_tokens - 48
