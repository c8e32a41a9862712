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
from typing import Any

from decentrl.envs.base import Episode, Message
from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.generate import Generation, generate
from decentrl.rollout.sampling import SamplingConfig
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


def continuation_text(tokenizer: Any, turn_end: list[Message], after: list[Message]) -> str:
    """What follows an assistant turn's end-of-turn token once the environment answers: the rest
    of that turn's rendering (ChatML: a newline), the environment's messages, and the next
    assistant header. `turn_end` is the conversation up to and including the assistant turn,
    `after` the same with the environment's messages appended."""
    closed = render(tokenizer, turn_end, generation_prompt=False)
    answered = render(tokenizer, after, generation_prompt=True)
    if not answered.startswith(closed):
        raise ValueError("the chat template renders earlier turns differently once later ones "
                         "exist; multi-turn episodes need a template that only appends")
    stop = tokenizer.eos_token
    end = closed.rfind(stop)
    if end < 0:
        raise ValueError(f"the chat template does not end an assistant turn with {stop!r}")
    return closed[end + len(stop):] + answered[len(closed):]


def generate_episodes(chain: InferenceChain, episodes: list[Episode], tokenizer: Any,
                      max_new_tokens: int, sampling: SamplingConfig, seed: int | None = None,
                      on_session: Callable[[InferenceSession], None] | None = None
                      ) -> list[EpisodeRollout]:
    """One row per episode, all in one session, until every episode is over or a row's
    `max_new_tokens` (the environment's tokens count) run out; such an episode is left
    unfinished (no reward)."""
    prompts = [tokenizer.apply_chat_template(e.messages(), add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for e in episodes]
    turn_start = [0] * len(episodes)  # where each row's current assistant turn began

    def on_stop(row: int, tokens: list[int]) -> list[int] | None:
        episode = episodes[row]
        text = tokenizer.decode(tokens[turn_start[row]:], skip_special_tokens=True)
        before = episode.messages()
        step = episode.respond(text)
        if step.done:
            return None
        turn_end = [*before, {"role": "assistant", "content": text}]
        forced = tokenizer.encode(continuation_text(tokenizer, turn_end,
                                                    [*turn_end, *step.messages]),
                                  add_special_tokens=False)
        turn_start[row] = len(tokens) + len(forced)
        return forced

    generations = generate(chain, prompts, max_new_tokens, sampling,
                           {tokenizer.eos_token_id}, tokenizer.pad_token_id, seed, on_session,
                           on_stop)
    return [EpisodeRollout(g, e, p) for g, e, p in zip(generations, episodes, prompts)]
