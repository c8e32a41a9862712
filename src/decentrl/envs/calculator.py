"""Arithmetic word problems with a Python calculator tool ("agentic-calculator").

Each problem is a short story (shopping, ages, travel, baking, saving) with two to four operations
on numbers large enough that a small model gains from computing them with the tool. The tool
`python` evaluates an expression in the sandbox (no file system, no network, time and memory
limits). The final answer is the reply without a tool call: the number inside <answer></answer>
if the reply has the tags, else its last number, read the way the "sums" task reads answers.

Each story has an ideal chain of calls (`story_chain`): one for "purchase" and "distance", two
for "shopping", "travel" and "saving", three for "baking" and "ages", each later call writing the
result of the one before it as a number. A problem's metadata holds the chain's results ("chain",
the last is the answer) and its difficulty is the chain's length ("1 step", "2 steps", "3 steps").
`stories` picks the kinds of story: by default the multi-step ones, ALL_STORIES mixes every level
(a curriculum then picks levels by measured success). With `prefill_first_call` the first turn
starts with the opening of a python call (see ToolEpisode). The environment is `Demonstrating`:
its demonstrations make the chain's calls, then answer. `valid_call_bonus`, `used_result_bonus`
and `max_shaping` set the reward shaping of tool_calls.py (off by default).

The split key is the story's template and numbers ("shopping:3,45,2,18,200"), not the names or
items in it: two stories that differ only in who buys what share a split.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reasoning_gym.utils import extract_answer as extract_tagged_answer

from decentrl.envs.base import Message
from decentrl.envs.budget import DEFAULT_TOOL_BUDGET_S
from decentrl.envs.sandbox import ToolResult, run_expression
from decentrl.envs.tool_calls import (
    Shaping,
    Tool,
    ToolEpisode,
    call_opening,
    canonical_numbers,
    check_tool_limits,
    tools_system_prompt,
    written_call,
)
from decentrl.tasks.arithmetic import last_number
from decentrl.tasks.base import (
    DIFFICULTY,
    Problem,
    Reward,
    Split,
    SplitDrawn,
    check_heldout_fraction,
)

NAMES = ("Maya", "Tom", "Aisha", "Lukas", "Sofia", "Kenji", "Priya", "Omar")

INSTRUCTIONS = (
    "You solve arithmetic word problems. Use the python tool to compute; do not do arithmetic in "
    "your head. When you know the result, reply without a tool call and give the final answer "
    "as a number inside <answer></answer> tags."
)


def python_tool_run(arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    return run_expression(arguments["expression"], timeout_s=timeout_s)


PYTHON_TOOL = Tool(
    name="python",
    description="Evaluate one Python arithmetic expression, such as (3 + 4) * 12, and return its "
    "value.",
    arguments={"expression": {"type": "string", "description": "the expression to evaluate"}},
    run=python_tool_run,
)
SYSTEM_PROMPT = tools_system_prompt(INSTRUCTIONS, [PYTHON_TOOL])
# A solved one-step problem as real turns (`worked_example`). Its price is outside the range
# "purchase" draws from, so the example never gives away the answer of a generated problem.
WORKED_EXAMPLE: list[dict[str, str]] = [
    {"role": "user", "content": "Sam buys 7 kites at $108 each. How many dollars does Sam pay?"},
    {"role": "assistant", "content": call_opening(PYTHON_TOOL) + '7 * 108"}}\n</tool_call>'},
    {"role": "tool", "content": "756"},
    {"role": "assistant", "content": "Sam pays $756.\n<answer>756</answer>"},
]

# A story: (question, the numbers that define it) from a seeded generator; `story_chain` solves it.
Story = tuple[str, tuple[int, ...]]


def shopping(rng: random.Random, name: str) -> Story:
    first, second = rng.choice(
        [("notebooks", "pens"), ("apples", "melons"), ("tickets", "drinks"), ("shirts", "hats")]
    )
    count_a, price_a = rng.randint(2, 9), rng.randint(12, 95)
    count_b, price_b = rng.randint(2, 9), rng.randint(12, 95)
    total = count_a * price_a + count_b * price_b
    paid = (total // 100 + 1) * 100
    question = (
        f"{name} buys {count_a} {first} at ${price_a} each and {count_b} {second} at ${price_b} "
        f"each, and pays with ${paid}. How many dollars of change does {name} get back?"
    )
    return question, (count_a, price_a, count_b, price_b, paid)


def ages(rng: random.Random, name: str) -> Story:
    age, times = rng.randint(4, 12), rng.randint(3, 5)
    gap, years = rng.randint(20, 35), rng.randint(2, 15)
    question = (
        f"{name} is {age} years old. {name}'s aunt is {times} times as old as {name}, and "
        f"{name}'s grandfather is {gap} years older than the aunt. How old will the grandfather "
        f"be in {years} years?"
    )
    return question, (age, times, gap, years)


def travel(rng: random.Random, name: str) -> Story:
    speed_a, hours_a = rng.randint(45, 120), rng.randint(2, 9)
    speed_b, hours_b = rng.randint(45, 120), rng.randint(2, 9)
    question = (
        f"{name} drives at {speed_a} km per hour for {hours_a} hours, then at {speed_b} km per "
        f"hour for {hours_b} hours. How many kilometres does {name} drive in total?"
    )
    return question, (speed_a, hours_a, speed_b, hours_b)


def baking(rng: random.Random, name: str) -> Story:
    trays, per_tray, per_box = rng.randint(5, 20), rng.randint(12, 36), rng.randint(4, 12)
    baked = trays * per_tray
    # Choose the boxes first so that what is left after selling divides evenly into them.
    boxes = rng.randint(baked // (2 * per_box) + 1, (baked - 1) // per_box)
    sold = baked - boxes * per_box
    question = (
        f"{name} bakes {trays} trays of {per_tray} cookies, sells {sold} of them, and packs the "
        f"rest into boxes of {per_box}. How many boxes does {name} fill?"
    )
    return question, (trays, per_tray, sold, per_box)


def saving(rng: random.Random, name: str) -> Story:
    weeks, earned, spent = rng.randint(6, 30), rng.randint(40, 150), rng.randint(5, 35)
    saved = weeks * (earned - spent)
    bike = rng.randint(saved // 4, saved - 1)
    question = (
        f"{name} earns ${earned} a week and spends ${spent} a week on bus fares. After {weeks} "
        f"weeks {name} buys a bike for ${bike}. How many dollars does {name} have left?"
    )
    return question, (weeks, earned, spent, bike)


def purchase(rng: random.Random, name: str) -> Story:
    item = rng.choice(["notebooks", "apples", "tickets", "shirts", "lamps", "books"])
    count, price = rng.randint(3, 19), rng.randint(12, 95)
    question = f"{name} buys {count} {item} at ${price} each. How many dollars does {name} pay?"
    return question, (count, price)


def distance(rng: random.Random, name: str) -> Story:
    speed, hours = rng.randint(45, 120), rng.randint(3, 12)
    question = (
        f"{name} drives at {speed} km per hour for {hours} hours. How many kilometres does "
        f"{name} drive?"
    )
    return question, (speed, hours)


STORIES: dict[str, Callable[[random.Random, str], Story]] = {
    "shopping": shopping,
    "ages": ages,
    "travel": travel,
    "baking": baking,
    "saving": saving,
    "purchase": purchase,
    "distance": distance,
}
# Stories with one multiplication: the level at which a 135M model starts to solve episodes.
ONE_STEP_STORIES = ("purchase", "distance")
MULTI_STEP_STORIES = ("shopping", "ages", "travel", "baking", "saving")
ALL_STORIES = ONE_STEP_STORIES + MULTI_STEP_STORIES


@dataclass(frozen=True)
class Step:
    """One call of a story's ideal chain."""

    what: str  # what it computes, for the demonstration's prose
    expression: str  # earlier results written as numbers
    value: int


