"""Held-out evaluation of a multi-turn environment: episode success rate (greedy, Wilson
interval), mean turns, tool calls per episode and the share of tool calls that were malformed.
An episode the token budget cut short counts as a failure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from decentrl.envs.base import Environment
from decentrl.evaluate.stats import Accuracy
from decentrl.rollout.chain import InferenceChain
from decentrl.rollout.episodes import generate_episodes
from decentrl.rollout.sampling import SamplingConfig


@dataclass
class EpisodeEvalResult:
    environment: str
    episodes: int
    success: Accuracy
    mean_turns: float
    mean_tool_calls: float
    invalid_call_rate: float | None  # None: no tool call was made
    cut_by_budget: int  # episodes the token budget ended before the environment did
    samples: list[dict[str, Any]]  # a few conversations, for the report

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_episodes(chain: InferenceChain, environment: Environment, tokenizer: Any,
                      num_episodes: int, max_new_tokens: int, batch_size: int,
                      split: str = "heldout") -> EpisodeEvalResult:
    if num_episodes < 1 or batch_size < 1:
        raise ValueError(f"num_episodes and batch_size must be >= 1, got {num_episodes} and "
                         f"{batch_size}")
    outcomes = []
    for start in range(0, num_episodes, batch_size):
        episodes = [environment.episode(split, index)  # type: ignore[arg-type]
                    for index in range(start, min(num_episodes, start + batch_size))]
        outcomes += generate_episodes(chain, episodes, tokenizer, max_new_tokens,
                                      SamplingConfig(temperature=0.0))
    solved = sum(o.reward is not None and o.reward.solved for o in outcomes)
    calls = sum(o.episode.tool_calls for o in outcomes)
    invalid = sum(o.episode.invalid_calls for o in outcomes)
    return EpisodeEvalResult(
        environment=environment.name, episodes=len(outcomes),
        success=Accuracy.from_counts(solved, len(outcomes)),
        mean_turns=sum(o.episode.turns for o in outcomes) / len(outcomes),
        mean_tool_calls=calls / len(outcomes),
        invalid_call_rate=invalid / calls if calls else None,
        cut_by_budget=sum(o.reward is None for o in outcomes),
        samples=[{"messages": o.episode.messages(), "solved": bool(o.reward and o.reward.solved)}
                 for o in outcomes[:4]])
