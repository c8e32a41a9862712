"""Tool calls in the Hermes/Qwen format SmolLM2 was trained on, and the episode that runs them.

The system prompt describes the tools as JSON schemas inside <tools></tools>. The assistant calls
one by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>; a JSON list of such
objects inside one tag (SmolLM2's own template writes that) is several calls, and an empty list
none. Each call answers with one "tool" message, in the order of the calls: the tool's output, or
"error: ..." saying what was wrong, so that the model can fix the call. A malformed call is not
run and counts as invalid; a well-formed call whose tool fails (a division by zero, say) is a valid
call with an error result.

A reply without any tool call is the final answer and ends the episode. Parsing reads any text,
however hostile, without raising. The calls of an episode share a CPU budget (envs/budget.py): once
it is spent, a call answers "error: tool budget of X s for this episode is spent" without running.

Shaping (`Shaping`, off by default) pays small positive turn signals for the path to an answer: a
call that ran without error and was not made before in the episode earns `valid_call_bonus`; such
a call, or the final answer, earns `used_result_bonus` too when it uses a result of an earlier
turn's call. "Uses a result" is read from the text alone, so a replay pays exactly the same: a
result is a number in a successful call's output (`ToolEpisode.result_text`), sign ignored, other
than 0, 1 and the numbers of the question; a call uses one when that number appears as a number
token in its arguments, the answer when it appears in the answer's text. An episode earns at most
`max_shaping` (< 1) in all, so calling tools never rivals a correct answer: a policy that makes
valid calls and never answers correctly returns at most `max_shaping`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from decentrl.envs.base import EnvStep, Message, RecordedAnswer, StopReason
from decentrl.envs.budget import DEFAULT_TOOL_BUDGET_S, ToolBudget, check_tool_budget
from decentrl.envs.sandbox import ToolResult
from decentrl.tasks.arithmetic import check_int_option
from decentrl.tasks.base import Problem, Reward, is_real

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
ERROR_PREFIX = "error: "
MAX_CALLS_PER_TURN = 4
# Model text quoted back in an error is cut to this length: hostile output must not flood the
# context through its own error messages.
MAX_QUOTE_CHARS = 60
# JSON schema types a tool argument may have, and the Python values that match them.
JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
}
LAST_TURN_NOTE = "note: no more tool calls; your next reply is your final answer."
# A number token as shaping reads it: digits with an optional decimal part, no sign.
NUMBER_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?", re.ASCII)
# Results too common to show that a later call builds on an earlier one.
TRIVIAL_RESULTS = frozenset({"0", "1"})
# A call block, closed or running to the end of the reply.
TOOL_CALL_BLOCK_RE = re.compile(
    re.escape(OPEN_TAG) + r".*?(?:" + re.escape(CLOSE_TAG) + r"|\Z)", re.DOTALL
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    # Argument name -> JSON schema ({"type": "string", "description": ...}); all are required.
    arguments: dict[str, dict[str, str]]
    # Takes arguments already checked against it and the call's time limit in seconds.
    run: Callable[[dict[str, Any], float], ToolResult]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": self.arguments,
                    "required": list(self.arguments),
                },
            },
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCall:
    """One attempted call: a well-formed `call`, or the `error` observation that rejects it."""

    call: ToolCall | None
    error: str | None


def rejection(attempt: ParsedCall) -> str:
    """The error observation of a malformed call."""
    assert attempt.error is not None  # a ParsedCall holds a call or an error
    return attempt.error


def tools_system_prompt(instructions: str, tools: Sequence[Tool]) -> str:
    schemas = "\n".join(json.dumps(tool.schema()) for tool in tools)
    return (
        f"{instructions}\n\n"
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "Each call's result comes back in a tool message, in the order of the calls."
    )


def quoted(text: str) -> str:
    shown = text if len(text) <= MAX_QUOTE_CHARS else text[:MAX_QUOTE_CHARS] + "..."
    return json.dumps(shown)


def json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for name, python_type in JSON_TYPES.items():
        if isinstance(value, python_type):
            return name
    return {list: "array", dict: "object"}.get(type(value), type(value).__name__)


def matches_json_type(value: Any, json_type: str) -> bool:
    # bool is an int subclass in Python but not a JSON number.
    return not isinstance(value, bool) and isinstance(value, JSON_TYPES[json_type])


def check_call(item: Any, tools: Mapping[str, Tool]) -> ParsedCall:
    """One decoded JSON value as a call of one of `tools`, or the error that rejects it."""

    def rejected(reason: str) -> ParsedCall:
        return ParsedCall(call=None, error=ERROR_PREFIX + reason)

    if not isinstance(item, dict):
        return rejected(
            'a tool call must be a JSON object {"name": ..., "arguments": {...}}, '
            f"got {json_type_name(item)}"
        )
    name = item.get("name")
    if not isinstance(name, str):
        return rejected('tool call has no "name" string')
    if name not in tools:
        return rejected(f"unknown tool {quoted(name)}; available tools: {', '.join(tools)}")
    tool = tools[name]
    arguments = item.get("arguments", {})
    if not isinstance(arguments, dict):
        return rejected(f'"arguments" of tool {name} must be a JSON object, got '
                        f"{json_type_name(arguments)}")
    for argument in arguments:
        if argument not in tool.arguments:
            return rejected(f"tool {name} has no argument {quoted(argument)}; its arguments: "
                            f"{', '.join(tool.arguments)}")
    for argument, schema in tool.arguments.items():
        if argument not in arguments:
            return rejected(f"tool {name} is missing argument {argument!r}")
        if not matches_json_type(arguments[argument], schema["type"]):
            return rejected(f"argument {argument!r} of tool {name} must be a {schema['type']}, "
                            f"got {json_type_name(arguments[argument])}")
    return ParsedCall(call=ToolCall(name=name, arguments=arguments), error=None)


def parse_block(body: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
    try:
        decoded = json.loads(body)
    except json.JSONDecodeError as error:
        return [ParsedCall(None, f"{ERROR_PREFIX}tool_call is not valid JSON: {error.msg} at "
                                 f"character {error.pos}")]
    except (ValueError, RecursionError):  # absurdly deep nesting, invalid surrogates
        return [ParsedCall(None, f"{ERROR_PREFIX}tool_call is not valid JSON")]
    items = decoded if isinstance(decoded, list) else [decoded]
    return [check_call(item, tools) for item in items]


def parse_tool_calls(text: str, tools: Mapping[str, Tool],
                     max_calls: int = MAX_CALLS_PER_TURN) -> list[ParsedCall]:
    """Every call attempted in `text`, in order; [] when the text is a final answer."""
    parsed: list[ParsedCall] = []
    position = 0
    while len(parsed) <= max_calls:
        start = text.find(OPEN_TAG, position)
        if text.find(CLOSE_TAG, position, len(text) if start == -1 else start) != -1:
            parsed.append(ParsedCall(None, f"{ERROR_PREFIX}{CLOSE_TAG} without an opening "
                                           f"{OPEN_TAG}"))
        if start == -1:
            break
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end == -1:
            parsed.append(ParsedCall(None, f"{ERROR_PREFIX}{OPEN_TAG} is not closed by "
                                           f"{CLOSE_TAG}"))
            break
        parsed.extend(parse_block(text[start + len(OPEN_TAG):end], tools))
        position = end + len(CLOSE_TAG)
    if len(parsed) > max_calls:
        # One error stands for all the extra calls, however many: a reply with thousands of
        # calls must not answer with thousands of messages.
        too_many = f"more than {max_calls} tool calls in one turn; the rest were not run"
        return parsed[:max_calls] + [ParsedCall(None, ERROR_PREFIX + too_many)]
    return parsed


def strip_tool_calls(text: str) -> str:
    """The prose of a reply: what is left once its tool-call blocks are removed."""
    return TOOL_CALL_BLOCK_RE.sub("", text).replace(CLOSE_TAG, "").strip()


def defanged(text: str) -> str:
    """Environment text with chat-template control markers broken up.

    A tool's output can hold any text (a Python string, a quoted tool name); "<|im_end|>" in a
    tool message would end it early once the conversation is rendered and tokenized.
    """
    return text.replace("<|", "< |")


def written_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as a turn writes it, in the layout `call_opening` prefills."""
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"


