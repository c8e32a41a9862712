"""Small environments written as one writes them for the `verifiers` library: a single-turn sum
with an XML parser and a weighted rubric, and a multi-turn number guessing game whose
env_response answers "higher"/"lower" and ends the game with a final response. Their datasets
are tiny in-memory `datasets.Dataset`s. `load_environment(game=...)` is the module's entry point,
as an environment package's is ("verifiers:tests.unit.envs.verifiers_fixtures")."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import verifiers as vf
from datasets import Dataset

SUM_PAIRS = [(a, b) for a in range(2, 9) for b in range(3, 6)]  # 21 rows
SECRETS = [7, 13, 4, 18, 11, 2, 15, 9]


def sum_dataset() -> Dataset:
    return Dataset.from_list([{"question": f"What is {a} + {b}?", "answer": str(a + b)}
                              for a, b in SUM_PAIRS])


def load_sums(reward_fails: bool = False, noisy: bool = False) -> vf.SingleTurnEnv:
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(completion: Any, answer: str) -> float:
        if reward_fails:
            raise RuntimeError("the grader is down")
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def luck() -> float:
        return random.random()

    funcs = [correct_answer, parser.get_format_reward_func()] + ([luck] if noisy else [])
    rubric = vf.Rubric(funcs=funcs, weights=[1.0, 0.2, 1.0][:len(funcs)], parser=parser)
    return vf.SingleTurnEnv(dataset=sum_dataset(), system_prompt="Answer in <answer></answer>.",
                            parser=parser, rubric=rubric)


class GuessTheNumberEnv(vf.MultiTurnEnv):
    def __init__(self, padding: int = 0, sleep_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.padding, self.sleep_s = padding, sleep_s

    async def setup_state(self, state: vf.State) -> vf.State:
        state["guesses"] = 0
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State,
                           **kwargs: Any) -> vf.Messages:
        await asyncio.sleep(self.sleep_s)
        state["guesses"] += 1
        words = str(messages[-1].content).split()
        guess = int(words[-1]) if words and words[-1].isdigit() else None
        secret = int(state["answer"])
        if guess == secret:
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="Correct!")]
            return state["final_env_response"]
        hint = "Give a number." if guess is None else "Higher." if guess < secret else "Lower."
        return [vf.UserMessage(content=hint + " " * self.padding + "x" * self.padding)]


def solved(state: vf.State) -> float:
    return 1.0 if state.get("solved") else 0.0


def load_guess(padding: int = 0, sleep_s: float = 0.0, max_turns: int = 6,
               with_eval: bool = False) -> GuessTheNumberEnv:
    rows = [{"question": f"Guess my number from 1 to 20 (game {i}).", "answer": str(secret)}
            for i, secret in enumerate(SECRETS)]
    eval_rows = [{"question": "Guess my number from 1 to 20 (final).", "answer": "10"}]
    return GuessTheNumberEnv(
        padding=padding, sleep_s=sleep_s, max_turns=max_turns, dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if with_eval else None,
        system_prompt="Reply with one number.", rubric=vf.Rubric(funcs=[solved]))


def load_judged() -> vf.SingleTurnEnv:
    from openai import AsyncOpenAI

    # Built offline: the client only connects when asked for a verdict, which never happens.
    judge = vf.JudgeRubric(judge_client=AsyncOpenAI(api_key="none", base_url="http://127.0.0.1:9"))
    return vf.SingleTurnEnv(dataset=sum_dataset(), rubric=judge)


def load_tools() -> vf.ToolEnv:
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    return vf.ToolEnv(tools=[add], dataset=sum_dataset(), rubric=vf.Rubric(funcs=[solved]))


GAMES = {"sums": load_sums, "guess": load_guess, "judged": load_judged, "tools": load_tools}


def load_environment(game: str = "guess", **kwargs: Any) -> vf.Environment:
    return GAMES[game](**kwargs)
