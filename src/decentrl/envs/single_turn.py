"""Any Task as a one-turn environment, "task:<task name>": its messages, one reply, its reward.

Episodes are the task's problems, split included, and the reward is exactly `task.reward`, so a
single-turn task evaluated through the environment layer scores as it does on its own.
"""

from __future__ import annotations

from decentrl.envs.base import EnvStep, Message, RecordedAnswer, StopReason
from decentrl.tasks.base import Problem, Reward, Split, Task

TASK_ENVIRONMENT_PREFIX = "task:"


class TaskEpisode:
    max_turns = 1
    max_tool_calls = 0
    tool_calls = 0
    invalid_calls = 0

    def __init__(self, task: Task, problem: Problem) -> None:
        self.task = task
        self.problem = problem
        self.turns = 0
        self.stop_reason: StopReason | None = None
        self.reward: Reward | None = None
        self._messages: list[Message] = task.messages(problem)

    def messages(self) -> list[Message]:
        return [dict(message) for message in self._messages]

    def turn_prefix(self) -> str:
        return ""

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        if self.stop_reason is not None:
            raise RuntimeError(f"episode of problem {self.problem.index} is over; it has one turn")
        self.turns = 1
        self._messages.append({"role": "assistant", "content": assistant_text})
        self.stop_reason = "answer"
        self.reward = self.task.reward(self.problem, assistant_text)
        return EnvStep(messages=[], done=True, reward=self.reward, turn_signal=None)


class TaskEnvironment:
    def __init__(self, task: Task) -> None:
        self.task = task
        self.name = TASK_ENVIRONMENT_PREFIX + task.name

    def problem(self, split: Split, index: int) -> Problem:
        return self.task.problem(split, index)

    def episode(self, split: Split, index: int) -> TaskEpisode:
        return TaskEpisode(self.task, self.problem(split, index))
