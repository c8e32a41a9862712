"""Countdown with a checking tool ("agentic-countdown"): reach a target from given numbers.

Why countdown and not a lookup task: searching for an expression is genuinely multi-step (propose,
check, revise), the tool's feedback is what drives the search, and the problems are exactly those
of the single-turn task "rg:countdown" with the same config (the same seeds, the same split keys),
so the agentic and the single-turn setting can be compared on the same held-out problems.

The tool `check` evaluates a candidate expression in the sandbox and reports its value, whether it
uses only the given numbers (each at most once) and whether it reaches the target. The final
answer is an expression inside <answer></answer>. With `require_check` (the default) the episode
is solved only by an answer the tool has confirmed in this episode (whitespace aside): the answer
cannot be reached without the tool's results, which is what the environment is for. Without it,
any answer that reaches the target with the given numbers solves it.

The numbers per problem come from `config`'s "min_numbers" and "max_numbers" (reasoning-gym
accepts 2 and up; the difficulty bucket is "N numbers"), so {"min_numbers": 2, "max_numbers": 4}
mixes three levels in one environment for a curriculum to pick from.

The environment is `Demonstrating`: `solve_countdown` finds an expression by brute force (exact
fractions, integer intermediate results first); a demonstration checks it, after as many wrong
candidates as `revisions` draws (by default one, 3 times in 10; none otherwise), and answers with
it. A wrong candidate is a near miss built from the numbers (`wrong_candidates`), so the
transcript shows a search: check, read the value, revise. `valid_call_bonus`, `used_result_bonus`
and `max_shaping` set the reward shaping of tool_calls.py (off by default; a check's result is its
value).

reasoning-gym's own countdown scorer is not used: it parses answers with sympy's parse_expr,
which evaluates model text in this process, and it demands every number be used.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Any

from reasoning_gym.utils import extract_answer as extract_tagged_answer

from decentrl.envs.budget import CALL_TIMEOUT_S, DEFAULT_TOOL_BUDGET_S
from decentrl.envs.sandbox import ToolResult, run_expression
from decentrl.envs.tool_calls import (
    Shaping,
    Tool,
    ToolEpisode,
    check_tool_limits,
    tools_system_prompt,
    written_call,
)
from decentrl.tasks.base import (
    DIFFICULTY,
    Problem,
    Reward,
    Split,
    check_heldout_fraction,
    is_real,
)
from decentrl.tasks.reasoning_gym import ReasoningGymTask

# Smaller than reasoning-gym's default (4-6 numbers up to 100, targets 100-999) so that a 135M
# model finds solutions now and then; any option given in `config` overrides these.
DEFAULT_CONFIG: dict[str, Any] = {
    "min_numbers": 3,
    "max_numbers": 4,
    "max_value": 25,
    "min_target": 10,
    "max_target": 100,
}
# Integers, + - * /, parentheses and spaces; "**" and "//" are not countdown operations.
EXPRESSION_RE = re.compile(r"[\d\s+\-*/()]+", re.ASCII)  # ASCII: "٣" is a \d too
FORBIDDEN_OPERATORS = ("**", "//")
INTEGER_RE = re.compile(r"\d+", re.ASCII)
TARGET_TOLERANCE = 1e-6  # "/" gives floats; 10 / 3 * 3 must still count as 10

INSTRUCTIONS = (
    "You play countdown: combine the given numbers with + - * / and parentheses to make the "
    "target. Each number may be used at most once; not all of them need to be used. Check "
    "candidate expressions with the check tool. When the tool confirms an expression reaches "
    "the target, reply without a tool call and give that expression inside <answer></answer> "
    "tags."
)


CHECK_TOOL_NAME = "check"
# The chance that a demonstration checks 0, 1, 2, ... wrong candidates before the right one (the
# `revisions` option): by default 3 in 10 first check one wrong candidate, to show how to revise.
DEFAULT_REVISIONS = (0.7, 0.3)
MAX_REVISIONS = 5  # wrong candidates in one demonstration at most
# Random expressions drawn to pick a demonstration's wrong candidates from (the nearest misses).
CANDIDATE_POOL = 48
CHECK_PHRASES = ("Let me check {expression}.", "I'll try {expression}.",
                 "Maybe {expression} works.", "Checking {expression}.")
REVISE_PHRASES = ("That is {value}, not {target}. Let me try {expression}.",
                  "{value} misses {target}; next, {expression}.",
                  "Not {target} yet. Another try: {expression}.")
ANSWER_PHRASES = ("The tool confirms that {expression} makes {target}.",
                  "{expression} reaches {target}.", "Confirmed: {expression} = {target}.")
# Precedence of what an expression is at its top: a number binds tightest.
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "number": 3}


@dataclass(frozen=True)
class Term:
    """A value made from some of the numbers, and the expression that makes it."""

    value: Fraction
    expression: str
    top: str  # the expression's outermost operator, or "number"


def number_term(number: int) -> Term:
    return Term(Fraction(number), str(number), "number")


def joined(left: Term, operator: str, right: Term) -> Term:
    """`left operator right`, parenthesised only where Python needs it."""
    precedence = PRECEDENCE[operator]
    left_text = f"({left.expression})" if PRECEDENCE[left.top] < precedence else left.expression
    # a - (b - c) and a / (b * c): a right operand of the same level needs them after - and /.
    right_bracketed = PRECEDENCE[right.top] < precedence or (
        PRECEDENCE[right.top] == precedence and operator in "-/")
    right_text = f"({right.expression})" if right_bracketed else right.expression
    if operator == "+":
        value = left.value + right.value
    elif operator == "-":
        value = left.value - right.value
    elif operator == "*":
        value = left.value * right.value
    else:
        value = left.value / right.value
    return Term(value, f"{left_text} {operator} {right_text}", operator)


def combined(a: Term, b: Term, naturals_only: bool) -> Iterator[Term]:
    """Every term one operation makes of a and b (either order)."""
    yield joined(a, "+", b)
    yield joined(a, "*", b)
    for left, right in ((a, b), (b, a)):
        if not naturals_only or left.value >= right.value:
            yield joined(left, "-", right)
        if right.value != 0 and (not naturals_only or left.value % right.value == 0):
            yield joined(left, "/", right)


def search(terms: list[Term], target: int, naturals_only: bool,
           seen: set[tuple[Fraction, ...]]) -> str | None:
    for term in terms:
        if term.value == target:
            return term.expression
    values = tuple(sorted(term.value for term in terms))
    if len(terms) < 2 or values in seen:  # the same values reach the same targets
        return None
    seen.add(values)
    for i, j in combinations(range(len(terms)), 2):
        rest = [term for k, term in enumerate(terms) if k not in (i, j)]
        for term in combined(terms[i], terms[j], naturals_only):
            found = search([*rest, term], target, naturals_only, seen)
            if found is not None:
                return found
    return None


def wrong_candidates(numbers: list[int], target: int, count: int,
                     rng: random.Random) -> list[Term]:
    """Up to `count` plausible wrong candidates, farthest from the target first: expressions of
    all the numbers or all but one (two at least), each at most once, + - * with natural
    intermediate results, values distinct and none the target, 0 or one of the numbers. Drawn at random, then the nearest misses kept: a search that closes in.
    Fewer where the numbers make fewer such values."""
    found: dict[Fraction, Term] = {}
    for _ in range(CANDIDATE_POOL):
        size = rng.randint(max(2, len(numbers) - 1), len(numbers))
        picked = [number_term(number) for number in rng.sample(numbers, size)]
        term = picked[0]
        for other in picked[1:]:
            term = rng.choice([t for t in combined(term, other, naturals_only=True)
                               if t.top != "/"])
        if term.value not in (0, target) and term.value not in numbers:
            found.setdefault(term.value, term)
    nearest = sorted(found.values(), key=lambda term: abs(term.value - target))
    kept = rng.sample(nearest[:2 * count], min(count, len(nearest)))
    return sorted(kept, key=lambda term: -abs(term.value - target))


def revisions_drawn(weights: tuple[float, ...], rng: random.Random) -> int:
    """How many wrong candidates a demonstration checks: k with chance weights[k] / sum. One
    uniform draw, counted down from the most: DEFAULT_REVISIONS revises iff it is below 0.3."""
    draw, total = rng.random() * sum(weights), 0.0
    for count in range(len(weights) - 1, 0, -1):
        total += weights[count]
        if draw < total:
            return count
    return next(count for count, weight in enumerate(weights) if weight > 0)  # rounding aside, 0


def check_revisions(revisions: object) -> tuple[float, ...]:
    if (not isinstance(revisions, (list, tuple)) or not 1 <= len(revisions) <= MAX_REVISIONS + 1
            or not all(is_real(w) and 0 <= w < math.inf for w in revisions)
            or sum(revisions) <= 0):
        raise ValueError(f"revisions must be a list of 1 to {MAX_REVISIONS + 1} weights >= 0, "
                         "not all 0 (the chance of 0, 1, 2, ... wrong candidates before the "
                         f"right one), got {revisions!r}")
    return tuple(float(w) for w in revisions)


def solve_countdown(numbers: list[int], target: int) -> str | None:
    """An expression of some of `numbers` (each at most once), + - * / and parentheses, whose
    exact value is `target`; one whose every intermediate result is a natural number if there
    is one. None when there is none."""
    terms = [number_term(number) for number in numbers]
    for naturals_only in (True, False):
        found = search(terms, target, naturals_only, set())
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Check:
    result: ToolResult  # what the tool tells the model
    solves: bool  # reaches the target using only the given numbers, each at most once


def normalized(expression: str) -> str:
    return "".join(expression.split())


def overused_numbers(used: list[int], numbers: list[int]) -> str | None:
    """Why `used` is not drawn from `numbers` (each at most once), or None when it is."""
    available = Counter(numbers)
    for number, count in sorted(Counter(used).items()):
        if available[number] == 0:
            return f"{number} is not one of the numbers"
        if count > available[number]:
            return f"{number} is used {count} times but given {available[number]} time(s)"
    return None


def check_expression(expression: str, numbers: list[int], target: int,
                     timeout_s: float = CALL_TIMEOUT_S) -> Check:
    if not EXPRESSION_RE.fullmatch(expression) or any(
        operator in expression for operator in FORBIDDEN_OPERATORS
    ):
        return Check(
            ToolResult(ok=False, output="", error="an expression may only hold integers, "
                       "+ - * /, parentheses and spaces"),
            solves=False,
        )
    evaluated = run_expression(expression, timeout_s=timeout_s)
    if not evaluated.ok:
        return Check(evaluated, solves=False)
    try:
        value = float(evaluated.output)
    except ValueError:  # a value too long to show in full
        value = math.nan
    reaches = abs(value - target) <= TARGET_TOLERANCE
    overuse = overused_numbers([int(n) for n in INTEGER_RE.findall(expression)], numbers)
    numbers_verdict = "yes" if overuse is None else f"no ({overuse})"
    report = (
        f"value: {evaluated.output}\n"
        f"uses only the given numbers, each at most once: {numbers_verdict}\n"
        f"reaches the target {target}: {'yes' if reaches else 'no'}"
    )
    return Check(ToolResult(ok=True, output=report, error=None, cpu_s=evaluated.cpu_s),
                 solves=reaches and overuse is None)


class CountdownEpisode(ToolEpisode):
    def __init__(
        self,
        problem: Problem,
        require_check: bool,
        max_turns: int,
        max_tool_calls: int,
        invalid_call_penalty: float,
        prefill_first_call: bool = False,
        tool_budget_s: float = DEFAULT_TOOL_BUDGET_S,
        shaping: Shaping = Shaping(),
    ) -> None:
        self.numbers: list[int] = problem.metadata["numbers"]
        self.target: int = problem.metadata["target"]
        self.require_check = require_check
        self.confirmed: set[str] = set()  # normalized expressions the tool found to solve it
        tool = Tool(
            name=CHECK_TOOL_NAME,
            description="Evaluate a candidate countdown expression; report its value, whether "
            "it uses only the given numbers (each at most once) and whether it reaches the "
            "target.",
            arguments={"expression": {"type": "string", "description": "e.g. (25 - 5) * 4"}},
            run=self.run_check,
        )
        super().__init__(
            problem,
            tools_system_prompt(INSTRUCTIONS, [tool]),
            [tool],
            max_turns=max_turns,
            max_tool_calls=max_tool_calls,
            invalid_call_penalty=invalid_call_penalty,
            prefill_first_call=prefill_first_call,
            tool_budget_s=tool_budget_s,
            shaping=shaping,
        )

    def result_text(self, output: str) -> str:
        """A check's result is its value line; the rest restates the target and counts."""
        return output.split("\n", 1)[0]

    def run_check(self, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
        check = check_expression(arguments["expression"], self.numbers, self.target, timeout_s)
        if check.solves:
            self.confirmed.add(normalized(arguments["expression"]))
        return check.result

    def score(self, final_answer: str) -> Reward:
        answer = extract_tagged_answer(final_answer)
        if answer is None:
            solved = False
        elif self.require_check:
            solved = normalized(answer) in self.confirmed
        else:
            # Outside the tool budget: one check per episode, of integers and + - * / only,
            # which the sandbox evaluates in microseconds after its startup.
            solved = check_expression(answer, self.numbers, self.target).solves
        return Reward(correct=1.0 if solved else 0.0, format=0.0)


class CountdownEnvironment:
    name = "agentic-countdown"

    def __init__(
        self,
        heldout_fraction: float = 0.1,
        config: dict[str, Any] | None = None,
        require_check: bool = True,
        max_turns: int = 8,
        max_tool_calls: int = 8,
        invalid_call_penalty: float = 0.1,
        prefill_first_call: bool = False,
        tool_budget_s: float = DEFAULT_TOOL_BUDGET_S,
        valid_call_bonus: float = 0.0,
        used_result_bonus: float = 0.0,
        max_shaping: float = 0.2,
        revisions: list[float] | tuple[float, ...] = DEFAULT_REVISIONS,
    ) -> None:
        check_heldout_fraction(heldout_fraction)
        check_tool_limits(max_turns, max_tool_calls, invalid_call_penalty, tool_budget_s)
        self.revisions = check_revisions(revisions)
        for option, value in (("require_check", require_check),
                              ("prefill_first_call", prefill_first_call)):
            if not isinstance(value, bool):
                raise ValueError(f"{option} must be true or false, got {value!r}")
        self.prefill_first_call = prefill_first_call
        # Problems, seeds and split keys are those of "rg:countdown" with the same config.
        self.puzzles = ReasoningGymTask(
            "countdown",
            heldout_fraction=heldout_fraction,
            config={**DEFAULT_CONFIG, **(config or {})},
        )
        self.require_check = require_check
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.invalid_call_penalty = invalid_call_penalty
        self.tool_budget_s = tool_budget_s
        self.shaping = Shaping(valid_call_bonus, used_result_bonus, max_shaping)

    def problem(self, split: Split, index: int) -> Problem:
        puzzle = self.puzzles.problem(split, index)
        numbers = puzzle.metadata["entry"]["metadata"]["numbers"]
        target = puzzle.metadata["entry"]["metadata"]["target"]
        return Problem(
            task=self.name,
            index=index,
            question=f"Numbers: {', '.join(map(str, numbers))}\nTarget: {target}",
            answer=puzzle.answer,  # one solution; others count as well
            key=puzzle.key,
            metadata={"numbers": numbers, "target": target, "seed": puzzle.metadata["seed"],
                      DIFFICULTY: f"{len(numbers)} numbers"},
        )

    def episode(self, split: Split, index: int) -> CountdownEpisode:
        return CountdownEpisode(
            self.problem(split, index),
            self.require_check,
            max_turns=self.max_turns,
            max_tool_calls=self.max_tool_calls,
            invalid_call_penalty=self.invalid_call_penalty,
            prefill_first_call=self.prefill_first_call,
            tool_budget_s=self.tool_budget_s,
            shaping=self.shaping,
        )

    def demonstration(self, problem: Problem, rng: random.Random) -> list[str]:
        """Check a solution after as many wrong candidates as `revisions` draws (at most what
        the turn and call limits leave room for, and the numbers make), then answer with it
        (base.Demonstrating)."""
        if self.max_turns < 2 or self.max_tool_calls < 1:
            raise ValueError(f"a countdown demonstration needs max_turns >= 2 and "
                             f"max_tool_calls >= 1; this environment has {self.max_turns} "
                             f"and {self.max_tool_calls}")
        numbers, target = problem.metadata["numbers"], problem.metadata["target"]
        # reasoning-gym builds every problem from a solution, so the fallback is one.
        solution = solve_countdown(numbers, target) or problem.answer
        candidates: list[Term] = []
        # Room: one turn for the right check and one for the answer, one call for the right check.
        room = min(self.max_turns - 2, self.max_tool_calls - 1, len(self.revisions) - 1)
        if room >= 1:
            count = min(room, revisions_drawn(self.revisions, rng))
            if count:
                candidates = wrong_candidates(numbers, target, count, rng)
        turns = []
        for position, expression in enumerate([*(t.expression for t in candidates), solution]):
            call = written_call(CHECK_TOOL_NAME, {"expression": expression})
            if position == 0 and self.prefill_first_call:
                turns.append(call)  # the prefill is the call's opening: no prose before it
            elif position == 0:
                turns.append(f"{rng.choice(CHECK_PHRASES).format(expression=expression)}\n{call}")
            else:
                prose = rng.choice(REVISE_PHRASES).format(
                    value=candidates[position - 1].value, target=target, expression=expression)
                turns.append(f"{prose}\n{call}")
        answer = rng.choice(ANSWER_PHRASES).format(expression=solution, target=target)
        turns.append(f"{answer}\n<answer>{solution}</answer>")
        return turns
