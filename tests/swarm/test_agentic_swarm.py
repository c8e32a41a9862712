"""Multi-turn episodes through the swarm: a group of tool-using episodes generated through three
inference peers (one per stage) is, under greedy decoding, the group the same model generates in
this process: the same tokens, the same generated/forced masks, the same turns and rewards, and
log-probs within 1e-5. The environment's replies are in there as forced tokens (prefilled, never
sampled: the environment's exact answer, with no behaviour log-prob), and the group survives the
stage replica serving it dying mid-episode, after a reply was forced in: the session replays its
history, forced tokens included, onto the stage's other replica and ends as the local one does.

The model is the tiny "sharp" model with one change. Its end-of-turn token (<|im_end|>) doubles
as the padding token, whose embedding row Hugging Face zeroes; with tied embeddings its logit is
then always 0, so the model never ends a turn. Here that row is 1.1x the row of "x", so the model
ends a turn where it would have written an "x": real model computation decides every turn end."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from swarm_helpers import (
    ObservedChain,
    Swarm,
    local_chain,
    serving,
    start_swarm,
    tiny_run_config,
)

from decentrl.client import sessions
from decentrl.envs.base import EnvStep, Message, RecordedAnswer, StopReason
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.tiny import tiny_tokenizer
from decentrl.rollout.episodes import EpisodeRollout, generate_episodes, replay_episode
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout
from decentrl.tasks import Problem, Reward

GREEDY = SamplingConfig(temperature=0.0)
BUDGET = 80  # completion tokens per episode, the environment's included
TOOL_REPLY = "42"
ANSWER = "y"  # a turn that writes this is the final answer
EOS_LIKE = "x"  # the token whose embedding the end-of-turn token gets (scaled by EOS_SCALE)
EOS_SCALE = 1.1
# (question, turn prefix, max turns): chosen (by looking at what the model writes) so that the
# group has episodes that run to their turn limit (3 turns, and 2: the row ends early while the
# others go on), one that answers in its second turn, and one that the budget cuts in its second.
EPISODES: list[tuple[str, str, int]] = [
    ("what is x?", "", 3),
    ("2+2=?", "", 2),
    ("find y", "", 3),
    ("call f(3)", "call ", 3),
]


class AnyTurnCallsEpisode:
    """Any text is a valid turn: each assistant turn is a tool call that the tool answers with
    TOOL_REPLY, until a turn contains ANSWER (the final answer) or `max_turns` turns are played.
    Every turn starts with the environment's `prefix` (assistant prefill)."""

    def __init__(self, question: str, prefix: str, max_turns: int) -> None:
        self.problem = Problem(task="tool", index=0, question=question, answer=TOOL_REPLY,
                               key=question)
        self.prefix, self.max_turns, self.max_tool_calls = prefix, max_turns, max_turns - 1
        self.conversation: list[Message] = [{"role": "user", "content": question}]
        self.turns = self.tool_calls = self.invalid_calls = 0
        self.stop_reason: StopReason | None = None
        self.reward: Reward | None = None

    def messages(self) -> list[Message]:
        return copy.deepcopy(self.conversation)

    def turn_prefix(self) -> str:
        return self.prefix

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        if self.stop_reason is not None:
            raise RuntimeError("the episode is over")
        self.turns += 1
        self.conversation.append({"role": "assistant", "content": assistant_text})
        if ANSWER in assistant_text or self.turns == self.max_turns:
            self.stop_reason = "answer" if ANSWER in assistant_text else "turn_limit"
            self.reward = Reward(correct=float(self.stop_reason == "answer"),
                                 format=0.1 * self.tool_calls)
            return EnvStep(messages=[], done=True, reward=self.reward, turn_signal=None)
        self.tool_calls += 1
        reply: list[Message] = [{"role": "tool", "content": TOOL_REPLY}]
        self.conversation += reply
        return EnvStep(messages=reply, done=False, reward=None,
                       turn_signal=float(len(assistant_text)))