def call_opening(tool: Tool) -> str:
    """A call of `tool` written up to the opening quote of its first (string) argument's value."""
    argument = next(iter(tool.arguments), None)
    if argument is None or tool.arguments[argument]["type"] != "string":
        raise ValueError(f"tool {tool.name} has no string argument to prefill")
    call = json.dumps({"name": tool.name, "arguments": {argument: ""}})
    return f"{OPEN_TAG}\n{call[:-3]}"


def check_tool_limits(max_turns: int, max_tool_calls: int, invalid_call_penalty: float,
                      tool_budget_s: float) -> None:
    check_int_option("max_turns", max_turns, 1, 1000)
    check_int_option("max_tool_calls", max_tool_calls, 0, 1000)
    if not (is_real(invalid_call_penalty) and 0.0 <= invalid_call_penalty <= 1.0):
        raise ValueError(f"invalid_call_penalty must be in [0, 1], got {invalid_call_penalty!r}")
    check_tool_budget(tool_budget_s)


@dataclass(frozen=True)
class Shaping:
    """The positive turn signals of an episode (see the module docstring); all 0 pays none."""

    valid_call_bonus: float = 0.0  # per new call that ran without error
    used_result_bonus: float = 0.0  # per such call, or final answer, that uses an earlier result
    max_shaping: float = 0.2  # the most an episode earns in all

    def __post_init__(self) -> None:
        for option in ("valid_call_bonus", "used_result_bonus"):
            value = getattr(self, option)
            if not (is_real(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{option} must be in [0, 1], got {value!r}")
        if not (is_real(self.max_shaping) and 0.0 <= self.max_shaping < 1.0):
            raise ValueError(f"max_shaping must be in [0, 1) so that shaping never rivals a "
                             f"correct answer, got {self.max_shaping!r}")


def canonical_numbers(text: str) -> list[str]:
    """The number tokens of `text` in order, canonical ("007" and "7.0" are "7"). Strings, not
    ints: a model may write digits by the thousand, which int() refuses."""
    numbers = []
    for token in NUMBER_TOKEN_RE.findall(text):
        integer, _, decimal = token.partition(".")
        integer, decimal = integer.lstrip("0") or "0", decimal.rstrip("0")
        numbers.append(f"{integer}.{decimal}" if decimal else integer)
    return numbers


class ToolEpisode(ABC):
    """A conversation in which the assistant may call tools until it replies without a call.

    The reply without a call is the final answer, which `score` turns into the reward. When the
    episode hits a limit instead (`max_turns` replies, or more than `max_tool_calls` calls), the
    calls of the last reply are not run and the reward scores that reply's prose, if any. Each
    turn's signal is -invalid_call_penalty per malformed call plus the turn's `shaping` (0.0 for a
    clean turn without shaping). The calls share `tool_budget` (`tool_budget_s` CPU seconds,
    envs/budget.py); a call it refuses is a valid call whose tool failed.

    With `prefill_first_call` the first assistant turn starts with the opening of a call to the
    first tool, up to the value of its first argument (`call_opening`): a small model that never
    calls tools on its own then has only to write the argument and close the call, so RL gets a
    signal from the first step. `example` is a solved conversation (user, assistant, tool, ...
    assistant) placed before the question: a worked example as real turns, which a small model
    imitates far more readily than one described in the system prompt.
    """

    def __init__(
        self,
        problem: Problem,
        system_prompt: str,
        tools: Sequence[Tool],
        max_turns: int,
        max_tool_calls: int,
        invalid_call_penalty: float,
        prefill_first_call: bool = False,
        example: Sequence[Message] = (),
        tool_budget_s: float = DEFAULT_TOOL_BUDGET_S,
        shaping: Shaping = Shaping(),
    ) -> None:
        self.problem = problem
        self.shaping = shaping
        self.shaping_paid = 0.0
        self.shaped_calls: set[str] = set()  # calls already paid: repeating one earns nothing
        self.results: set[str] = set()  # the non-trivial numbers earlier turns' calls returned
        self.given_numbers = set(canonical_numbers(problem.question))
        self.tools = {tool.name: tool for tool in tools}
        self.tool_budget = ToolBudget(tool_budget_s)
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.invalid_call_penalty = invalid_call_penalty
        self.first_turn_prefix = call_opening(tools[0]) if prefill_first_call else ""
        self.turns = 0
        self.tool_calls = 0
        self.invalid_calls = 0
        self.stop_reason: StopReason | None = None
        self.reward: Reward | None = None
        self._messages: list[Message] = [
            {"role": "system", "content": system_prompt},
            *(dict(message) for message in example),
            {"role": "user", "content": problem.question},
        ]

    @abstractmethod
    def score(self, final_answer: str) -> Reward:
        """The reward for the final answer (the prose of the last reply; may be empty)."""

    def messages(self) -> list[Message]:
        return [dict(message) for message in self._messages]

    def turn_prefix(self) -> str:
        return self.first_turn_prefix if self.turns == 0 else ""

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        if self.stop_reason is not None:
            raise RuntimeError(f"episode of problem {self.problem.index} is over "
                               f"({self.stop_reason}); start a new one")
        self.turns += 1
        self._messages.append({"role": "assistant", "content": assistant_text})
        parsed = parse_tool_calls(assistant_text, self.tools)
        invalid = sum(1 for attempt in parsed if attempt.error is not None)
        self.tool_calls += len(parsed)
        self.invalid_calls += invalid
        penalty_signal = -self.invalid_call_penalty * invalid if invalid else 0.0  # not -0.0
        if not parsed:  # the final answer: no call, so no penalty
            earned = self.shaping.used_result_bonus if self._uses_result(assistant_text) else 0.0
            return self._finish("answer", assistant_text, self._paid(earned))
        if self.tool_calls > self.max_tool_calls:
            return self._finish("tool_call_limit", strip_tool_calls(assistant_text),
                                penalty_signal)
        if self.turns >= self.max_turns:
            return self._finish("turn_limit", strip_tool_calls(assistant_text), penalty_signal)
        observations, succeeded = self._observe(parsed, recorded)
        appended = self._answer(observations)
        self._messages.extend(appended)
        return EnvStep(messages=[dict(m) for m in appended], done=False, reward=None,
                       turn_signal=self._call_shaping(succeeded) + penalty_signal)

    def result_text(self, output: str) -> str:
        """The part of a successful call's output whose numbers are its results (shaping)."""
        return output

    def _uses_result(self, text: str) -> bool:
        return not self.results.isdisjoint(canonical_numbers(text))

    def _call_shaping(self, succeeded: list[tuple[ToolCall, str]]) -> float:
        """The shaping a turn's calls earn; their results count from the next turn on (a call
        cannot use what it has not seen)."""
        earned = 0.0
        for call, _ in succeeded:
            identity = json.dumps([call.name, call.arguments], sort_keys=True)
            if identity in self.shaped_calls:
                continue
            self.shaped_calls.add(identity)
            earned += self.shaping.valid_call_bonus
            arguments = " ".join(str(value) for value in call.arguments.values())
            if self._uses_result(arguments):
                earned += self.shaping.used_result_bonus
        for _, output in succeeded:
            self.results |= set(canonical_numbers(self.result_text(output))) - TRIVIAL_RESULTS \
                - self.given_numbers
        return self._paid(earned)

    def _paid(self, earned: float) -> float:
        """`earned`, cut so that the episode's shaping stays within max_shaping."""
        paid = max(0.0, min(earned, self.shaping.max_shaping - self.shaping_paid))
        self.shaping_paid += paid
        return paid

    def _answer(self, observations: list[str]) -> list[Message]:
        """The tool messages that answer a turn's calls, one per observation."""
        texts = list(observations)
        # The model cannot count its budget; telling it keeps its last turn from being wasted on
        # a call that would not run.
        if self.turns == self.max_turns - 1 or self.tool_calls == self.max_tool_calls:
            texts[-1] = f"{texts[-1]}\n{LAST_TURN_NOTE}"
        return [{"role": "tool", "content": defanged(text)} for text in texts]

    def _observe(self, parsed: list[ParsedCall], recorded: RecordedAnswer | None
                 ) -> tuple[list[str], list[tuple[ToolCall, str]]]:
        """What each attempted call answers, running the well-formed ones within the budget, and
        the calls that ran without error with their outputs. At replay (`recorded`), before each
        call while the budget lasts: if the rollout recorded this call and the rest as refused by
        the budget, the replay refuses them too (envs/budget.py says why that keeps the replay
        identical and cheap)."""
        observations: list[str] = []
        succeeded: list[tuple[ToolCall, str]] = []
        for position, attempt in enumerate(parsed):
            if attempt.call is None:
                observations.append(rejection(attempt))
                continue
            if recorded is not None and not self.tool_budget.exhausted and recorded(
                    self._answer(observations + self._refused(parsed[position:]))):
                self.tool_budget.adopt_exhaustion()
            result = self.tool_budget.run(
                partial(self.tools[attempt.call.name].run, attempt.call.arguments),
                replaying=recorded is not None)
            observations.append(result.output if result.ok else f"{ERROR_PREFIX}{result.error}")
            if result.ok:
                succeeded.append((attempt.call, result.output))
        return observations, succeeded

    def _refused(self, attempts: list[ParsedCall]) -> list[str]:
        """The observations of `attempts` once the budget is spent."""
        refusal = ERROR_PREFIX + self.tool_budget.refusal
        return [refusal if attempt.call is not None else rejection(attempt)
                for attempt in attempts]

    def _finish(self, stop_reason: StopReason, final_answer: str, turn_signal: float) -> EnvStep:
        self.stop_reason = stop_reason
        self.reward = self.score(final_answer)
        return EnvStep(messages=[], done=True, reward=self.reward, turn_signal=turn_signal)
