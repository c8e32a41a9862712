"""Arithmetic word problems with a Python calculator tool ("agentic-calculator").

Each problem is a short story (shopping, ages, travel, baking, saving) with two to four operations
on numbers large enough that a small model gains from computing them with the tool. The tool
`python` evaluates an expression in the sandbox (no file system, no network, time and memory
limits). The final answer is the reply without a tool call: the number inside <answer></answer>
if the reply has the tags, else its last number, read the way the "sums" task reads answers.

`stories` picks the kinds of story: the default five take two to four operations; "purchase" and
"distance" take one, for models that cannot yet chain calls. With `prefill_first_call` the first
turn starts with the opening of a python call (see ToolEpisode).

The split key is the story's template and numbers ("shopping:3,45,2,18,200"), not the names or
items in it: two stories that differ only in who buys what share a split.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from reasoning_gym.utils import extract_answer as extract_tagged_answer

from decentrl.envs.budget import DEFAULT_TOOL_BUDGET_S
from decentrl.envs.sandbox import ToolResult, run_expression
from decentrl.envs.tool_calls import (
    Tool,
    ToolEpisode,
    call_opening,
    check_tool_limits,
    tools_system_prompt,
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

# A story: (question, answer, the numbers that define it) from a seeded generator.
Story = tuple[str, int, tuple[int, ...]]


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
    return question, paid - total, (count_a, price_a, count_b, price_b, paid)


def ages(rng: random.Random, name: str) -> Story:
    age, times = rng.randint(4, 12), rng.randint(3, 5)
    gap, years = rng.randint(20, 35), rng.randint(2, 15)
    question = (
        f"{name} is {age} years old. {name}'s aunt is {times} times as old as {name}, and "
        f"{name}'s grandfather is {gap} years older than the aunt. How old will the grandfather "
        f"be in {years} years?"
    )
    return question, age * times + gap + years, (age, times, gap, years)


def travel(rng: random.Random, name: str) -> Story:
    speed_a, hours_a = rng.randint(45, 120), rng.randint(2, 9)
    speed_b, hours_b = rng.randint(45, 120), rng.randint(2, 9)
    question = (
        f"{name} drives at {speed_a} km per hour for {hours_a} hours, then at {speed_b} km per "
        f"hour for {hours_b} hours. How many kilometres does {name} drive in total?"
    )
    return question, speed_a * hours_a + speed_b * hours_b, (speed_a, hours_a, speed_b, hours_b)


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
    return question, boxes, (trays, per_tray, sold, per_box)


def saving(rng: random.Random, name: str) -> Story:
    weeks, earned, spent = rng.randint(6, 30), rng.randint(40, 150), rng.randint(5, 35)
    saved = weeks * (earned - spent)
    bike = rng.randint(saved // 4, saved - 1)
    question = (
        f"{name} earns ${earned} a week and spends ${spent} a week on bus fares. After {weeks} "
        f"weeks {name} buys a bike for ${bike}. How many dollars does {name} have left?"
    )
    return question, saved - bike, (weeks, earned, spent, bike)


def purchase(rng: random.Random, name: str) -> Story:
    item = rng.choice(["notebooks", "apples", "tickets", "shirts", "lamps", "books"])
    count, price = rng.randint(3, 19), rng.randint(12, 95)
    question = f"{name} buys {count} {item} at ${price} each. How many dollars does {name} pay?"
    return question, count * price, (count, price)


def distance(rng: random.Random, name: str) -> Story:
    speed, hours = rng.randint(45, 120), rng.randint(3, 12)
    question = (
        f"{name} drives at {speed} km per hour for {hours} hours. How many kilometres does "
        f"{name} drive?"
    )
    return question, speed * hours, (speed, hours)


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

    def _candidate(self, index: int, seed: int) -> Problem:
        rng = random.Random(seed)
        story = rng.choice(self.stories)
        question, answer, numbers = STORIES[story](rng, rng.choice(NAMES))
        return Problem(
            task=self.name,
            index=index,
            question=question,
            answer=str(answer),
            key=f"{story}:{','.join(map(str, numbers))}",
            # A story's kind fixes its number of steps.
            metadata={"story": story, "numbers": list(numbers), DIFFICULTY: story},
        )

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
        )
