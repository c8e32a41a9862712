"""Generation over a chain of stages: greedy equals Hugging Face's generate, sampling masks are
right, behaviour log-probs are exactly what the learner recomputes (importance ratio 1), and the
decode loop handles stops, padding and bad arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build, chat_prompts

from decentrl.config import TrainConfig
from decentrl.learn.batch import build_batch
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel, load_model
from decentrl.rollout.chain import LocalChain, StepResult, step_generator
from decentrl.rollout.generate import Generation, generate, left_pad
from decentrl.rollout.sampling import (
    SamplingConfig,
    sample,
    sampling_logprobs,
    sampling_margin,
    sampling_noise,
    transformed_logits,
)
from decentrl.rollout.types import Rollout

CPU = torch.device("cpu")
INF = float("inf")
QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 * 34, then add 5.", "2+2=?"]
GREEDY = SamplingConfig(temperature=0.0)
NUCLEUS = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)




@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


# ---------------------------------------------------------------- greedy == Hugging Face generate

def test_greedy_matches_hugging_face_generate(sharp: LoadedModel, tiny_sharp_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts, pad = chat_prompts(sharp, QUESTIONS), sharp.tokenizer.pad_token_id
    chain = LocalChain(build(sharp, 2))
    max_new = 24
    # A stop token that ends one row early and never appears in another, so the comparison covers
    # both a finished row (then padded while the others decode) and one cut at the length limit.
    free = generate(chain, prompts, max_new, GREEDY, set(), pad)
    assert len({tuple(g.tokens) for g in free}) == len(prompts)  # the rows really differ
    stop = next(t for t in free[1].tokens if t not in free[0].tokens)
    stop_ids = {stop, sharp.tokenizer.eos_token_id}
    ours = generate(chain, prompts, max_new, GREEDY, stop_ids, pad)
    assert ours[1].finished and ours[1].tokens == free[1].tokens[:free[1].tokens.index(stop) + 1]
    assert not ours[0].finished and len(ours[0].tokens) == max_new

    hf = AutoModelForCausalLM.from_pretrained(tiny_sharp_dir, dtype=torch.float32).eval()
    ids, valid = left_pad(prompts, pad, CPU)
    out = hf.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=max_new,
                      do_sample=False, pad_token_id=pad, eos_token_id=sorted(stop_ids))
    for row, generation in enumerate(ours):
        expected = out[row, ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(expected) if t in stop_ids), len(expected))
        assert generation.tokens == expected[:cut], f"row {row}"
        assert generation.finished == (expected[cut - 1] in stop_ids)


# ---------------------------------------------------------------------------- sampling transforms

def kept(logits: list[float], config: SamplingConfig) -> set[int]:
    out = transformed_logits(torch.tensor([logits]), config)[0]
    return {i for i, value in enumerate(out.tolist()) if value > -INF}


def test_top_k_keeps_the_k_largest() -> None:
    assert kept([1.0, 4.0, 2.0, 3.0, 0.0], SamplingConfig(top_k=2)) == {1, 3}
    assert kept([1.0, 4.0, 2.0, 3.0, 0.0], SamplingConfig(top_k=5)) == {0, 1, 2, 3, 4}
    assert kept([1.0, 4.0, 2.0, 3.0, 0.0], SamplingConfig(top_k=9)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.15, 0.5, 0.05, 0.3, scrambled: the nucleus is found sorted, then mapped back.
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().tolist()
    assert kept(logits, SamplingConfig(top_p=0.7)) == {1, 3}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert kept(logits, SamplingConfig(top_p=0.9)) == {0, 1, 3}
    assert kept(logits, SamplingConfig(top_p=0.1)) == {1}  # the most likely token always stays
    assert kept(logits, SamplingConfig(top_p=1.0)) == {0, 1, 2, 3}


def test_top_p_applies_to_the_top_k_distribution() -> None:
    # Alone, top_p=0.75 keeps 3 tokens (0.4 + 0.3 < 0.75); after top_k=3 renormalises to
    # 0.44 / 0.33 / 0.22 the first two already reach it (Hugging Face's order: top-k, then top-p).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    assert kept(logits, SamplingConfig(top_p=0.75)) == {0, 1, 2}
    assert kept(logits, SamplingConfig(top_p=0.75, top_k=3)) == {0, 1}


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    assert torch.allclose(transformed_logits(logits, SamplingConfig(temperature=0.5)), logits * 2)
    assert torch.equal(transformed_logits(logits, SamplingConfig(temperature=1.0)), logits)
    tokens = torch.tensor([0])
    assert torch.allclose(sampling_logprobs(logits, tokens, SamplingConfig(temperature=0.5)),
                          (logits * 2).log_softmax(-1)[:, 0])
    # Greedy: the argmax, scored under temperature 1 (its log-probs are diagnostics only).
    token, logprob = sample(logits, GREEDY, None)
    assert token.item() == 3
    assert torch.allclose(logprob, logits.log_softmax(-1)[:, 3])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws `tokens` against `probs`, over the tokens with p > 0."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    kept = expected > 0
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


@pytest.mark.parametrize("config", [SamplingConfig(), SamplingConfig(temperature=0.5, top_k=3)])
def test_sampled_frequencies_follow_the_transformed_distribution(config: SamplingConfig) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    tokens, _ = sample(logits.repeat(20000, 1), config, step_generator(0))
    probs = transformed_logits(logits, config).softmax(-1)
    # At most 4 degrees of freedom: P(chi2 > 25) < 1e-4 for an exact sampler.
    assert chi_square(tokens, probs) < 25
    # The test has the power to see a slightly wrong distribution (temperature off by 10 %).
    wrong = transformed_logits(logits / 1.1, config).softmax(-1)
    assert chi_square(tokens, wrong) > 50
    assert (probs[tokens] > 0).all()  # top-k exclusions never drawn


def test_a_seed_gives_the_same_draw_from_the_same_logits() -> None:
    def logits() -> torch.Tensor:  # computed afresh each time, as a verifier would
        return 3 * torch.randn(64, 50, generator=torch.Generator().manual_seed(0))

    first = sample(logits(), NUCLEUS, step_generator(7))
    again = sample(logits(), NUCLEUS, step_generator(7))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], sample(logits(), NUCLEUS, step_generator(8))[0])
    # The noise is torch's CPU Mersenne Twister stream, the same on every machine and device:
    # -log of torch.rand's first draws for seed 0 (0.4963, 0.7682, 0.0885).
    noise = sampling_noise(step_generator(0), 1, 3)
    assert torch.allclose(noise, torch.tensor([[0.70066, 0.26368, 2.42501]]), atol=1e-5)


@pytest.mark.parametrize("config", [SamplingConfig(), NUCLEUS])
def test_sampling_margin_tells_the_seeded_draw_from_other_tokens(config: SamplingConfig) -> None:
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2000, 50, generator=g)
    tokens, _ = sample(logits, config, step_generator(5))
    noise = sampling_noise(step_generator(5), 2000, 50)
    assert torch.equal(sampling_margin(logits, tokens, config, noise), torch.zeros(2000))
    # Logits recomputed with a 1e-3 relative error (bf16 against fp32, say): the drawn token is
    # still the draw in nearly every row, and a near tie it lost is lost by little. (A token at
    # the edge of the top-p set can fall out of it: +inf, as for any excluded token.)
    perturbed = logits * (1 + 1e-3 * torch.randn(logits.shape, generator=g))
    margins = sampling_margin(perturbed, tokens, config, noise)
    assert (margins == 0).float().mean() > 0.99
    assert (margins < 0.05).float().mean() > 0.995
    # Any other token scores far below the draw in nearly every row.
    other = (tokens + torch.randint(1, 50, tokens.shape, generator=g)) % 50
    assert (sampling_margin(logits, other, config, noise) > 0.05).float().mean() > 0.99


def test_sampling_margin_of_excluded_and_greedy_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    noise = sampling_noise(step_generator(0), 1, 4)
    assert sampling_margin(logits, torch.tensor([3]), SamplingConfig(top_k=2), noise).item() == INF
    # Greedy: the top log-prob minus the token's, whatever the noise.
    greedy = sampling_margin(logits.repeat(2, 1), torch.tensor([0, 2]), GREEDY,
                             noise.repeat(2, 1))
    assert torch.allclose(greedy, torch.tensor([0.0, 2.0]))


def test_behaviour_logprobs_are_the_sampling_logprobs() -> None:
    logits = 3 * torch.randn(256, 50, generator=torch.Generator().manual_seed(0))
    tokens, behaviour = sample(logits, NUCLEUS, torch.Generator().manual_seed(1))
    assert torch.equal(sampling_logprobs(logits, tokens, NUCLEUS), behaviour)
    assert torch.isfinite(behaviour).all() and (behaviour <= 0).all()
    # Every sampled token lies inside the kept set of its row.
    kept_mask = transformed_logits(logits, NUCLEUS) > -INF
    assert kept_mask.gather(1, tokens[:, None]).all()
    assert (kept_mask.sum(-1) <= NUCLEUS.top_k).all()


def test_token_outside_the_kept_set_gets_the_floor() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]], requires_grad=True)
    config = SamplingConfig(top_k=2)
    outside = sampling_logprobs(logits, torch.tensor([3]), config)
    assert outside.item() == -1e4
    outside.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))  # no gradient, and no NaN
    assert sampling_logprobs(logits, torch.tensor([3]), config, floor=-50.0).item() == -50.0
    inside = sampling_logprobs(logits, torch.tensor([1]), config)
    assert torch.allclose(inside, torch.tensor([3.0, 4.0]).log_softmax(-1)[:1])


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5},
                                    {"top_k": -1}])
def test_sampling_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


# ---------------------------------------------------------------------- the importance ratio is 1

@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_sharp_dir"])
def test_learner_recomputes_behaviour_logprobs(request: pytest.FixtureRequest,
                                               fixture: str) -> None:
    """Rollouts from a 2-stage fp32 chain, scored by a 3-stage fp32 trainer with the same weights:
    every completion token has importance ratio 1. Generation (KV cache, one position at a time)
    and training (whole sequences) order their sums differently, ~1e-7 apart in fp32; a
    misaligned token, position or sampling transform would be off by far more than 1e-4."""
    model = load_model(str(request.getfixturevalue(fixture)))
    prompts = chat_prompts(model, QUESTIONS) * 2  # two samples per prompt
    tokenizer = model.tokenizer
    generations = generate(LocalChain(build(model, 2)), prompts, 16, NUCLEUS,
                           {tokenizer.eos_token_id}, tokenizer.pad_token_id, 0)
    rollouts = [Rollout(prompt_tokens=p, completion_tokens=g.tokens,
                        behaviour_logprobs=g.logprobs, finished=g.finished)
                for p, g in zip(prompts, generations)]
    batch = build_batch(rollouts, [1.0, -1.0] * 4, [0] * 8, tokenizer.pad_token_id)
    train = TrainConfig(micro_batch_size=3)  # micro-batches that do not divide the batch
    trainer = PipelineTrainer.local(build(model, 3), train, loss_config_from(train, 16), NUCLEUS,
                                    torch.float32)
    learner = trainer._chain_logprobs([t.stage for t in trainer.stage_trainers], batch)
    mask = batch.completion_valid
    assert mask.sum() == sum(len(g.tokens) for g in generations) > 40
    ratio = (learner - batch.behaviour_logprobs)[mask].exp()
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    # The log-probs are real ones: some tokens were far from certain.
    assert batch.behaviour_logprobs[mask].min() < -0.5
    # The training step's own forward agrees: its behaviour weights pi_prox / mu are all 1.
    metrics = trainer.train_step(batch)
    assert metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["behaviour_kl"] < 1e-8


# -------------------------------------------------------------------------- the decode loop itself

def test_generation_is_reproducible_with_a_seed(tiny_model: LoadedModel) -> None:
    chain = LocalChain(build(tiny_model, 2))
    prompts, pad = chat_prompts(tiny_model, QUESTIONS), tiny_model.tokenizer.pad_token_id

    def run(seed: int) -> list[Generation]:
        return generate(chain, prompts, 12, NUCLEUS, {tiny_model.tokenizer.eos_token_id}, pad, seed)

    first, again, other = run(0), run(0), run(1)
    assert first == again
    assert [g.tokens for g in first] != [g.tokens for g in other]


class ScriptedSession:
    """Logits that make row r emit script[r][step] with probability ~1; records every call."""

    def __init__(self, script: list[list[int]], vocab: int, fail_at: int | None) -> None:
        self.script, self.vocab, self.fail_at = script, vocab, fail_at
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.closed = False

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        step = len(self.calls)
        if step == self.fail_at:
            raise RuntimeError("peer went away")
        self.calls.append((tokens.clone(), positions.clone(), key_valid.clone()))
        logits = torch.full((len(self.script), self.vocab), -30.0)
        for row, tokens_of_row in enumerate(self.script):
            logits[row, tokens_of_row[step]] = 30.0
        return StepResult(*sample(logits, sampling, None), (0,))

    def close(self) -> None:
        self.closed = True


class ScriptedChain:
    def __init__(self, script: list[list[int]], vocab: int = 8, fail_at: int | None = None) -> None:
        self.script, self.vocab, self.fail_at = script, vocab, fail_at
        self.sessions: list[ScriptedSession] = []

    @property
    def device(self) -> torch.device:
        return CPU

    def versions(self) -> tuple[int, ...]:
        return (0,)

    def open_session(self, batch: int, max_length: int) -> ScriptedSession:
        assert batch == len(self.script)
        self.sessions.append(ScriptedSession(self.script, self.vocab, self.fail_at))
        return self.sessions[-1]


PAD, STOP = 0, 7


def test_stops_finished_flags_and_padding() -> None:
    # Row 0 stops after two tokens; row 1 runs to the limit; row 2 stops on the last token.
    chain = ScriptedChain([[5, STOP, 6, 6], [6, 6, 6, 6], [4, 4, 4, STOP]])
    out = generate(chain, [[1, 2, 3], [4], [2, 2]], 4, GREEDY, {STOP}, PAD)
    assert [g.tokens for g in out] == [[5, STOP], [6, 6, 6, 6], [4, 4, 4, STOP]]
    assert [g.finished for g in out] == [True, False, True]
    assert all(len(g.logprobs) == len(g.tokens) for g in out)
    assert all(lp == pytest.approx(0.0, abs=1e-6) for g in out for lp in g.logprobs)

    session = chain.sessions[0]
    assert session.closed
    assert len(session.calls) == 4  # the prompt, then one call per token but the last
    tokens, positions, valid = session.calls[0]
    assert tokens.tolist() == [[1, 2, 3], [PAD, PAD, 4], [PAD, 2, 2]]  # left padding
    assert valid.tolist() == [[True] * 3, [False, False, True], [False, True, True]]
    assert positions[:, -1].tolist() == [2, 0, 1]  # the last prompt token's position
    # Decode steps feed the previous token at the next position of each row.
    assert [c[0][:, 0].tolist() for c in session.calls[1:]] == [[5, 6, 4], [STOP, 6, 4],
                                                                 [PAD, 6, 4]]
    assert [c[1][:, 0].tolist() for c in session.calls[1:]] == [[3, 1, 2], [4, 2, 3], [5, 3, 4]]
    # The key mask grows by one column per step; after its stop token, row 0's keys are padding.
    last_valid = session.calls[3][2]
    assert last_valid.shape == (3, 6)
    assert last_valid[:, 3:].tolist() == [[True, True, False], [True] * 3, [True] * 3]


def test_decoding_ends_when_every_row_has_stopped() -> None:
    chain = ScriptedChain([[5, STOP, 6, 6, 6], [STOP, 6, 6, 6, 6]])
    out = generate(chain, [[1], [2]], 5, GREEDY, {STOP}, PAD)
    assert [g.tokens for g in out] == [[5, STOP], [STOP]]
    assert all(g.finished for g in out)
    assert len(chain.sessions[0].calls) == 2


def test_session_is_closed_when_a_step_fails() -> None:
    chain = ScriptedChain([[5, 5, 5]], fail_at=2)
    with pytest.raises(RuntimeError, match="peer went away"):
        generate(chain, [[1]], 3, GREEDY, {STOP}, PAD)
    assert chain.sessions[0].closed


@pytest.mark.parametrize(("prompts", "max_new", "message"), [
    ([], 4, "at least one prompt"),
    ([[1], []], 4, "no empty prompt"),
    ([[1]], 0, "max_new_tokens"),
])
def test_generate_rejects_bad_arguments(prompts: list[list[int]], max_new: int,
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(ScriptedChain([[5]]), prompts, max_new, GREEDY, {STOP}, PAD)


def test_local_chain_needs_every_stage(tiny_model: LoadedModel) -> None:
    first, second = build(tiny_model, 2)
    with pytest.raises(ValueError, match="every stage"):
        LocalChain([first])
    with pytest.raises(ValueError, match="every stage"):
        LocalChain([second, first])
    assert LocalChain([first, second]).versions() == (0, 0)
