"""Small environments written the way OpenEnv's own are (its `openenv init` template: pydantic
Action / Observation models, a server-side Environment subclass with reset, step and state), for
the OpenEnv adapter's tests (test_openenv.py): a multi-step number guessing game, a one-step word
reversal, and environments the adapter must refuse."""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics.llm_judge import LLMJudge
from pydantic import Field


class GuessAction(Action):
    """A guess of the secret number."""

    guess: int = Field(..., description="The number guessed")


class GuessObservation(Observation):
    """What the game says about the last guess."""

    feedback: str = Field(default="", description="higher, lower, correct or the rules")
    attempts_left: int = Field(default=0, description="Guesses left")


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess a secret number in [1, max_value] in at most `attempts` guesses; each wrong guess
    says "higher" or "lower". Reward 1.0 for the right guess, 0.0 when the guesses run out."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self, max_value: int = 20, attempts: int = 5, rules_padding: int = 0) -> None:
        super().__init__()
        self.max_value, self.attempts = max_value, attempts
        self.rules_padding = rules_padding  # repeats the rules, to make a long observation
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self._secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, self.max_value)
        rules = f"Guess my number between 1 and {self.max_value}."
        return GuessObservation(feedback=rules * (1 + self.rules_padding),
                                attempts_left=self.attempts, done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        left = self.attempts - self._state.step_count
        if action.guess == self._secret:
            return GuessObservation(feedback="correct", attempts_left=left, done=True, reward=1.0)
        feedback = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(feedback=feedback, attempts_left=left, done=left <= 0,
                                reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class ReverseAction(Action):
    text: str = Field(..., description="The word, reversed")


class ReverseObservation(Observation):
    prompt: str = Field(default="", description="The task")


WORDS = ("planet", "garden", "silver", "rocket", "window", "forest", "candle", "bridge")


class ReverseEnvironment(Environment[ReverseAction, ReverseObservation, State]):
    """One step: reverse the word. Reward 1.0 for the word reversed exactly."""

    def __init__(self) -> None:
        super().__init__()
        self._state, self._word = State(step_count=0), ""

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> ReverseObservation:
        self._word = random.Random(seed).choice(WORDS)
        return ReverseObservation(prompt=f"Reverse the word: {self._word}")

    def step(self, action: ReverseAction, timeout_s: float | None = None,
             **kwargs: Any) -> ReverseObservation:
        self._state.step_count += 1
        solved = action.text == self._word[::-1]
        return ReverseObservation(prompt="", done=True, reward=1.0 if solved else 0.0)

    @property
    def state(self) -> State:
        return self._state


def parse_guess(reply: str) -> GuessAction:
    """A reply's last integer as a guess (a parse function the adapter takes by import path)."""
    numbers = re.findall(r"-?\d+", reply)
    if not numbers:
        raise ValueError("write the guess as a number")
    return GuessAction(guess=int(numbers[-1]))


def render_guess(observation: GuessObservation) -> str:
    return f"{observation.feedback} ({observation.attempts_left} guesses left)"


class UnseededEnvironment(GuessNumberEnvironment):
    """Ignores the seed: its first observation names a fresh random episode id."""

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        observation = super().reset(seed=None)
        observation.feedback += f" Episode {uuid.uuid4()}."
        return observation


class SeedlessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """A reset that takes no seed, as in OpenEnv's echo template."""

    def reset(self) -> GuessObservation:  # type: ignore[override]
        return GuessObservation(feedback="ready")

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        return GuessObservation(feedback="ok", done=True)

    @property
    def state(self) -> State:
        return State()


class JudgedEnvironment(GuessNumberEnvironment):
    """Scored by a language model over the network (OpenEnv's LLMJudge rubric)."""

    def __init__(self) -> None:
        super().__init__()
        # No client: the adapter refuses the environment before anything could call it.
        self.rubric = LLMJudge("Score {action} given {observation}",
                               client=None)  # type: ignore[arg-type]


class CrashingEnvironment(GuessNumberEnvironment):
    """Raises on a guess of 0, as an environment refusing an action it cannot take."""

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        if action.guess == 0:
            raise RuntimeError("zero is not on the board")
        return super().step(action)
