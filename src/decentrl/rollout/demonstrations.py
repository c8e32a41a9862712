"""Demonstrations as training rows: an environment's scripted solution of a train problem
(envs/base.py `Demonstrating`) turned into the exact tokens an episode of it would have.

The transcript is driven through `EpisodeTokens`, as generation and the coordinator's replay
drive an episode: the prompt and the environment's replies are the environment's own tokens
(context, no loss), the assistant's turns are what the model would have sampled (the loss mask,
`Rollout.generated`). A tool-call turn must end at the stop sequence that ends a sampled turn,
and a final answer with the end-of-turn token, so that the model learns to stop where generation
stops it. A demonstration that does not solve its problem, or whose turns a generation would cut
elsewhere, is refused: it would teach the wrong thing. So is one longer than the generation budget
(`rollout.max_new_tokens`, the environment's tokens counted as in generation): a sampled episode
that long is cut unscored, so the model would learn a path it can never finish. `demonstrations`
draws another problem in its place (`DemonstrationTooLong`), and gives up with an error when most
do not fit: the budget is too small for the environment's demonstrations."""

from __future__ import annotations

import logging
import random
from typing import Any

from decentrl.envs.base import Demonstrating, Episode
from decentrl.envs.tool_calls import CLOSE_TAG
from decentrl.rollout.episodes import EpisodeTokens, tool_call_stops
from decentrl.rollout.generate import ends_turn
from decentrl.rollout.types import Rollout

# Problem indices of demonstrations are drawn below this: any train index is a problem.
DEMONSTRATION_INDICES = 2**40
# Problems drawn per demonstration asked for, at most, before too-long ones end in an error.
MAX_DRAWS_PER_ROW = 8

logger = logging.getLogger(__name__)


class DemonstrationTooLong(ValueError):
    """A demonstration whose completion is longer than the generation budget."""


def demonstration_rollout(episode: Episode, turns: list[str], tokenizer: Any,
                          max_new_tokens: int | None = None) -> Rollout:
    """`turns` (each assistant turn's full text, its prefill included) played through a fresh
    `episode` as one row: the environment's tokens forced, the assistant's marked generated.
    Raises ValueError naming the turn where the transcript is not a solved episode, and
    DemonstrationTooLong where its completion is longer than `max_new_tokens` (None: any
    length)."""
    driver = EpisodeTokens(episode, tokenizer)
    prompt = driver.prompt()
    stop_ids, stops = {tokenizer.eos_token_id}, tool_call_stops(tokenizer)
    completion: list[int] = []
    generated: list[bool] = []
    for number, text in enumerate(turns, start=1):
        if not text.startswith(driver.prefix):
            raise ValueError(f"turn {number} does not start with the episode's prefill "
                             f"{driver.prefix!r}")
        own = tokenizer.encode(text[len(driver.prefix):], add_special_tokens=False)
        if tokenizer.decode(own, skip_special_tokens=True) != text[len(driver.prefix):]:
            raise ValueError(f"turn {number} does not survive the tokenizer (encoded and "
                             "decoded, its text changes): the model would learn other text")
        if not text.endswith(CLOSE_TAG):
            own.append(tokenizer.eos_token_id)  # a final answer: the model closes its turn
        ends = [ends_turn(own[:end], [True] * end, stop_ids, stops)
                for end in range(1, len(own) + 1)]
        if not ends[-1] or any(ends[:-1]):
            raise ValueError(f"turn {number} would not end where its text ends: generation "
                             "stops a turn at its first stop token or closing tag")
        completion += own
        generated += [True] * len(own)
        forced = driver.turn_ended(completion)
        if forced is None:
            if number != len(turns):
                raise ValueError(f"the episode ended after turn {number} of {len(turns)}")
            break
        completion += forced
        generated += [False] * len(forced)
    else:
        raise ValueError(f"the episode is not over after the demonstration's {len(turns)} turns")
    reward = episode.reward
    if reward is None or reward.correct != 1.0:
        raise ValueError(f"the demonstration does not solve problem {episode.problem.index} "
                         f"(stop reason {episode.stop_reason})")
    if max_new_tokens is not None and len(completion) > max_new_tokens:
        raise DemonstrationTooLong(f"the demonstration of problem {episode.problem.index} takes "
                                   f"{len(completion)} tokens, the budget is {max_new_tokens}")
    return Rollout(prompt_tokens=prompt, completion_tokens=completion,
                   behaviour_logprobs=[0.0] * len(completion), finished=True,
                   generated=generated)


def demonstrations(environment: Demonstrating, tokenizer: Any, seed: int, step: int,
                   count: int, max_new_tokens: int) -> list[Rollout]:
    """`count` demonstrations of train problems for training step `step`, each within
    `max_new_tokens` (a longer one is replaced by the next problem drawn): the problems and
    wordings are a pure function of (seed, step), so a resumed run trains on the same ones.
    Held-out problems never appear: only the train split is drawn. Raises ValueError when
    MAX_DRAWS_PER_ROW problems a row do not give `count` that fit."""
    rng = random.Random(f"demonstrations:{seed}:{step}")
    rows: list[Rollout] = []
    too_long = 0
    while len(rows) < count:
        if len(rows) + too_long >= MAX_DRAWS_PER_ROW * count:
            raise ValueError(f"{too_long} of {len(rows) + too_long} demonstrations of "
                             f"{environment.name} are longer than rollout.max_new_tokens "
                             f"({max_new_tokens}): raise it, or make the demonstrations shorter")
        index = rng.randrange(DEMONSTRATION_INDICES)
        problem = environment.problem("train", index)
        turns = environment.demonstration(problem, rng)
        try:
            rows.append(demonstration_rollout(environment.episode("train", index), turns,
                                              tokenizer, max_new_tokens))
        except DemonstrationTooLong:
            too_long += 1
    if too_long:
        logger.warning("step %d: %d demonstrations longer than the budget (%d tokens) replaced",
                       step, too_long, max_new_tokens)
    return rows
