"""Groups of multi-turn episodes through a chain: the environment's replies go in as the chat
template renders them, marked as not generated, and each episode ends with its own reward."""

from __future__ import annotations

import copy

import pytest
import torch

from decentrl.envs.base import EnvStep, Message, RecordedAnswer
from decentrl.evaluate.runner import evaluate
from decentrl.model.tiny import tiny_tokenizer
from decentrl.rollout.chain import StepResult
from decentrl.rollout.episodes import continuation_text, generate_episodes
from decentrl.rollout.sampling import SamplingConfig
from decentrl.tasks import Problem, Reward

TOOL_REPLY = "7"


class LookupEpisode:
    """Asks a question; the first assistant turn is a lookup the environment answers with
    TOOL_REPLY; the second is the final answer, right if it is TOOL_REPLY."""

    def __init__(self, index: int = 0) -> None:
        self.problem = LookupEnvironment().problem("heldout", index)
        self.conversation: list[Message] = [{"role": "user", "content": "what is x?"}]
        self.turns = self.tool_calls = self.invalid_calls = 0
        self.reward: Reward | None = None

    def messages(self) -> list[Message]:
        return copy.deepcopy(self.conversation)

    def turn_prefix(self) -> str:
        return ""

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        self.turns += 1
        self.conversation.append({"role": "assistant", "content": assistant_text})
        if self.turns == 1:
            self.tool_calls += 1
            self.invalid_calls += assistant_text != "look up x"
            reply = [{"role": "tool", "content": TOOL_REPLY}]
            self.conversation += reply
            return EnvStep(messages=reply, done=False, reward=None, turn_signal=None)
        self.reward = Reward(correct=float(assistant_text.strip() == TOOL_REPLY), format=0.0)
        return EnvStep(messages=[], done=True, reward=self.reward, turn_signal=None)


class ScriptedSession:
    """Plays every row's assistant turns from a script, whatever it is fed: turn k of row r is
    scripts[r][k] and the end-of-turn token. It counts turns in the tokens it was fed (forced ones
    included), so it follows the episode the way a model reading its context would."""

    def __init__(self, scripts: list[list[str]], tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.scripts = [[tokenizer.encode(turn, add_special_tokens=False) for turn in turns]
                        for turns in scripts]
        self.header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.history: list[list[int]] = [[] for _ in scripts]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        new_valid = key_valid[:, -tokens.shape[1]:]
        out = []
        for row, history in enumerate(self.history):
            history += tokens[row][new_valid[row]].tolist()
            out.append(self.next_token(row, history))
        batch = len(self.history)
        return StepResult(torch.tensor(out), torch.full((batch,), -0.5), (0,))

    def next_token(self, row: int, history: list[int]) -> int:
        n = len(self.header)
        starts = [i + n for i in range(len(history) - n + 1) if history[i:i + n] == self.header]
        turn = self.scripts[row][len(starts) - 1] + [self.tokenizer.eos_token_id]
        written = len(history) - starts[-1]
        return turn[written] if written < len(turn) else self.tokenizer.eos_token_id

    def close(self) -> None:
        pass


class ScriptedChain:
    def __init__(self, scripts: list[list[str]], tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.scripts, self.tokenizer = scripts, tokenizer

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def versions(self) -> tuple[int, ...]:
        return (0,)

    def open_session(self, batch: int, max_length: int) -> ScriptedSession:
        return ScriptedSession(self.scripts, self.tokenizer)


def test_an_episode_group_through_a_chain() -> None:
    tokenizer = tiny_tokenizer()
    scripts = [["look up x", "7"], ["look up x", "8"], ["look up x and more and more", "7"]]
    episodes = [LookupEpisode() for _ in scripts]
    out = generate_episodes(ScriptedChain(scripts, tokenizer), episodes, tokenizer, 40,
                            SamplingConfig(temperature=0.0))
    reply = tokenizer.encode(f"\n<|im_start|>tool\n{TOOL_REPLY}<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False)
    right, wrong, cut = out
    first = tokenizer.encode("look up x<|im_end|>", add_special_tokens=False)
    second = tokenizer.encode("7<|im_end|>", add_special_tokens=False)
    assert right.generation.tokens == first + reply + second
    assert right.generation.generated == ([True] * len(first) + [False] * len(reply)
                                          + [True] * len(second))
    assert right.generation.finished
    assert right.reward is not None and right.reward.solved
    # The environment heard each turn once: not again while the finished row sat in the batch.
    assert [r.episode.turns for r in out] == [2, 2, 1]
    assert wrong.reward is not None and not wrong.reward.solved
    # The third row's budget ran out in its second turn: no reward, not finished.
    assert cut.reward is None and not cut.generation.finished
    assert len(cut.generation.tokens) == 40
    # The conversation the episode kept renders to exactly the prompt and completion tokens.
    rendered = tokenizer.apply_chat_template(right.episode.messages(), tokenize=False)
    assert tokenizer.encode(rendered, add_special_tokens=False) == \
        right.prompt + right.generation.tokens + tokenizer.encode("\n", add_special_tokens=False)


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{{ messages | length }}{% for m in messages %}{{ m['content'] }}"
                               "<|im_end|>{% endfor %}")
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match="only appends"):
        continuation_text(tokenizer, turn, [*turn, {"role": "tool", "content": "r"}], True)


class LookupEnvironment:
    name = "lookup"

    def problem(self, split: str, index: int) -> Problem:
        return Problem(task=self.name, index=index, question="what is x?", answer=TOOL_REPLY,
                       key=str(index))

    def episode(self, split: str, index: int) -> LookupEpisode:
        return LookupEpisode(index)


def test_episode_evaluation_counts_success_turns_and_calls() -> None:
    tokenizer = tiny_tokenizer()
    # 5 episodes in batches of 2: right, wrong, right after a malformed lookup, right, cut short.
    scripts = [["look up x", "7"], ["look up x", "8"], ["look up y", "7"], ["look up x", "7"],
               ["look up x and more and more and more", "7"]]

    class Chain(ScriptedChain):
        calls = 0

        def open_session(self, batch: int, max_length: int) -> ScriptedSession:
            first = 2 * Chain.calls
            Chain.calls += 1
            return ScriptedSession(scripts[first:first + batch], tokenizer)

    result = evaluate(Chain(scripts, tokenizer), LookupEnvironment(), tokenizer, 5, 40,
                      batch_size=2)
    assert result.problems == 5 and result.pass1.n == 5
    assert result.pass1.mean == pytest.approx(3 / 5)
    assert result.episodes is not None
    assert result.episodes.cut_by_budget == 1
    assert result.episodes.mean_turns == pytest.approx((2 + 2 + 2 + 2 + 1) / 5)
    assert result.episodes.mean_tool_calls == pytest.approx(1.0)
    assert result.episodes.invalid_call_rate == pytest.approx(2 / 5)  # "look up y", the long one
    with pytest.raises(ValueError, match="num_problems"):
        evaluate(Chain(scripts, tokenizer), LookupEnvironment(), tokenizer, 0, 40, 2)
