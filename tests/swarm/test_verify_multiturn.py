"""Spot-checks of multi-turn rollouts (trust/verify.py): a token an environment forced into an
episode is fed to the re-execution like any other (its sketches are checked) but is not judged
as a sample, since nothing sampled it. An honest episode passes, a tampered sample is still
caught, and demanding samples at the forced positions (the layout before multi-turn) would have
failed the honest episode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from helpers import build, chat_prompts, layout_logits
from swarm_helpers import Swarm, start_swarm, tiny_run_config

from decentrl.config import RunConfig
from decentrl.model.loading import LoadedModel, load_model
from decentrl.rollout.chain import InferenceChain, LocalChain
from decentrl.rollout.generate import OnStop, generate
from decentrl.rollout.sampling import sampling_config, sampling_logprobs
from decentrl.rollout.types import Rollout, RolloutGroup, oldest_versions
from decentrl.trust.provenance import Provenance
from decentrl.trust.verify import Verifier, session_layout

QUESTION = "What is 3 + 4?"
ROWS = 4
BUDGET = 16
SEED = 1234


def run_config(model_dir: Path) -> RunConfig:
    # No mismatch allowed: one token outside the tolerances fails the check, so a single
    # tampered sample is caught and a single wrongly demanded forced token would be too.
    return tiny_run_config(model_dir, 2, rollout={"group_size": ROWS, "max_new_tokens": BUDGET,
                                                  "temperature": 0.9, "top_k": 30},
                           trust={"max_mismatch_fraction": 0.0,
                                  "mismatched_tokens_allowed": 0})


def replies_once(reply: list[int]) -> OnStop:
    """An environment that answers each row's first turn with `reply` and ends its second."""
    turns: dict[int, int] = {}

    def on_stop(row: int, tokens: list[int]) -> list[int] | None:
        turns[row] = turns.get(row, 0) + 1
        return list(reply) if turns[row] == 1 else None

    return on_stop


def episode_group(chain: InferenceChain, model: LoadedModel, config: RunConfig,
                  on_session: Any = None) -> RolloutGroup:
    """A group of ROWS sampled episodes of one prompt, made multi-turn: each row's turn ends at a
    token row 0 samples early on (the tiny model rarely samples its end-of-turn token), and the
    environment replies once. Built as RolloutWorker builds its groups."""
    prompt = chat_prompts(model, [QUESTION])[0]
    prompts = [prompt] * ROWS
    sampling, pad = sampling_config(config.rollout), model.tokenizer.pad_token_id
    # The same seed draws the same tokens until a row's turn ends, so row 0 stops by token 2.
    plain = generate(LocalChain(build(model, 1)), prompts, 4, sampling, set(), pad, SEED)
    stop = plain[0].tokens[2]
    reply = model.tokenizer.encode("= 7.", add_special_tokens=False)
    rows = generate(chain, prompts, BUDGET, sampling, {stop}, pad, SEED, on_session,
                    on_stop=replies_once(reply))
    rollouts = [Rollout(prompt_tokens=prompt, completion_tokens=g.tokens,
                        behaviour_logprobs=g.logprobs, finished=g.finished,
                        generated=None if all(g.generated) else g.generated)
                for g in rows]
    spans = max(rows, key=lambda g: len(g.tokens)).spans
    return RolloutGroup(group_id="episodes/0", task="episodes", problem_index=0,
                        stage_versions=oldest_versions(spans), version_spans=spans,
                        sampling_seed=SEED, rollouts=rollouts)


def forced_columns(group: RolloutGroup, prompt_columns: int) -> torch.Tensor:
    """[B, P + longest completion] bool: the layout column whose output (the step's sample) each
    forced token replaced; the layout is one column narrower (the last token is never fed)."""
    width = prompt_columns + max(len(r.completion_tokens) for r in group.rollouts)
    forced = torch.zeros((len(group.rollouts), width), dtype=torch.bool)
    for row, rollout in enumerate(group.rollouts):
        for index, sampled in enumerate(rollout.generated_mask()):
            forced[row, prompt_columns - 1 + index] = not sampled
    return forced


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


def test_forced_tokens_are_fed_but_have_no_target(sharp: LoadedModel,
                                                  tiny_sharp_dir: Path) -> None:
    config = run_config(tiny_sharp_dir)
    stages = build(sharp, 2)
    group = episode_group(LocalChain(stages), sharp, config)
    first = group.rollouts[0]
    assert first.generated is not None and not all(first.generated)
    # The episode goes on sampling after the environment's reply.
    assert first.generated[-1] and first.generated.index(False) < len(first.generated) - 1
    layout = session_layout(group, sharp.tokenizer.pad_token_id)
    forced = forced_columns(group, layout.prompt_columns)[:, :layout.width]
    # Targets: -1 exactly at forced tokens (and where nothing was sampled), the token elsewhere.
    for row, rollout in enumerate(group.rollouts):
        start = layout.prompt_columns - 1
        sampled = rollout.generated_mask()
        expected = [t if s else -1 for t, s in zip(rollout.completion_tokens, sampled)]
        assert layout.targets[row, start:start + len(expected)].tolist() == expected
        assert int((layout.targets[row] >= 0).sum()) == sum(sampled)
    assert bool((layout.targets[forced] == -1).all()) and int(forced.sum()) > 0
    # ...while the forced tokens are still fed, one column later, as valid inputs.
    fed = torch.zeros_like(forced)
    fed[:, 1:] = forced[:, :-1]
    assert bool(layout.valid[fed].all())
    assert layout.ids[fed].tolist() == tokens_at(group, fed, layout.prompt_columns)

    # One teacher-forced prefill of the whole episode gives every sampled token's log-prob again.
    logits = layout_logits(stages, layout)
    scored = layout.targets >= 0
    again = sampling_logprobs(logits[scored], layout.targets[scored],
                              sampling_config(config.rollout))
    torch.testing.assert_close(again, layout.claimed[scored], rtol=0, atol=1e-4)
    # A forced token's claimed log-prob is 0.0, which the model does not give it: demanding it
    # as a sample (the single-turn layout) would flag an honest episode.
    tokens = torch.tensor(tokens_at(group, forced, layout.prompt_columns - 1))
    at_forced = sampling_logprobs(logits[forced], tokens, sampling_config(config.rollout))
    assert float(at_forced.abs().max()) > config.trust.logprob_tolerance


