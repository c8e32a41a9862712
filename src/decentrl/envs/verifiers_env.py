"""An environment written for prime-rl's `verifiers` library as a decentrl environment,
"verifiers:<env id>": `vf.load_environment(env_id, **env_args)` builds it, as `vf-eval` does.

decentrl writes the assistant turns; the adapter never calls the library's model client. It
drives the environment's own turn loop: each assistant turn goes into the rollout state as a
trajectory step, the environment's `is_completed` (its stop conditions, max_turns included)
decides whether the episode ends, and if not its `env_response` (through `get_prompt_messages`)
gives the messages forced in before the next turn. At the end the state is rendered and cleaned
up as the library does and the rubric's reward functions score it: their weighted sum is the
episode's `Reward.correct` (solved at 1.0 or more). Zero-weight functions are metrics and not
run. Every call into the environment runs on a private event loop (verifiers_checks.py) within
`call_timeout_s`; an environment call that raises or overruns ends the episode with reward 0
and a warning, and so does a reward function: no partial sum. A step the environment takes in
the coordinator's replay is the same code on the same transcript, so the same answer.

Problems are the rows of the environment's dataset (its prompt, system prompt and few-shot
included). With an eval dataset as well, that one is the held-out split and the training rows
whose prompt also appears there are dropped; otherwise one dataset is split by a hash of each
row's prompt (`split_of`), as decentrl's tasks are. Index i of a split is row i of a fixed
shuffle of the split's rows, modulo their number.

Bounds: at most `max_turns` assistant turns (the smaller of it and the environment's own), and
at most `max_env_chars` characters of environment messages after a turn (a message is cut
there, the ones after it dropped), which the environment's state then holds as the model saw
them. What cannot be replayed is refused when the environment is built (verifiers_checks.py),
including one whose episodes differ when the same transcript is played twice (`probe`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import random
import signal
from dataclasses import dataclass
from typing import Any

from decentrl.envs.base import EnvStep, Message, RecordedAnswer, StopReason, run_episode
from decentrl.envs.verifiers_checks import (
    EnvironmentFailure,
    EventLoopThread,
    UnreplayableEnvironment,
    leaf_rubrics,
    refusal_reasons,
)
from decentrl.tasks.base import (
    Problem,
    Reward,
    Split,
    check_heldout_fraction,
    check_split,
    split_of,
)

log = logging.getLogger(__name__)

VERIFIERS_PREFIX = "verifiers:"
MAX_TURNS_LIMIT = 64
CUT_MARK = " [...]"  # ends an environment message cut by max_env_chars
NO_REWARD = Reward(correct=0.0, format=0.0)


@dataclass(frozen=True)
class Row:
    """One dataset row as the library hands it to a rollout, and the problem it makes."""

    fields: dict[str, Any]  # prompt, answer, info, example_id, ...
    question: str
    answer: str
    key: str
    source: str  # "dataset" or "eval_dataset"


def message_text(message: Any) -> str:
    """The text of a verifiers message; text parts only (an image has no text to replay)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text":
            raise EnvironmentFailure(f"a {message.role} message has a {kind!r} part; only text "
                                     "is adapted")
        texts.append(part.get("text") or "")
    return "\n".join(texts)


def as_chat(messages: list[Any]) -> list[Message]:
    return [{"role": message.role, "content": message_text(message)} for message in messages]


def bounded(messages: list[Any], max_chars: int) -> list[Any]:
    """The messages within `max_chars` characters of text: the one that crosses the limit is
    cut (and marked), those after it dropped."""
    kept, left = [], max_chars
    for message in messages:
        if left <= 0:
            break
        text = message_text(message)
        if len(text) > left:
            message = message.model_copy(update={"content": text[:left] + CUT_MARK})
        kept.append(message)
        left -= len(text)
    return kept


def dataset_rows(dataset: Any, source: str) -> list[Row]:
    from verifiers.utils.message_utils import normalize_messages

    rows = []
    for fields in dataset.to_list():
        prompt = normalize_messages(fields["prompt"], field_name="prompt")
        shown = [m for m in as_chat(prompt) if m["role"] != "system"]
        users = [m["content"] for m in shown if m["role"] == "user"]
        # The key leaves the system prompt out: rewording it must not move rows between splits.
        key = json.dumps(fields.get("question", shown), sort_keys=True)
        rows.append(Row(fields, users[-1] if users else "", str(fields.get("answer", "")), key,
                        source))
    return rows


async def weighted_reward(rubric: Any, state: Any) -> float:
    """The rubric's weighted sum over its reward functions, called as `Rubric` calls them (each
    gets the score objects its signature names); an exception propagates."""
    from verifiers.utils.async_utils import maybe_call_with_named_args

    total = 0.0
    for leaf in leaf_rubrics(rubric):
        objects = leaf.score_objects(state)
        for function, weight in zip(leaf.funcs, leaf.weights):
            if weight != 0:
                total += weight * float(await maybe_call_with_named_args(function, **objects))
    if not math.isfinite(total):
        raise ValueError(f"the reward is {total}")
    return total