def story_chain(story: str, numbers: list[int] | tuple[int, ...]) -> list[Step]:
    """The ideal calls that solve a story, in order; the last value is the answer."""
    if story == "purchase":
        count, price = numbers
        return [Step("the price", f"{count} * {price}", count * price)]
    if story == "distance":
        speed, hours = numbers
        return [Step("the distance", f"{speed} * {hours}", speed * hours)]
    if story == "shopping":
        count_a, price_a, count_b, price_b, paid = numbers
        total = count_a * price_a + count_b * price_b
        return [Step("the total price", f"{count_a} * {price_a} + {count_b} * {price_b}", total),
                Step("the change", f"{paid} - {total}", paid - total)]
    if story == "travel":
        speed_a, hours_a, speed_b, hours_b = numbers
        first = speed_a * hours_a
        return [Step("the first distance", f"{speed_a} * {hours_a}", first),
                Step("the total distance", f"{first} + {speed_b} * {hours_b}",
                     first + speed_b * hours_b)]
    if story == "saving":
        weeks, earned, spent, bike = numbers
        saved = weeks * (earned - spent)
        return [Step("the savings", f"{weeks} * ({earned} - {spent})", saved),
                Step("what is left after the bike", f"{saved} - {bike}", saved - bike)]
    if story == "baking":
        trays, per_tray, sold, per_box = numbers
        baked = trays * per_tray
        return [Step("the cookies baked", f"{trays} * {per_tray}", baked),
                Step("the cookies left", f"{baked} - {sold}", baked - sold),
                Step("the boxes", f"{baked - sold} // {per_box}", (baked - sold) // per_box)]
    if story == "ages":
        age, times, gap, years = numbers
        aunt = age * times
        grandfather = aunt + gap
        return [Step("the aunt's age", f"{age} * {times}", aunt),
                Step("the grandfather's age", f"{aunt} + {gap}", grandfather),
                Step("the grandfather's age then", f"{grandfather} + {years}",
                     grandfather + years)]
    raise ValueError(f"unknown story {story!r}; stories: {', '.join(STORIES)}")


def steps_difficulty(steps: int) -> str:
    return f"{steps} step" if steps == 1 else f"{steps} steps"


# The demonstrations' wording: the prose before a step's call, and the final answer's sentence.
FIRST_STEP_PHRASES = ("Let me compute {what} with the python tool.", "First, {what}.",
                      "I start with {what}.", "I need {what}.")
NEXT_STEP_PHRASES = ("Next, {what}, using {previous}.", "Now {what}, from {previous}.",
                     "With {previous}, I compute {what}.", "Then {what}.")
ANSWER_PHRASES = ("The answer is {answer}.", "So the result is {answer}.", "That gives {answer}.",
                  "The tool says {answer}, which answers the question.")


def chain_steps_reached(problem: Problem, messages: list[Message]) -> int | None:
    """How many leading results of the problem's chain appear, in order, as numbers in the tool
    messages after the question: the step at which a chain broke. None without a chain."""
    chain = problem.metadata.get("chain")
    if chain is None:
        return None
    question_at = max(i for i, message in enumerate(messages) if message["role"] == "user")
    reached = 0
    for message in messages[question_at + 1:]:
        if message["role"] != "tool":
            continue
        for number in canonical_numbers(message["content"]):
            if reached < len(chain) and number == str(chain[reached]):
                reached += 1
    return reached


class CalculatorEpisode(ToolEpisode):
    def score(self, final_answer: str) -> Reward:
        tagged = extract_tagged_answer(final_answer)
        answer = last_number(tagged if tagged is not None else final_answer)
        # Both sides are canonical integer strings, so string equality is integer equality.
        return Reward(correct=1.0 if answer == self.problem.answer else 0.0, format=0.0)


class CalculatorEnvironment(SplitDrawn):
    name = "agentic-calculator"

    def __init__(
        self,
        heldout_fraction: float = 0.1,
        max_turns: int = 4,
        max_tool_calls: int = 4,
        invalid_call_penalty: float = 0.1,
        stories: list[str] | tuple[str, ...] = MULTI_STEP_STORIES,
        prefill_first_call: bool = False,
        worked_example: bool = False,
        tool_budget_s: float = DEFAULT_TOOL_BUDGET_S,
        valid_call_bonus: float = 0.0,
        used_result_bonus: float = 0.0,
        max_shaping: float = 0.2,
    ) -> None:
        check_heldout_fraction(heldout_fraction)
        check_tool_limits(max_turns, max_tool_calls, invalid_call_penalty, tool_budget_s)
        if not isinstance(stories, (list, tuple)) or not stories or any(
                story not in STORIES for story in stories):
            raise ValueError(f"stories must be a non-empty list of {', '.join(STORIES)}; "
                             f"got {stories!r}")
        for option, value in (("prefill_first_call", prefill_first_call),
                              ("worked_example", worked_example)):
            if not isinstance(value, bool):
                raise ValueError(f"{option} must be true or false, got {value!r}")
        self.worked_example = worked_example
        self.stories = sorted(set(stories))
        self.prefill_first_call = prefill_first_call
        self.heldout_fraction = heldout_fraction
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.invalid_call_penalty = invalid_call_penalty
        self.tool_budget_s = tool_budget_s
        self.shaping = Shaping(valid_call_bonus, used_result_bonus, max_shaping)

    def _candidate(self, index: int, seed: int) -> Problem:
        rng = random.Random(seed)
        story = rng.choice(self.stories)
        question, numbers = STORIES[story](rng, rng.choice(NAMES))
        chain = [step.value for step in story_chain(story, numbers)]
        return Problem(
            task=self.name,
            index=index,
            question=question,
            answer=str(chain[-1]),
            key=f"{story}:{','.join(map(str, numbers))}",
            metadata={"story": story, "numbers": list(numbers), "chain": chain,
                      DIFFICULTY: steps_difficulty(len(chain))},
        )

    def demonstration(self, problem: Problem, rng: random.Random) -> list[str]:
        """The story's chain of python calls, then the answer (base.Demonstrating)."""
        steps = story_chain(problem.metadata["story"], problem.metadata["numbers"])
        if len(steps) >= self.max_turns or len(steps) > self.max_tool_calls:
            raise ValueError(f"a {steps_difficulty(len(steps))} story needs max_turns >= "
                             f"{len(steps) + 1} and max_tool_calls >= {len(steps)}; this "
                             f"environment has {self.max_turns} and {self.max_tool_calls}")
        turns = []
        for position, step in enumerate(steps):
            call = written_call(PYTHON_TOOL.name, {"expression": step.expression})
            if position == 0 and self.prefill_first_call:
                turns.append(call)  # the prefill is the call's opening: no prose before it
                continue
            phrases = NEXT_STEP_PHRASES if position else FIRST_STEP_PHRASES
            previous = steps[position - 1].value if position else None
            prose = rng.choice(phrases).format(what=step.what, previous=previous)
            turns.append(f"{prose}\n{call}")
        answer = problem.answer
        turns.append(f"{rng.choice(ANSWER_PHRASES).format(answer=answer)}\n"
                     f"<answer>{answer}</answer>")
        return turns

    def episode(self, split: Split, index: int) -> CalculatorEpisode:
        return CalculatorEpisode(
            self.problem(split, index),
            SYSTEM_PROMPT,
            [PYTHON_TOOL],
            max_turns=self.max_turns,
            max_tool_calls=self.max_tool_calls,
            invalid_call_penalty=self.invalid_call_penalty,
            prefill_first_call=self.prefill_first_call,
            example=WORKED_EXAMPLE if self.worked_example else (),
            tool_budget_s=self.tool_budget_s,
            shaping=self.shaping,
        )