def tokens_at(group: RolloutGroup, columns: torch.Tensor, first: int) -> list[int]:
    """In row-major order, the completion token at each of `columns` [B, W], token 0 being at
    column `first`."""
    return [group.rollouts[row].completion_tokens[column - first]
            for row, column in columns.nonzero().tolist()]


def test_single_turn_layout_is_unchanged(sharp: LoadedModel, tiny_sharp_dir: Path) -> None:
    config = run_config(tiny_sharp_dir)
    group = episode_group(LocalChain(build(sharp, 1)), sharp, config)
    # The same tokens, all claimed as samples: None and an all-True mask give the old layout,
    # every completion token a target.
    for generated in (None, "all"):
        rollouts = [msgspec.structs.replace(
            r, generated=None if generated is None else [True] * len(r.completion_tokens))
            for r in group.rollouts]
        layout = session_layout(msgspec.structs.replace(group, rollouts=rollouts), 0)
        start = layout.prompt_columns - 1
        for row, rollout in enumerate(rollouts):
            end = start + len(rollout.completion_tokens)
            assert layout.targets[row, start:end].tolist() == rollout.completion_tokens
            assert layout.claimed[row, start:end].tolist() == pytest.approx(
                rollout.behaviour_logprobs)
    # A mask that does not cover the completion never reaches a layout: ingestion refuses it.
    broken = msgspec.structs.replace(group.rollouts[0], generated=[True])
    with pytest.raises(ValueError, match="the generated mask has 1 entries for"):
        broken.check_lengths()


# ---- the whole check, on other replicas of an in-process swarm --------------------------------


@pytest.fixture(scope="module")
def checked(sharp: LoadedModel, tiny_sharp_dir: Path
            ) -> Iterator[tuple[Swarm, Verifier, RolloutGroup, Provenance]]:
    config = run_config(tiny_sharp_dir)
    # Two inference replicas per stage: every check re-executes on the one that did not serve.
    layout = [(0, "inference"), (1, "inference"), (0, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm:
        chain = swarm.chain(sharp.spec)
        sessions: list[Any] = []
        group = episode_group(chain, sharp, config, sessions.append)
        verifier = Verifier(swarm.client, chain.directory, config, sharp.spec.hidden_size,
                            sharp.tokenizer.pad_token_id)
        yield swarm, verifier, group, sessions[0].provenance


@pytest.mark.network
def test_an_honest_multi_turn_group_passes(checked: Any) -> None:
    _, verifier, group, provenance = checked
    assert any(r.generated is not None for r in group.rollouts)
    verdict = verifier.verify(group, provenance, verifier.panel(provenance))
    assert verdict.outcome == "passed", verdict
    assert verdict.checked == (0, 1)
    # Only the sampled tokens were judged.
    assert verdict.token_gaps is not None
    assert verdict.token_gaps.numel() == sum(sum(r.generated_mask()) for r in group.rollouts)


@pytest.mark.network
def test_a_tampered_sample_after_the_environment_is_caught(checked: Any,
                                                           sharp: LoadedModel) -> None:
    _, verifier, group, provenance = checked
    longest = max(len(r.completion_tokens) for r in group.rollouts)
    row = next(i for i, r in enumerate(group.rollouts)
               if r.generated is not None and len(r.completion_tokens) == longest)
    rollout = group.rollouts[row]
    assert rollout.generated is not None
    # The last token of a longest multi-turn row: sampled, after the forced reply, and never fed
    # (so no sketch sees it): only the last stage's judgement of samples can catch it.
    index = longest - 1
    assert rollout.generated[index] and not all(rollout.generated[:index])
    tokens = list(rollout.completion_tokens)
    tokens[index] = (tokens[index] + 1) % sharp.spec.vocab_size
    rollouts = list(group.rollouts)
    rollouts[row] = msgspec.structs.replace(rollout, completion_tokens=tokens)
    verdict = verifier.verify(msgspec.structs.replace(group, rollouts=rollouts), provenance,
                              verifier.panel(provenance))
    assert verdict.outcome == "failed" and verdict.stage == 1, verdict
    assert verdict.peer in provenance.stage_peers(1)


@pytest.mark.network
def test_demanding_samples_at_forced_tokens_would_fail_the_honest_group(checked: Any) -> None:
    """The same group claimed as all sampled (the single-turn layout: every completion token a
    target) fails: the check must know which tokens the environment gave."""
    _, verifier, group, provenance = checked
    as_sampled = [msgspec.structs.replace(r, generated=None) for r in group.rollouts]
    verdict = verifier.verify(msgspec.structs.replace(group, rollouts=as_sampled), provenance,
                              verifier.panel(provenance))
    assert verdict.outcome == "failed" and verdict.stage == 1, verdict