class VerifiersEpisode:
    max_tool_calls = 0  # the environment's messages are not decentrl tool calls
    tool_calls = 0
    invalid_calls = 0

    def __init__(self, environment: VerifiersEnvironment, problem: Problem, row: Row) -> None:
        import verifiers as vf
        from verifiers.types import RolloutTiming, flatten_task_input
        from verifiers.utils.message_utils import normalize_messages

        self.environment, self.problem = environment, problem
        self.max_turns = environment.max_turns
        self.turns = 0
        self.stop_reason: StopReason | None = None
        self.reward: Reward | None = None
        fields = json.loads(json.dumps(row.fields))  # a private copy the environment may change
        if isinstance(fields.get("info"), str):
            fields["info"] = json.loads(fields["info"])
        task = flatten_task_input(fields)
        state = vf.State(input=task)
        state.update(task=task, client=None, model="decentrl", sampling_args=None,
                     is_completed=False, is_truncated=False, tool_defs=[], trajectory=[],
                     completion=None, reward=None, metrics=None, error=None,
                     final_env_response=None, timing=RolloutTiming(),
                     # Derived from the problem, not drawn: an environment may seed from it.
                     trajectory_id=hashlib.sha256(row.key.encode()).hexdigest()[:32])
        state["prompt"] = normalize_messages(fields["prompt"], field_name="prompt")
        self._state = state
        self._prompt: list[Any] = list(state["prompt"])  # what the model sees before its turn
        self._messages = as_chat(self._prompt)
        self._failure: str | None = None
        self._call(self._setup(), "setup_state")

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        if self.stop_reason is not None:
            raise RuntimeError(f"episode of problem {self.problem.index} is over "
                               f"({self.stop_reason})")
        self._messages.append({"role": "assistant", "content": assistant_text})
        self.turns += 1
        answer = self._call(self._advance(assistant_text), "env_response")
        if answer is not None and self._failure is None:
            if self.turns < self.max_turns:
                shown = as_chat(answer)
                self._messages += shown
                return EnvStep(messages=shown, done=False, reward=None, turn_signal=None)
            self.stop_reason = "turn_limit"
        self.stop_reason = self.stop_reason or "answer"
        score = self._call(self._finish(), "scoring")
        self.reward = (NO_REWARD if self._failure is not None or score is None
                       else Reward(correct=score, format=0.0))
        return EnvStep(messages=[], done=True, reward=self.reward, turn_signal=None)

    def messages(self) -> list[Message]:
        return [dict(message) for message in self._messages]

    def turn_prefix(self) -> str:
        return ""

    def _call(self, coroutine: Any, what: str) -> Any:
        """The coroutine's result on the environment's loop; None once the environment failed."""
        if self._failure is not None:
            coroutine.close()
            return None
        try:
            return self.environment.loop.run(coroutine, self.environment.call_timeout_s,
                                             f"{self.environment.name}'s {what}")
        except EnvironmentFailure as failure:
            self._failure = str(failure)
            log.warning("episode %s of %s scores 0: %s", self.problem.index,
                        self.environment.name, failure)
            return None

    async def _setup(self) -> None:
        self._state = await self.environment.env.setup_state(self._state) or self._state

    async def _advance(self, assistant_text: str) -> list[Any] | None:
        """Record the turn; the environment's messages for the next one, or None when over."""
        import verifiers as vf
        from verifiers.utils.message_utils import maybe_normalize_messages

        env, state = self.environment.env, self._state
        completion = [vf.AssistantMessage(content=assistant_text)]
        await env.add_trajectory_step(state, vf.TrajectoryStep(
            prompt=self._prompt, completion=completion, response=None, tokens=None, reward=None,
            advantage=None, is_truncated=False, trajectory_id=state["trajectory_id"],
            extras={}))
        if await env.is_completed(state):
            return None
        following = maybe_normalize_messages(await env.get_prompt_messages(state),
                                             field_name="prompt_messages")
        if state.get("final_env_response") is not None:
            return None  # the final response is scored, never shown to the model
        seen = len(self._prompt) + 1
        if as_chat(following[:seen]) != as_chat([*self._prompt, *completion]):
            raise EnvironmentFailure("get_prompt_messages rewrote the conversation; decentrl "
                                     "only appends to it")
        answer = bounded(following[seen:], self.environment.max_env_chars)
        self._prompt = [*following[:seen], *answer]
        return answer

    async def _finish(self) -> float:
        env, state = self.environment.env, self._state
        await env.cleanup(state)  # renders state["completion"], then the env's own handlers
        score = await weighted_reward(env.rubric, state)
        await env.rubric.cleanup(state)
        return score


