"""Multi-turn episodes through an inference chain: a group of episodes (one per row) is generated
in one session, and whenever a row ends an assistant turn its episode answers; the answer goes in
as forced tokens (rollout/generate.py), rendered by the tokenizer's chat template exactly as the
whole conversation would be, so the model reads the same tokens in training, evaluation and use.

The environment's messages are rendered as the suffix that the conversation with them gains over
the conversation without them; a template for which that is not a suffix (one that rewrites
earlier turns) is refused, since the tokens already in the KV cache could not change."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from decentrl.envs.base import Episode, Message
from decentrl.envs.tool_calls import CLOSE_TAG
from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.generate import Generation, ends_turn, generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout
from decentrl.tasks import Reward


@dataclass
class EpisodeRollout:
    generation: Generation  # the completion: assistant turns and the environment's replies
    episode: Episode  # finished, or cut by the token budget (then `reward` is None)
    prompt: list[int]

    @property
    def reward(self) -> Reward | None:
        return self.episode.reward


def render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def continuation_text(tokenizer: Any, turn_end: list[Message], after: list[Message],
                      closed_by_model: bool) -> str:
    """What follows an assistant turn's last token once the environment answers: the rest of
    that turn's rendering (ChatML: the end-of-turn token unless the model wrote it
    (`closed_by_model`), then a newline), the environment's messages, and the next assistant
    header. `turn_end` is the conversation up to and including the assistant turn, `after` the
    same with the environment's messages appended."""
    closed = render(tokenizer, turn_end, generation_prompt=False)
    answered = render(tokenizer, after, generation_prompt=True)
    if not answered.startswith(closed):
        raise ValueError("the chat template renders earlier turns differently once later ones "
                         "exist; multi-turn episodes need a template that only appends")
    stop = tokenizer.eos_token
    end = closed.rfind(stop)
    if end < 0:
        raise ValueError(f"the chat template does not end an assistant turn with {stop!r}")
    return closed[end + len(stop) if closed_by_model else end:] + answered[len(closed):]


def tool_call_stops(tokenizer: Any) -> list[list[int]]:
    """The stop sequences of tool-using episodes: a turn ends with its tool call's closing tag."""
    return [tokenizer.encode(CLOSE_TAG, add_special_tokens=False)]


class EpisodeTokens:
    """One episode driven by tokens: its prompt, and at each turn's end the tokens the
    environment's answer adds. Generation and the coordinator's replay share it, so a replayed
    episode sees exactly the tokens a generated one did."""

    def __init__(self, episode: Episode, tokenizer: Any) -> None:
        self.episode, self.tokenizer = episode, tokenizer
        self.prefix = episode.turn_prefix()  # the current turn's prefill
        self.turn_start = 0  # where the current turn's own tokens begin in the completion
        self.turn_signals: list[float | None] = []  # the environment's signal for each turn

    def prompt(self) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            self.episode.messages(), add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(rendered["input_ids"]) + self.tokenizer.encode(self.prefix,
                                                                   add_special_tokens=False)

    def turn_ended(self, completion: list[int],
                   recorded: Callable[[list[int]], bool] | None = None) -> list[int] | None:
        """`completion` ends a turn: the environment's answer as tokens to force, or None when
        the episode is over. At replay, `recorded` says whether tokens are those the rollout
        forced after this turn; the episode may ask it about an answer it could equally give
        (a tool budget's refusal, envs/budget.py)."""
        tokenizer = self.tokenizer
        text = self.prefix + tokenizer.decode(completion[self.turn_start:],
                                              skip_special_tokens=True)
        turn_end = [*self.episode.messages(), {"role": "assistant", "content": text}]
        closed_by_model = completion[-1] == tokenizer.eos_token_id

        def forced_tokens(messages: list[Message]) -> list[int]:
            # The next turn's prefix is read once the turn is counted, which it is by the time
            # the episode asks `recorded` as well.
            return tokenizer.encode(continuation_text(tokenizer, turn_end, [*turn_end, *messages],
                                                      closed_by_model)
                                    + self.episode.turn_prefix(), add_special_tokens=False)

        step = self.episode.respond(text, None if recorded is None else
                                    lambda messages: recorded(forced_tokens(messages)))
        self.turn_signals.append(step.turn_signal)
        if step.done:
            return None
        self.prefix = self.episode.turn_prefix()
        forced = forced_tokens(step.messages)
        self.turn_start = len(completion) + len(forced)
        return forced


def generate_episodes(chain: InferenceChain, episodes: list[Episode], tokenizer: Any,
                      max_new_tokens: int, sampling: SamplingConfig, seed: int | None = None,
                      on_session: Callable[[InferenceSession], None] | None = None,
                      record_routing: bool = False) -> list[EpisodeRollout]:
    """One row per episode, all in one session, until every episode is over or a row's
    `max_new_tokens` (the environment's tokens count) run out; such an episode is left
    unfinished (no reward). `record_routing`: as `generate`'s."""
    rows = [EpisodeTokens(e, tokenizer) for e in episodes]
    prompts = [row.prompt() for row in rows]
    generations = generate(chain, prompts, max_new_tokens, sampling,
                           {tokenizer.eos_token_id}, tokenizer.pad_token_id, seed, on_session,
                           lambda row, tokens: rows[row].turn_ended(tokens),
                           tool_call_stops(tokenizer), record_routing)
    return [EpisodeRollout(g, e, p) for g, e, p in zip(generations, episodes, prompts)]


def forced_at(completion: list[int], generated: list[bool], position: int,
              forced: list[int]) -> bool:
    """Whether the completion holds `forced` at `position` as the environment's tokens: all of
    them followed by a generated token, or as many as the completion has room for."""
    end = position + len(forced)
    given = completion[position:end]
    return (given == forced[:len(given)] and not any(generated[position:end])
            and (end >= len(completion) or generated[end]))


def replay_episode(episode: Episode, tokenizer: Any, rollout: Rollout) -> EpisodeTokens:
    """Play a fresh `episode` through a rollout's tokens, as generation did: every assistant
    turn (the generated tokens) goes to the environment, whose answers must be exactly the
    rollout's forced tokens. Returns the played episode (finished, or cut by the token budget)
    with its turn signals; raises ValueError where the rollout's prompt or environment tokens are
    not what the environment gives (a peer's transcript is never trusted). The episode's tool
    calls run within the replay's CPU limit, and a call the rollout recorded as refused by its
    tool budget is refused here without running (envs/budget.py)."""
    completion, generated = rollout.completion_tokens, rollout.generated_mask()
    driver = EpisodeTokens(episode, tokenizer)
    if driver.prompt() != list(rollout.prompt_tokens):
        raise ValueError("the prompt is not the episode's")
    stops = tool_call_stops(tokenizer)
    longest_stop = max(len(stop) for stop in stops)
    position = 0
    while position < len(completion):
        if not generated[position]:
            raise ValueError(f"completion token {position} is marked as the environment's, but "
                             "no turn ended before it")
        position += 1
        start = max(0, position - longest_stop)  # ends_turn reads no further back than this
        if not ends_turn(completion[start:position], generated[start:position],
                         {tokenizer.eos_token_id}, stops):
            continue
        recorded = partial(forced_at, completion, generated, position)
        forced = driver.turn_ended(completion[:position], recorded)
        if forced is None:
            if position != len(completion):
                raise ValueError(f"{len(completion) - position} tokens follow the episode's end")
            break
        if not recorded(forced):
            raise ValueError(f"the environment's tokens after turn {episode.turns} are not what "
                             "the environment answers")
        position += len(forced)
    return driver