def fresh_episodes() -> list[AnyTurnCallsEpisode]:
    return [AnyTurnCallsEpisode(*spec) for spec in EPISODES]


@pytest.fixture(scope="module")
def ending_dir(tiny_sharp_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_sharp_dir` whose end-of-turn token can win (see the module docstring)."""
    folder = tmp_path_factory.mktemp("tiny") / "ending"
    shutil.copytree(tiny_sharp_dir, folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tokenizer = tiny_tokenizer()
    embed = tensors["model.embed_tokens.weight"]
    (like,) = tokenizer.encode(EOS_LIKE, add_special_tokens=False)
    assert not embed[tokenizer.eos_token_id].any()  # the zeroed padding row this works around
    embed[tokenizer.eos_token_id] = EOS_SCALE * embed[like]
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def ending(ending_dir: Path) -> LoadedModel:
    return load_model(str(ending_dir))


@pytest.fixture(scope="module")
def expected(ending: LoadedModel) -> list[EpisodeRollout]:
    """The group generated in this process, on the same three stages."""
    return generate_episodes(local_chain(ending, 3), fresh_episodes(), ending.tokenizer, BUDGET,
                             GREEDY)


@pytest.fixture(scope="module")
def chain3(ending_dir: Path) -> Iterator[Swarm]:
    config = tiny_run_config(ending_dir, 3)
    with start_swarm(config, [(0, "inference"), (1, "inference"), (2, "inference")]) as swarm:
        yield swarm


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries 10 ms apart instead of 0.2 s, 0.4 s, ... (as in test_swarm.py)."""
    monkeypatch.setattr(sessions, "backoff", lambda attempt: 0.01)


def forced_runs(generated: list[bool]) -> list[tuple[int, int]]:
    """(start, stop) of every run of forced tokens."""
    runs: list[tuple[int, int]] = []
    for i, sampled in enumerate(generated):
        if sampled:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def assert_same_episodes(got: list[EpisodeRollout], want: list[EpisodeRollout]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.prompt == w.prompt
        assert g.generation.tokens == w.generation.tokens
        assert g.generation.generated == w.generation.generated
        assert g.generation.finished == w.generation.finished
        torch.testing.assert_close(torch.tensor(g.generation.logprobs),
                                   torch.tensor(w.generation.logprobs), atol=1e-5, rtol=0)
        assert g.reward == w.reward
        assert (g.episode.turns, g.episode.tool_calls, g.episode.stop_reason) == \
            (w.episode.turns, w.episode.tool_calls, w.episode.stop_reason)
        assert g.episode.messages() == w.episode.messages()


def test_the_group_exercises_turns_replies_early_ends_and_the_budget(
        expected: list[EpisodeRollout], ending: LoadedModel) -> None:
    """What the comparisons below rely on, checked on the in-process group: several turns per
    episode, replies forced in as the environment's exact tokens, and rows ending at different
    steps for different reasons. The model alone would have written something else there."""
    tokenizer = ending.tokenizer
    assert all(r.episode.turns >= 2 for r in expected)  # every row had a reply forced in
    stops = [(r.episode.turns, r.episode.stop_reason, r.generation.finished) for r in expected]
    assert stops == [(3, "turn_limit", True), (2, "turn_limit", True), (2, "answer", True),
                     (2, None, False)]
    assert expected[2].reward == Reward(correct=1.0, format=0.1)
    cut = expected[3]
    assert cut.reward is None and len(cut.generation.tokens) == BUDGET
    lengths = [len(r.generation.tokens) for r in expected]
    assert len(set(lengths)) == len(lengths) and max(lengths[:3]) < BUDGET
    # Turns are the model's own and several tokens long somewhere: not one token each.
    assert len({t for r in expected for t, s in zip(r.generation.tokens, r.generation.generated)
                if s}) > 5
    for rollout, spec in zip(expected, EPISODES):
        generation, prefix = rollout.generation, spec[1]
        # Every turn the model ended with its own end-of-turn token (the budget aside).
        runs = forced_runs(generation.generated)
        assert len(runs) == rollout.episode.tool_calls >= 1
        reply = tokenizer.encode(f"\n<|im_start|>tool\n{TOOL_REPLY}<|im_end|>\n"
                                 f"<|im_start|>assistant\n{prefix}", add_special_tokens=False)
        for start, stop in runs:
            assert generation.tokens[start - 1] == tokenizer.eos_token_id
            assert generation.generated[start - 1]
            assert generation.tokens[start:stop] == reply[:stop - start]
            assert stop - start == len(reply) or stop == BUDGET
            assert all(lp == 0.0 for lp in generation.logprobs[start:stop])
            # Prefilled, not sampled: greedy decoding from the same context writes other tokens.
            alone = generate(local_chain(ending, 3),
                             [rollout.prompt + generation.tokens[:start]], stop - start,
                             GREEDY, set(), tokenizer.pad_token_id)[0]
            assert alone.tokens != generation.tokens[start:stop]
        assert all(lp < 0.0 for lp, s in zip(generation.logprobs, generation.generated) if s)
        # A fresh episode replayed through these tokens hears the same turns and answers with
        # exactly the forced tokens (replay raises otherwise).
        played = replay_episode(AnyTurnCallsEpisode(*spec), tokenizer, Rollout(
            prompt_tokens=rollout.prompt, completion_tokens=generation.tokens,
            behaviour_logprobs=generation.logprobs, finished=generation.finished,
            generated=generation.generated))
        assert played.episode.turns == rollout.episode.turns
        assert played.episode.reward == rollout.reward
    # A finished episode's conversation renders to exactly its prompt and completion.
    for rollout in expected[:3]:
        rendered = tokenizer.apply_chat_template(rollout.episode.messages(), tokenize=False)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        assert tokenizer.encode(rendered, add_special_tokens=False) == \
            rollout.prompt + rollout.generation.tokens + newline


@pytest.mark.network
def test_three_stage_swarm_plays_the_episode_group_as_in_process(
        chain3: Swarm, ending: LoadedModel, expected: list[EpisodeRollout]) -> None:
    chain = chain3.chain(ending.spec)
    got = generate_episodes(chain, fresh_episodes(), ending.tokenizer, BUDGET, GREEDY)
    assert_same_episodes(got, expected)
    assert any(not s for r in got for s in r.generation.generated)
    assert all(r.generation.versions == (0, 0, 0) for r in got)
    assert chain.failovers == 0
    assert all(not serving(p).sessions for p in chain3.peers)  # the session was closed on every peer


@pytest.mark.network
def test_episode_group_survives_a_replica_dying_after_a_reply_was_forced_in(
        ending_dir: Path, ending: LoadedModel, expected: list[EpisodeRollout],
        fast_backoff: None) -> None:
    config = tiny_run_config(ending_dir, 3, swarm={"request_timeout_s": 10.0})
    layout = [(0, "inference"), (1, "inference"), (1, "inference"), (2, "inference")]
    episodes = fresh_episodes()
    with start_swarm(config, layout) as swarm:
        killed: list[tuple[str, int]] = []  # (peer, step)

        def kill_once_a_reply_is_in(session: Any, step: int) -> None:
            # A second turn has ended: the first reply was fed to the replica before it dies,
            # and more replies are still to be forced in after it.
            if not killed and any(e.turns >= 2 for e in episodes):
                killed.append((session.peers[1], step))
                swarm.kill(swarm.by_id(session.peers[1]))
        chain = ObservedChain(swarm.chain(ending.spec), kill_once_a_reply_is_in)
        got = generate_episodes(chain, episodes, ending.tokenizer, BUDGET, GREEDY)
        assert killed
        (session,) = chain.sessions
        assert session.failovers >= 1
        assert session.peers[1] not in (None, killed[0][0])
        # The kill came mid-episode: some row still had a reply to be forced in after it.
        step = killed[0][1]
        assert any(not s for r in got for s in r.generation.generated[step + 1:])
        assert_same_episodes(got, expected)
        assert not serving(swarm.by_id(session.peers[1])).sessions