class VerifiersEnvironment:
    def __init__(self, name: str, env: Any, heldout_fraction: float = 0.1, max_turns: int = 8,
                 max_env_chars: int = 4000, call_timeout_s: float = 30.0,
                 probe_problems: int = 2) -> None:
        check_heldout_fraction(heldout_fraction)
        if not (isinstance(max_turns, int) and 1 <= max_turns <= MAX_TURNS_LIMIT):
            raise ValueError(f"max_turns must be in [1, {MAX_TURNS_LIMIT}], got {max_turns!r}")
        if not (isinstance(max_env_chars, int) and max_env_chars >= 1):
            raise ValueError(f"max_env_chars must be an int >= 1, got {max_env_chars!r}")
        if not (isinstance(call_timeout_s, (int, float)) and call_timeout_s > 0):
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s!r}")
        reasons = refusal_reasons(env)
        if reasons:
            raise UnreplayableEnvironment(f"environment {name!r} cannot be replayed by the "
                                          f"coordinator: {'; '.join(reasons)}")
        self.name, self.env = name, env
        own_limit = env.max_turns if env.max_turns > 0 else max_turns
        self.max_turns = min(max_turns, own_limit)
        self.max_env_chars, self.call_timeout_s = max_env_chars, call_timeout_s
        self.loop = EventLoopThread(name)
        self.rows = self._split_rows(heldout_fraction)
        self.probe(probe_problems)

    def _split_rows(self, heldout_fraction: float) -> dict[Split, list[Row]]:
        train_set, eval_set = self.env.build_dataset(), self.env.build_eval_dataset()
        train = dataset_rows(train_set, "dataset") if train_set is not None else []
        held = dataset_rows(eval_set, "eval_dataset") if eval_set is not None else []
        if train and held:
            held_keys = {row.key for row in held}
            rows: dict[Split, list[Row]] = {
                "train": [row for row in train if row.key not in held_keys], "heldout": held}
        else:
            rows = {"train": [], "heldout": []}
            for row in train or held:
                rows[split_of(row.key, heldout_fraction)].append(row)
        for split, chosen in rows.items():
            random.Random(f"{self.name}:{split}").shuffle(chosen)  # a str seed is stable
        return rows

    def _row(self, split: Split, index: int) -> Row:
        check_split(split, index)
        rows = self.rows[split]
        if not rows:
            raise ValueError(f"environment {self.name!r} has no {split} rows")
        return rows[index % len(rows)]

    def problem(self, split: Split, index: int) -> Problem:
        row = self._row(split, index)
        return Problem(task=self.name, index=index, question=row.question, answer=row.answer,
                       key=row.key, metadata={"source": row.source,
                                              "example_id": row.fields.get("example_id")})

    def episode(self, split: Split, index: int) -> VerifiersEpisode:
        return VerifiersEpisode(self, self.problem(split, index), self._row(split, index))

    def probe(self, problems: int) -> None:
        """Play the first `problems` training episodes twice, every turn the reference answer;
        refuse the environment if the two plays differ: the coordinator's replay could not
        reproduce its episodes."""
        for index in range(min(problems, len(self.rows["train"]))):
            plays = [run_episode(self.episode("train", index), lambda _, i=index:
                                 self.problem("train", i).answer) for _ in range(2)]
            first, second = ((play.messages, play.reward, play.stop_reason) for play in plays)
            if first != second:
                raise UnreplayableEnvironment(
                    f"environment {self.name!r} is not deterministic given the transcript: "
                    f"training problem {index} played twice on the same assistant turns gave "
                    "different messages or rewards, so the coordinator's replay could not "
                    "recompute its episodes")


def make_verifiers_environment(name: str, env_args: dict[str, Any] | None = None,
                               **options: Any) -> VerifiersEnvironment:
    """"verifiers:<env id>": the environment `load_environment(**env_args)` of the installed
    module <env id> (dashes read as underscores, as verifiers reads them) builds, adapted with
    `options` (VerifiersEnvironment's)."""
    try:
        import verifiers as vf
    except ImportError as error:
        raise ValueError(f"{name!r} needs the verifiers library: pip install "
                         "'decentrl[envs]'") from error
    env_id = name.removeprefix(VERIFIERS_PREFIX)
    known_options = list(inspect.signature(VerifiersEnvironment).parameters)[2:]  # not name, env
    for option in options:
        if option not in known_options:
            raise ValueError(f"environment {name!r} has no option {option!r}; its options: "
                             f"env_args (load_environment's arguments), {', '.join(known_options)}")
    # The library installs its own SIGINT/SIGTERM handlers as an environment is built; the
    # process's handlers (a coordinator's shutdown) are put back.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = vf.load_environment(env_id, **(env_args or {}))
    except ValueError as error:
        raise ValueError(f"unknown verifiers environment {env_id!r}: name one as "
                         f"{VERIFIERS_PREFIX}<module>, a module with load_environment(**env_args)"
                         " that is installed or on the path (the environment's package)"
                         ) from error
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return VerifiersEnvironment(name, env, **options)
