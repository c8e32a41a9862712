"""Multi-turn generation (issue #7): when a row samples a stop token, an environment's reply is fed
to it as forced tokens while the other rows go on sampling. Forced tokens carry no behaviour
log-prob, the continuation sees them exactly as if they had been part of the prompt, a chain of
three stages generates the same episode as one stage, and in training an environment's tokens are
context without loss or gradient."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import build, chat_prompts

from decentrl.config import TrainConfig
from decentrl.learn.batch import build_batch
from decentrl.learn.stage_loss import LossInputs, loss_config_from, micro_batch_loss
from decentrl.learn.stage_trainer import stage_forward
from decentrl.model.loading import LoadedModel, load_model
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import OnStop, ends_turn, generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout

GREEDY = SamplingConfig(temperature=0.0)
QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 * 34, then add 5.", "2+2=?"]
BUDGET = 40


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


def replies_once(reply: list[int], calls: list[tuple[int, int]]) -> OnStop:
    """An environment that answers each row's first turn with `reply` and ends its second."""
    turns: dict[int, int] = {}

    def on_stop(row: int, tokens: list[int]) -> list[int] | None:
        calls.append((row, len(tokens)))
        turns[row] = turns.get(row, 0) + 1
        return list(reply) if turns[row] == 1 else None

    return on_stop


def first_turn_stop(model: LoadedModel, prompts: list[list[int]]) -> int:
    """A token that greedy decoding of the first prompt reaches after a few steps: the tiny
    model rarely samples its end-of-turn token, so the test's turns end on this one."""
    plain = generate(LocalChain(build(model, 1)), prompts[:1], 6, GREEDY, set(), 0)
    return plain[0].tokens[3]


def test_forced_tokens_continue_a_turn_as_if_they_were_prompt(sharp: LoadedModel) -> None:
    prompts = chat_prompts(sharp, QUESTIONS)
    stop = first_turn_stop(sharp, prompts)
    reply = sharp.tokenizer.encode("ok: 7.", add_special_tokens=False)
    calls: list[tuple[int, int]] = []
    pad = sharp.tokenizer.pad_token_id
    out = generate(LocalChain(build(sharp, 1)), prompts, BUDGET, GREEDY, {stop}, pad,
                   on_stop=replies_once(reply, calls))
    first = out[0]
    turn_end = first.tokens.index(stop)
    forced = slice(turn_end + 1, turn_end + 1 + len(reply))
    assert first.tokens[forced] == reply
    assert first.generated == ([True] * (turn_end + 1) + [False] * len(reply)
                               + [True] * (len(first.tokens) - forced.stop))
    assert all(lp == 0.0 for lp in first.logprobs[forced])
    assert all(lp < 0.0 for lp, g in zip(first.logprobs, first.generated) if g)
    assert (0, turn_end + 1) in calls  # the environment saw the turn, its stop token included
    # The second turn is what greedy decoding gives with the first turn and the reply as prompt:
    # the forced tokens went into the KV cache like any prompt token.
    again = generate(LocalChain(build(sharp, 1)), [prompts[0] + first.tokens[:forced.stop]],
                     BUDGET - forced.stop, GREEDY, {stop}, pad)[0]
    assert first.tokens[forced.stop:] == again.tokens
    assert first.finished == again.finished
    # Rows that never reached the stop token were never forced.
    for generation in out:
        if stop not in generation.tokens:
            assert all(generation.generated)


def test_a_three_stage_chain_generates_the_same_episode(sharp: LoadedModel) -> None:
    prompts = chat_prompts(sharp, QUESTIONS)
    stop = first_turn_stop(sharp, prompts)
    reply = sharp.tokenizer.encode("result: 408", add_special_tokens=False)
    pad = sharp.tokenizer.pad_token_id
    episodes = [generate(LocalChain(build(sharp, stages)), prompts, BUDGET, GREEDY, {stop}, pad,
                         on_stop=replies_once(reply, []))
                for stages in (1, 3)]
    for one, three in zip(*episodes):
        assert (one.tokens, one.generated, one.finished) == \
            (three.tokens, three.generated, three.finished)
        torch.testing.assert_close(torch.tensor(one.logprobs), torch.tensor(three.logprobs))
    assert any(not all(g.generated) for g in episodes[0])  # some row did take a second turn


def test_without_on_stop_every_token_is_generated(sharp: LoadedModel) -> None:
    prompts = chat_prompts(sharp, QUESTIONS)
    stop = first_turn_stop(sharp, prompts)
    out = generate(LocalChain(build(sharp, 2)), prompts, BUDGET, GREEDY, {stop},
                   sharp.tokenizer.pad_token_id)
    for generation in out:
        assert generation.generated == [True] * len(generation.tokens)
        if generation.finished:
            assert generation.tokens[-1] == stop


