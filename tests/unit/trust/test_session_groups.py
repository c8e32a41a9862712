"""Generation sessions that carry several groups (coordinator/inflight.py sizes them): each group is
spot-checked on its own, in its session's columns, against the sketches of its own rows and the
seeded draw of its own rows (trust/provenance.py `group_shares`, trust/verify.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from helpers import build, layout_logits
from swarm_helpers import ObservedChain, serving, start_swarm, steps_through_infer, tiny_run_config

from decentrl.config import RunConfig
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.evaluate.runner import TrainingShape, evaluate
from decentrl.launch.adversary import FORGED_SHIFT
from decentrl.model.loading import LoadedModel, load_model
from decentrl.net.node import Reply
from decentrl.net.protocol import InferenceStep, VerifyStep
from decentrl.rollout.chain import LocalChain, step_generator
from decentrl.rollout.generate import step_seed
from decentrl.rollout.sampling import (
    SamplingConfig,
    sampling_config,
    sampling_logprobs,
    sampling_margin,
    sampling_noise,
)
from decentrl.rollout.types import Rollout, RolloutGroup
from decentrl.stage.inbound import InboundChecks, PeerError
from decentrl.tasks import make_task, render_prompt
from decentrl.trust.commit import Sketches
from decentrl.trust.provenance import Provenance, StageProvenance, group_shares
from decentrl.trust.verify import session_layout
from tests.swarm.test_failover_verify import route, verify

GROUP = 4


def groups_config(model_dir: Path) -> RunConfig:
    # Operands of 1 to 4 digits: the session's prompts differ in length, so a group's rows are
    # padded to the session's longest prompt, not their own.
    return tiny_run_config(
        model_dir, 2, task={"name": "sums", "options": {"min_digits": 1, "max_digits": 4}},
        rollout={"group_size": GROUP, "max_new_tokens": 8, "temperature": 0.9},
        swarm={"announce_every_s": 1.0, "request_timeout_s": 10.0},
        trust={"verify_fraction": 1.0})


def unequal_prompts(config: RunConfig, model: LoadedModel) -> list[int]:
    """Two problem indices whose prompts have different lengths, the longer second."""
    task = make_task(config.task.name, **config.task.options)
    scheduler = PromptScheduler(config.seed)
    first = scheduler.next(1)[0]
    length = len(render_prompt(task, task.problem("train", first), model.tokenizer))
    for index in scheduler.next(50):
        if len(render_prompt(task, task.problem("train", index), model.tokenizer)) > length:
            return [first, index]
    raise AssertionError("fifty prompts all as short as the first")


def generate_session(config: RunConfig, model: LoadedModel, chain: Any,
                     problems: list[int]) -> list[RolloutGroup]:
    task = make_task(config.task.name, **config.task.options)
    worker = RolloutWorker(chain, None, task, model.tokenizer, config.rollout,
                           PromptScheduler(config.seed), config.seed)
    return worker.generate_groups(problems)


def test_a_group_re_executes_alone_in_its_sessions_columns(tiny_sharp_dir: Path) -> None:
    """The second group of a two-group session, rebuilt on its own in the session's columns:
    one prefill gives back its behaviour log-probs, and its tokens are the seeded draws of its
    rows of the session (the noise of the rows before it drawn first), not of rows 0-3."""
    model = load_model(str(tiny_sharp_dir))
    config = groups_config(tiny_sharp_dir)
    stages = build(model, 2)
    first, second = generate_session(config, model, LocalChain(stages),
                                     unequal_prompts(config, model))
    prompt_columns = len(second.rollouts[0].prompt_tokens)
    assert len(first.rollouts[0].prompt_tokens) < prompt_columns
    sampling = sampling_config(config.rollout)
    for group, first_row in ((first, 0), (second, GROUP)):
        layout = session_layout(group, model.tokenizer.pad_token_id, prompt_columns)
        assert layout.prompt_columns == prompt_columns
        logits = layout_logits(stages, layout)
        scored = layout.targets >= 0
        torch.testing.assert_close(
            sampling_logprobs(logits[scored], layout.targets[scored], sampling),
            layout.claimed[scored], rtol=0, atol=1e-4)
        for offset, drawn in ((first_row, True), (GROUP - first_row, False)):
            margins = []
            for column in range(prompt_columns - 1, layout.width):
                rows = layout.targets[:, column] >= 0
                step = column - (prompt_columns - 1)
                noise = sampling_noise(step_generator(step_seed(group.sampling_seed, step)),
                                       offset + GROUP, logits.shape[-1])[offset:]
                margin = sampling_margin(logits[:, column], layout.targets[:, column].clamp(min=0),
                                         sampling, noise)
                margins.append(margin[rows])
            worst = float(torch.cat(margins).max())
            assert (worst < 1e-3) == drawn, (group.group_id, offset, worst)
    with pytest.raises(ValueError, match="cannot hold"):
        session_layout(second, model.tokenizer.pad_token_id, prompt_columns - 1)


def test_a_groups_share_of_a_session_keeps_its_own_rows() -> None:
    """Three groups of 2, 2 and 4 rows in one session with stage 0's sketches at every row."""
    sketches = Sketches(torch.arange(8), torch.arange(8) + 100, torch.arange(8.0)[:, None])
    greedy = SamplingConfig(temperature=0.0)  # an evaluation's greedy session
    session = Provenance([StageProvenance([(0, "p0"), (9, "p1")], [sketches], 7, [9]),
                          StageProvenance([(0, "q0")])], sampling=greedy)
    rollouts = [Rollout(prompt_tokens=prompt, completion_tokens=[9], behaviour_logprobs=[-1.0],
                        finished=True)
                for prompt in ([1], [1], [1, 2, 3], [1, 2, 3], [4, 5], [4, 5], [4, 5], [4, 5])]
    groups = [RolloutGroup(group_id=f"g{i}", task="sums", problem_index=i, stage_versions=[0, 0],
                           version_spans=[], sampling_seed=1, rollouts=rows)
              for i, rows in enumerate((rollouts[:2], rollouts[2:4], rollouts[4:]))]
    shares = group_shares(session, groups, dims=1)
    assert [(s.first_row, s.prompt_columns) for s in shares] == [(0, 3), (2, 3), (4, 3)]
    last = shares[2].stages[0]
    assert last.sketches[0].rows.tolist() == [0, 1, 2, 3]  # rows 4-7, renumbered
    assert last.sketches[0].positions.tolist() == [104, 105, 106, 107]
    assert last.sketches[0].values[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert (last.served, last.rebuilt, last.seed) == ([(0, "p0"), (9, "p1")], [9], 7)
    assert shares[2].stages[1].served == [(0, "q0")]
    assert not shares[2].stages[1].sketches[0].rows.numel()
    assert shares[0].peers() == {"p0", "p1", "q0"}
    assert all(share.sampling == greedy for share in shares)  # what its check draws with


@pytest.mark.parametrize("first_row", [-1, 3])
def test_a_last_stage_refuses_rows_beyond_any_session_it_accepts(
        first_row: int, tiny_model: LoadedModel) -> None:
    """`first_row` says how many rows of noise the verifier draws before the group's: bounded
    like a session (here 4 rows x 8 positions at most)."""
    checks = InboundChecks(tiny_model.spec, stage=1, num_stages=2, max_session_tokens=32)
    body = VerifyStep(session="s", start=0, batch=2, max_length=8, version=0, prompt_columns=2,
                      sampling=SamplingConfig(), sampling_seed=1, first_row=first_row)
    targets = torch.full((2, 8), -1, dtype=torch.long)
    with pytest.raises(PeerError, match="first_row"):
        checks.targets(body, {"targets": targets}, targets.shape)
    assert checks.targets(msgspec.structs.replace(body, first_row=2), {"targets": targets},
                          targets.shape) is targets


@pytest.mark.network
def test_in_a_two_group_session_the_honest_group_passes_and_the_forged_one_fails(
        tiny_sharp_dir: Path) -> None:
    """The last stage's replica forges the behaviour log-probs of the first group's rows only.
    The second group, the shorter prompt (so padded to the session's prompt columns) in rows
    4-7 (so scored against its rows' seeded draws and sketches), passes its check on every
    stage; the first fails at the last stage and the liar is blamed."""
    config = groups_config(tiny_sharp_dir)
    model = load_model(str(tiny_sharp_dir))
    layout = [(0, "training"), (1, "training")] + [(s, "inference") for s in (0, 0, 1, 1)]
    with start_swarm(config, layout) as swarm:
        liar = swarm.peer(1, "inference")
        service = serving(liar)
        real_infer = service.infer

        def forge_first_group(sender: str, body: InferenceStep,
                               tensors: dict[str, torch.Tensor]) -> Reply:
            reply = real_infer(sender, body, tensors)
            out = dict(reply.tensors or {})
            out["logprobs"] = out["logprobs"].clone()
            out["logprobs"][:GROUP] -= FORGED_SHIFT
            return Reply(reply.body, out, reply.codec)
        service.infer = forge_first_group  # type: ignore[method-assign]
        steps_through_infer(service)
        remote = swarm.chain(model.spec)
        remote.directory.refresh()
        route(remote, 1, [liar.node.peer_id], [])
        chain = ObservedChain(remote)
        short, long = unequal_prompts(config, model)
        groups = generate_session(config, model, chain, [long, short])
        [session] = chain.sessions
        assert session.batch == 2 * GROUP
        forged, honest = group_shares(session.provenance, groups, config.trust.sketch_dims)
        assert (honest.first_row, honest.prompt_columns) == (
            GROUP, len(groups[0].rollouts[0].prompt_tokens))
        passed = verify(swarm, config, model, remote, groups[1], honest)
        assert passed.outcome == "passed" and passed.checked == (0, 1), passed
        assert passed.token_gaps is not None and float(passed.token_gaps.max()) < 1e-3
        assert passed.token_margins is not None
        assert float(passed.token_margins.max()) < 1e-3
        failed = verify(swarm, config, model, remote, groups[0], forged)
        assert failed.outcome == "failed", failed
        assert (failed.stage, failed.peer) == (1, liar.node.peer_id), failed


@pytest.mark.network
def test_a_greedy_evaluation_group_is_judged_greedy(tiny_sharp_dir: Path) -> None:
    """An evaluation's greedy session (a row per problem, temperature 0): each group of one row
    re-executes under the sampling its session used (`Provenance.sampling`) and passes; judged
    as the run's sampled rollouts are, its argmax tokens would not be the seeded draws; and a
    forged log-prob still fails, blamed on the last stage's replica."""
    config = groups_config(tiny_sharp_dir)
    model = load_model(str(tiny_sharp_dir))
    layout = [(0, "training"), (1, "training")] + [(s, "inference") for s in (0, 1)]
    task = make_task(config.task.name, **config.task.options)
    with start_swarm(config, layout) as swarm:
        remote = swarm.chain(model.spec)
        made: list[tuple[list[RolloutGroup], Any]] = []
        evaluate(remote, task, model.tokenizer, GROUP, config.rollout.max_new_tokens, GROUP,
                 seed=config.seed, shape=TrainingShape(GROUP, sampling_config(config.rollout),
                                                       greedy=True),
                 on_groups=lambda groups, session: made.append((groups, session)))
        [(groups, session)] = [(g, s) for g, s in made if g[0].group_id.endswith("/greedy")]
        assert len(groups) == GROUP and all(len(g.rollouts) == 1 for g in groups)
        assert session.provenance.sampling == SamplingConfig(temperature=0.0)
        shares = group_shares(session.provenance, groups, config.trust.sketch_dims)
        group, share = groups[-1], shares[-1]
        passed = verify(swarm, config, model, remote, group, share)
        assert passed.outcome == "passed" and passed.checked == (0, 1), passed
        assert passed.token_margins is not None
        assert float(passed.token_margins.max()) < 1e-3
        as_sampled = verify(swarm, config, model, remote, group,
                            dataclasses.replace(share, sampling=None))
        assert as_sampled.outcome == "failed" and as_sampled.stage == 1, as_sampled
        [row] = group.rollouts
        forged = msgspec.structs.replace(group, rollouts=[msgspec.structs.replace(
            row, behaviour_logprobs=[v - FORGED_SHIFT for v in row.behaviour_logprobs])])
        failed = verify(swarm, config, model, remote, forged, share)
        assert failed.outcome == "failed", failed
        assert (failed.stage, failed.peer) == (1, swarm.peer(1, "inference").node.peer_id)