def episode_rollout(prompt: list[int], tokens: list[int], generated: list[bool]) -> Rollout:
    return Rollout(prompt_tokens=prompt, completion_tokens=tokens,
                   behaviour_logprobs=[-1.0 if g else 0.0 for g in generated], finished=True,
                   generated=generated)


def test_environment_tokens_are_context_but_carry_no_loss(sharp: LoadedModel) -> None:
    prompt = chat_prompts(sharp, ["What is 3 + 4?"])[0]
    turn = sharp.tokenizer.encode("call", add_special_tokens=False)
    reply = sharp.tokenizer.encode("= 7", add_special_tokens=False)
    answer = sharp.tokenizer.encode("7", add_special_tokens=False)
    tokens = turn + reply + answer
    generated = [True] * len(turn) + [False] * len(reply) + [True] * len(answer)
    rollouts = [episode_rollout(prompt, tokens, generated),
                episode_rollout(prompt, answer, [True] * len(answer))]
    batch = build_batch(rollouts, [1.0, -1.0], [0, 0], sharp.tokenizer.pad_token_id)
    assert batch.completion_valid[0].tolist() == [True] * len(tokens)
    assert batch.completion_generated[0].tolist() == generated
    assert batch.num_target_tokens == len(turn) + 2 * len(answer)

    stages = build(sharp, 1)
    train = TrainConfig()
    loss = loss_config_from(train, 16)
    logits = stage_forward(stages[0], (batch.prompts, batch.completions), batch)
    logits = logits.detach().requires_grad_(True)
    inputs = LossInputs(None, None, batch.num_sequences, batch.num_target_tokens)
    value, _, _ = micro_batch_loss(logits, batch, inputs, loss, SamplingConfig())
    value.backward()
    # Rows of the logits follow the valid completion tokens in row-major order.
    per_token = logits.grad.abs().sum(-1)
    env = ~batch.completion_generated[batch.completion_valid]
    assert int(env.sum()) == len(reply)
    assert torch.all(per_token[env] == 0) and torch.all(per_token[~env] > 0)
    # What an environment token claims as behaviour log-prob changes nothing.
    poisoned = replace(batch, behaviour_logprobs=batch.behaviour_logprobs.masked_fill(
        batch.completion_valid & ~batch.completion_generated, -50.0))
    again, _, _ = micro_batch_loss(logits.detach(), poisoned, inputs, loss, SamplingConfig())
    assert float(again) == pytest.approx(float(value.detach()))

    # A rollout of environment tokens only has nothing to learn from: ingestion refuses it.
    with pytest.raises(ValueError, match="must mark at least one sampled"):
        episode_rollout(prompt, reply, [False] * len(reply)).check_lengths()


def test_a_turn_ending_on_the_last_token_of_the_budget_is_not_finished(sharp: LoadedModel
                                                                       ) -> None:
    prompts = chat_prompts(sharp, QUESTIONS)[:1]
    stop = first_turn_stop(sharp, prompts)
    reply = sharp.tokenizer.encode("ok", add_special_tokens=False)
    pad = sharp.tokenizer.pad_token_id
    turn_end = generate(LocalChain(build(sharp, 1)), prompts, BUDGET, GREEDY, {stop}, pad,
                        on_stop=replies_once(reply, []))[0].tokens.index(stop)
    # The environment answered the turn, but the budget ended before its reply went in: the row
    # was cut, not finished. Without an environment the same stop ends the row.
    [cut] = generate(LocalChain(build(sharp, 1)), prompts, turn_end + 1, GREEDY, {stop}, pad,
                     on_stop=replies_once(reply, []))
    assert len(cut.tokens) == turn_end + 1 and not cut.finished
    [ended] = generate(LocalChain(build(sharp, 1)), prompts, turn_end + 1, GREEDY, {stop}, pad)
    assert ended.tokens == cut.tokens and ended.finished


def test_a_stop_sequence_ends_a_turn_where_the_model_completes_it(sharp: LoadedModel) -> None:
    prompts = chat_prompts(sharp, QUESTIONS)[:1]
    pad = sharp.tokenizer.pad_token_id
    plain = generate(LocalChain(build(sharp, 1)), prompts, 8, GREEDY, set(), pad)[0].tokens
    sequence = plain[2:4]
    [stopped] = generate(LocalChain(build(sharp, 1)), prompts, 8, GREEDY, set(), pad,
                         stop_sequences=[sequence])
    end = next(i + 2 for i in range(len(plain) - 1) if plain[i:i + 2] == sequence)
    assert stopped.tokens == plain[:end] and stopped.finished
    # Only a sampled token completes a stop sequence: one the environment forced does not.
    assert ends_turn([7, *sequence], [True, True, True], set(), [sequence])
    assert not ends_turn([7, *sequence], [True, True, False], set(), [sequence])
    assert not ends_turn(sequence[1:], [True], set(), [sequence])
