"""A run's evaluation looks like its training to the peers and is spot-checked like it, and a run
whose stage lost every inference replica waits for one.

- An evaluation session is a training session's shape: the same batch (a group), sampling, seeded
  draws and token budget, on the local chain and in what a swarm replica receives.
- Its groups re-execute as a training group's do (the verifier's layout and seeded margins), and
  a replica that lies only during evaluation is caught by an evaluation spot-check and banned.
- An evaluation session that fails is run again (the others are kept); generation and
  evaluation wait for a stage's replica (`StageWait`), saying so, up to `swarm.stage_wait_s`."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build, layout_logits
from rich.console import Console
from swarm_helpers import Swarm, start_peer, start_swarm, tiny_run_config

from decentrl.config import RunConfig
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.coordinator.manifest import admit
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.stage_wait import StageWait, unserved_stages
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.coordinator.worker import RolloutWorker
from decentrl.evaluate.runner import EvalResult, TrainingShape, evaluate
from decentrl.launch.adversary import HostileInference
from decentrl.model.loading import load_model
from decentrl.net.directory import SwarmUnavailable
from decentrl.net.node import Reply, Request
from decentrl.net.protocol import INFERENCE_STEP, InferenceStep, PeerRecord
from decentrl.rollout.chain import LocalChain, StepResult, step_generator
from decentrl.rollout.generate import step_seed
from decentrl.rollout.sampling import (
    SamplingConfig,
    sampling_config,
    sampling_logprobs,
    sampling_margin,
    sampling_noise,
)
from decentrl.rollout.types import RolloutGroup
from decentrl.stage.inference import InferenceService
from decentrl.stage.peer import StagePeer
from decentrl.tasks import make_task
from decentrl.trust.tribunal import Ruling
from decentrl.trust.verify import Verdict, session_layout


def eval_config(model_dir: Path, **overrides: Any) -> RunConfig:
    """Training and evaluation with one token budget and task family, as a run that wants its
    evaluation indistinguishable sets them."""
    return tiny_run_config(model_dir, 2, **{
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6,
                    "temperature": 0.9, "top_k": 40},
        "eval": {"problems": 4, "pass_k": 1, "max_new_tokens": 6, "batch_size": 4},
        **overrides})


# ---- the shape of an evaluation session, locally --------------------------------------------

class RecordingChain:
    """A LocalChain that records every session's (batch, max_length) and every step's (fed
    width, sampling, seed)."""

    def __init__(self, chain: LocalChain) -> None:
        self.chain = chain
        self.sessions: list[tuple[int, int]] = []
        self.steps: list[tuple[int, SamplingConfig, int | None]] = []

    @property
    def device(self) -> torch.device:
        return self.chain.device

    def versions(self) -> tuple[int, ...]:
        return self.chain.versions()

    def open_session(self, batch: int, max_length: int) -> Any:
        self.sessions.append((batch, max_length))
        session, steps = self.chain.open_session(batch, max_length), self.steps

        class Recorded:
            def step(self, tokens: torch.Tensor, positions: torch.Tensor,
                     key_valid: torch.Tensor, sampling: SamplingConfig, seed: int | None
                     ) -> StepResult:
                steps.append((tokens.shape[1], sampling, seed))
                return session.step(tokens, positions, key_valid, sampling, seed)

            def close(self) -> None:
                session.close()

        return Recorded()


def test_evaluation_sessions_are_training_groups_and_re_execute(tiny_sharp_dir: Path) -> None:
    model = load_model(str(tiny_sharp_dir))
    config = eval_config(tiny_sharp_dir)
    stages = build(model, 2)
    task = make_task(config.task.name, **config.task.options)
    training = RecordingChain(LocalChain(stages))
    worker = RolloutWorker(training, None, task, model.tokenizer, config.rollout,
                           PromptScheduler(config.seed), config.seed)
    trained = worker.generate_groups([3])[0]
    evaluation = RecordingChain(LocalChain(stages))
    groups: list[RolloutGroup] = []
    shape = TrainingShape(config.rollout.group_size, sampling_config(config.rollout))
    result = evaluate(evaluation, task, model.tokenizer, 3, config.eval.max_new_tokens,
                      config.eval.batch_size, seed=config.seed, shape=shape,
                      on_groups=lambda made, session: groups.extend(made))

    group_size, budget = config.rollout.group_size, config.rollout.max_new_tokens
    (train_batch, train_length), = training.sessions
    assert train_batch == group_size
    assert evaluation.sessions and all(batch == group_size for batch, _ in evaluation.sessions)
    # The same room for new tokens after the prompt.
    assert train_length - len(trained.rollouts[0].prompt_tokens) == budget
    prompts = [len(g.rollouts[0].prompt_tokens) for g in groups]
    assert [length - prompt for (_, length), prompt in zip(evaluation.sessions, prompts)] \
        == [budget] * 3
    # Every step samples as training does, from a seed: never greedy, never unseeded.
    assert {s for _, s, _ in evaluation.steps} == {s for _, s, _ in training.steps} \
        == {sampling_config(config.rollout)}
    assert all(seed is not None for _, _, seed in evaluation.steps)
    assert not {seed for *_, seed in evaluation.steps} & {seed for *_, seed in training.steps}
    # pass@1 is the mean success of the samples, at the rollout's temperature.
    assert result.pass1_temperature == config.rollout.temperature
    assert len(groups) == 3 and all(len(g.rollouts) == group_size for g in groups)

    # Each group re-executes as a spot-check does it: one prefill over the verifier's layout
    # gives every claimed log-prob again, and every token is the seeded draw (margin 0).
    sampling = sampling_config(config.rollout)
    for group in groups:
        layout = session_layout(group, model.tokenizer.pad_token_id)
        logits = layout_logits(stages, layout)
        scored = layout.targets >= 0
        again = sampling_logprobs(logits[scored], layout.targets[scored], sampling)
        torch.testing.assert_close(again, layout.claimed[scored], rtol=0, atol=1e-4)
        for column in range(layout.prompt_columns - 1, layout.width):
            rows = scored[:, column]
            if not rows.any():
                continue
            step = column - layout.prompt_columns + 1
            noise = sampling_noise(step_generator(step_seed(group.sampling_seed, step)),
                                   len(group.rollouts), logits.shape[-1])
            margins = sampling_margin(logits[:, column], layout.targets[:, column].clamp(min=0),
                                      sampling, noise)
            assert margins[rows].abs().max() < 1e-4


def test_greedy_sessions_give_the_plain_greedy_evaluations_pass1(tiny_sharp_dir: Path) -> None:
    """`TrainingShape.greedy`: one greedy row per problem, a training session's rows per session
    (here 2 problems x 2 samples = 4, the plain evaluation's batch too, so both compute alike),
    seeded apart from the sampled sessions, counted in the progress, handed to `on_groups` as
    groups of one row that re-execute greedy."""
    model = load_model(str(tiny_sharp_dir))
    config = eval_config(tiny_sharp_dir)
    stages = build(model, 2)
    task = make_task(config.task.name, **config.task.options)
    budget, count = config.eval.max_new_tokens, 6
    shape = TrainingShape(2, sampling_config(config.rollout), problems_per_session=2, greedy=True)
    chain = RecordingChain(LocalChain(stages))
    groups: list[RolloutGroup] = []
    progress: list[tuple[int, int]] = []
    result = evaluate(chain, task, model.tokenizer, count, budget, 4, seed=config.seed,
                      shape=shape, on_groups=lambda made, session: groups.extend(made),
                      progress=lambda done, total: progress.append((done, total)))
    plain = evaluate(LocalChain(stages), task, model.tokenizer, count, budget, 4,
                     seed=config.seed)

    assert result.greedy_pass1 == plain.pass1 and plain.pass1_temperature is None
    assert result.pass1_temperature == config.rollout.temperature
    greedy = [g for g in groups if g.group_id.endswith("/greedy")]
    assert [g.problem_index for g in greedy] == list(range(count))
    assert all(len(g.rollouts) == 1 for g in greedy)
    # Token for token the plain greedy evaluation's completions.
    assert [{"question": task.problem("heldout", g.problem_index).question,
             "completion": model.tokenizer.decode(g.rollouts[0].completion_tokens,
                                                  skip_special_tokens=True),
             "correct": plain.samples[i]["correct"]} for i, g in enumerate(greedy)] \
        == plain.samples[:count]
    # 6 problems x 2 sampled rows, and 6 greedy rows.
    assert progress[-1] == (18, 18) and {total for _, total in progress} == {18}
    # Sessions of 4 rows (the last greedy one holds the 2 problems left), greedy steps seeded
    # apart from the sampled ones.
    assert sorted(batch for batch, _ in chain.sessions) == [2, 4, 4, 4, 4]
    greedy_seeds = {seed for _, sampling, seed in chain.steps if sampling.greedy}
    sampled_seeds = {seed for _, sampling, seed in chain.steps if not sampling.greedy}
    assert greedy_seeds and None not in greedy_seeds
    assert not greedy_seeds & sampled_seeds
    # A spot-check of a greedy group judges it greedy: every token is the top one (margin 0).
    argmax = SamplingConfig(temperature=0.0)
    for group in greedy:
        layout = session_layout(group, model.tokenizer.pad_token_id)
        logits = layout_logits(stages, layout)
        scored = layout.targets >= 0
        margins = sampling_margin(logits[scored], layout.targets[scored], argmax,
                                  torch.ones_like(logits[scored]))
        assert margins.abs().max() < 1e-4


def test_without_greedy_a_training_shaped_evaluation_has_no_greedy_pass1(
        tiny_sharp_dir: Path) -> None:
    model = load_model(str(tiny_sharp_dir))
    config = eval_config(tiny_sharp_dir)
    task = make_task(config.task.name, **config.task.options)
    chain = RecordingChain(LocalChain(build(model, 2)))
    progress: list[tuple[int, int]] = []
    result = evaluate(chain, task, model.tokenizer, 3, config.eval.max_new_tokens, 4,
                      seed=config.seed, shape=TrainingShape(2, sampling_config(config.rollout)),
                      progress=lambda done, total: progress.append((done, total)))
    assert result.greedy_pass1 is None
    assert progress[-1] == (6, 6)
    assert not any(sampling.greedy for _, sampling, _ in chain.steps)


# ---- a failed evaluation session runs again --------------------------------------------------

def test_a_failed_evaluation_session_runs_again_and_the_others_are_kept(
        tiny_sharp_dir: Path) -> None:
    model = load_model(str(tiny_sharp_dir))
    config = eval_config(tiny_sharp_dir)
    task = make_task(config.task.name, **config.task.options)
    shape = TrainingShape(config.rollout.group_size, sampling_config(config.rollout))

    def run(chain: Any, retry: Callable[[Exception, int], None] | None = None) -> EvalResult:
        return evaluate(chain, task, model.tokenizer, 3, 6, 4, seed=config.seed, shape=shape,
                        retry=retry)

    clean = run(LocalChain(build(model, 2)))

    class FailsOnce(RecordingChain):
        failed = False

        def open_session(self, batch: int, max_length: int) -> Any:
            if len(self.sessions) == 1 and not self.failed:  # the second session, once
                self.failed = True
                raise SwarmUnavailable("no inference peer serves stage 1")
            return super().open_session(batch, max_length)

    retried: list[tuple[str, int]] = []
    chain = FailsOnce(LocalChain(build(model, 2)))
    again = run(chain, lambda error, failures: retried.append((str(error), failures)))
    assert retried == [("no inference peer serves stage 1", 1)]
    assert len(chain.sessions) == 3  # one per problem: the failed one ran once more, no other
    assert again.pass1 == clean.pass1 and again.samples == clean.samples

    def give_up(error: Exception, failures: int) -> None:
        raise error

    with pytest.raises(SwarmUnavailable, match="stage 1"):
        run(FailsOnce(LocalChain(build(model, 2))), give_up)


# ---- waiting for a stage's replica -----------------------------------------------------------

def record(stage: int, role: str = "inference") -> PeerRecord:
    return PeerRecord(name="p", stage=stage, layers=(0, 1), role=role,  # type: ignore[arg-type]
                      version=0, tokens_per_s=0.0, free_sessions=4, training_ready=False)


class FakeDirectory:
    def __init__(self, stages: list[list[tuple[str, PeerRecord]]]) -> None:
        self.stages, self.refreshes = stages, 0

    def refresh(self) -> None:
        self.refreshes += 1

    def stage_peers(self) -> list[list[tuple[str, PeerRecord]]]:
        return [list(peers) for peers in self.stages]


def test_unserved_stages_name_what_each_stage_lacks() -> None:
    stages = [[("a", record(0)), ("t", record(0, "training"))], [("b", record(1))], []]
    assert unserved_stages(stages, lambda peer: False) == ["stage 2 has no inference replica"]
    assert unserved_stages(stages, {"b"}.__contains__) == [
        "stage 1 has no inference replica (1 banned)", "stage 2 has no inference replica"]


def test_stage_wait_returns_when_a_ban_ends_and_fails_after_its_limit() -> None:
    banned = {"b"}
    directory = FakeDirectory([[("a", record(0))], [("b", record(1))]])
    out = io.StringIO()
    wait = StageWait(directory, banned.__contains__, limit_s=30, console=Console(file=out))
    threading.Timer(1.5, banned.clear).start()  # the ban ends
    started = time.monotonic()
    wait.until_served(None)
    assert 1.5 <= time.monotonic() - started < 10
    text = out.getvalue()
    assert "waiting for peers: stage 1 has no inference replica (1 banned)" in text
    assert "every stage has an inference replica again" in text
    assert directory.refreshes >= 1
    wait.until_served(None)  # served: returns at once

    stop = threading.Event()
    stop.set()
    directory.stages[1] = []
    wait.until_served(stop)  # the run is stopping: no wait
    short = StageWait(directory, banned.__contains__, limit_s=1.5, console=Console(file=out))
    with pytest.raises(SwarmUnavailable, match=r"after waiting 2s \(swarm.stage_wait_s\), "
                                               r"stage 1 has no inference replica"):
        short.until_served(None)


# ---- in a swarm ------------------------------------------------------------------------------

LAYOUT = [(0, "training"), (1, "training"), (0, "inference")]


class RecordingInference:
    """An honest inference service whose INFERENCE_STEP requests are recorded as received."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.received: list[tuple[InferenceStep, dict[str, tuple[int, ...]]]] = []

    def handlers(self) -> list[tuple[Any, Any]]:
        return [(rpc, self._recorded(handler) if rpc is INFERENCE_STEP else handler)
                for rpc, handler in self.service.handlers()]

    def _recorded(self, handler: Any) -> Any:
        async def handle(request: Request[InferenceStep]) -> Reply:
            self.received.append((request.body, {name: tuple(t.shape)
                                                 for name, t in request.tensors.items()}))
            return await handler(request)
        return handle


def request_kinds(received: list[tuple[InferenceStep, dict[str, tuple[int, ...]]]]
                  ) -> set[tuple[Any, ...]]:
    """What a replica can tell of each request, with the prompt's length factored out: a
    session's first request (its prompt) or a later one, the batch, the room left for new
    tokens, the sampling, whether it is seeded, and the tensors' shapes but for the prompt."""
    prompts: dict[str, int] = {}
    kinds = set()
    for body, shapes in received:
        if body.start == 0:
            prompts[body.session] = shapes["inputs"][1]
        prompt = prompts[body.session]
        first = body.start == 0
        kinds.add((first, body.batch, body.max_length - prompt, body.sampling,
                   body.seed is not None, shapes["inputs"][0],
                   None if first else shapes["inputs"][1:], shapes["positions"][0]))
    return kinds


@pytest.mark.network
def test_a_replica_receives_the_same_requests_from_evaluation_as_from_training(
        tiny_sharp_dir: Path) -> None:
    # Relayed: the recorder sees every step's request as the coordinator sends it.
    config = eval_config(tiny_sharp_dir, swarm={"data_plane": "coordinator"})
    model = load_model(str(tiny_sharp_dir))
    with start_swarm(config, LAYOUT) as swarm:
        recorders: list[RecordingInference] = []

        def recording(service: InferenceService) -> RecordingInference:
            recorders.append(RecordingInference(service))
            return recorders[-1]

        join(swarm, config, "recorder", recording)
        (recorder,) = recorders
        chain = swarm.chain(model.spec)
        task = make_task(config.task.name, **config.task.options)
        worker = RolloutWorker(chain, None, task, model.tokenizer, config.rollout,
                               PromptScheduler(config.seed), config.seed)
        worker.generate_groups([0])
        worker.generate_groups([1])
        training = request_kinds(recorder.received)
        recorder.received.clear()
        evaluate(chain, task, model.tokenizer, 2, config.eval.max_new_tokens,
                 config.eval.batch_size, seed=config.seed,
                 shape=TrainingShape(config.rollout.group_size, sampling_config(config.rollout)))
        evaluation = request_kinds(recorder.received)
    assert evaluation == training
    assert {kind[3] for kind in evaluation} == {sampling_config(config.rollout)}
    assert all(kind[4] for kind in evaluation)  # seeded


def join(swarm: Swarm, config: RunConfig, name: str,
         wrap: Callable[[InferenceService], Any] | None = None) -> StagePeer:
    """A last-stage inference replica (its service wrapped by `wrap`) that joins `swarm`."""
    peer = start_peer(config, 1, "inference", swarm.client.addresses(), swarm.client.peer_id,
                      name=name, wrap_inference=wrap)
    swarm.peers.append(peer)
    swarm.sockets.extend(peer.node.socket_paths())
    return peer


class LiesDuringEvaluation(HostileInference):
    """Forges its log-probs, but only while `lying` is set (the test tells it when an evaluation
    runs: the peers themselves cannot tell)."""

    def __init__(self, service: InferenceService, lying: threading.Event) -> None:
        super().__init__(service, "forge-logprobs")
        self.lying = lying

    def _infer(self, sender: str, body: InferenceStep, tensors: dict[str, torch.Tensor]
               ) -> Reply:
        if self.lying.is_set():
            return super()._infer(sender, body, tensors)
        return self.service.infer(sender, body, tensors)


class DuringEvaluation(RunHooks):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        self.event.set()

    def after_evaluation(self, loop: TrainingLoop, label: str, result: EvalResult) -> None:
        self.event.clear()


@pytest.mark.network
def test_a_replica_that_lies_only_in_evaluation_is_caught_by_an_evaluation_check(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    config = eval_config(
        tiny_sharp_dir, host={"run_dir": str(tmp_path / "runs")},
        train={"steps": 2, "micro_batch_size": 8, "max_staleness": 2,
               "zero_variance_groups": "keep", "lr": 1e-3},
        eval={"problems": 8, "pass_k": 1, "max_new_tokens": 6, "batch_size": 4},
        swarm={"sessions_in_flight": 2, "announce_every_s": 1.0, "avoid_failed_peer_s": 2.0},
        trust={"verify_fraction": 1.0, "ban_s": 600.0})
    lying = threading.Event()
    with start_swarm(config, [*LAYOUT, (1, "inference")]) as swarm:
        liar = join(swarm, config, "liar", lambda s: LiesDuringEvaluation(s, lying))
        loop, verdicts = coordinate_and_run(config, swarm, [DuringEvaluation(lying)])
        reputation = loop.backend.trust.reputation
        culprit = liar.node.peer_id
        failed = [(v, reason) for v, reason in verdicts if v.outcome == "failed"]
        assert failed, verdicts
        assert {reason for _, reason in failed} == {"evaluation"}
        assert {(v.peer, v.stage) for v, _ in failed} == {(culprit, 1)}
        assert all(v.group_id.startswith("eval/") for v, _ in failed)
        assert reputation.banned(culprit)
        for peer in swarm.peers:
            if peer is not liar:
                assert not reputation.banned(peer.node.peer_id), \
                    reputation.counts(peer.node.peer_id)
        # Honest evaluation groups checked out too.
        assert any(v.outcome == "passed" and reason == "evaluation" for v, reason in verdicts)
        # The greedy sessions' groups (eval.greedy) were checked too, greedy: an honest replica's
        # argmax tokens failed none (no honest peer is banned above).
        assert any(v.group_id.endswith("/greedy") for v, _ in verdicts)


def coordinate_and_run(config: RunConfig, swarm: Swarm, hooks: list[RunHooks],
                       console: Console | None = None
                       ) -> tuple[TrainingLoop, list[tuple[Verdict, str]]]:
    """Run a coordinator over `swarm` to the end; the loop and every verdict with its reason."""
    (config.path / "checkpoints").mkdir(parents=True, exist_ok=True)
    admit(config.path, [p.node.peer_id for p in swarm.peers if p.training is not None])
    loop = swarm_run(config, swarm.client, console or Console(quiet=True), hooks)
    verdicts: list[tuple[Verdict, str]] = []
    trust = loop.backend.trust
    judge = trust.judge

    def recorded(ruling: Ruling, provenance: Any, reason: str) -> None:
        verdicts.append((ruling.verdict, reason))
        judge(ruling, provenance, reason)

    trust.judge = recorded  # type: ignore[method-assign]
    try:
        summary = loop.run(wait_s=60)
        assert summary.steps == config.train.steps
        deadline = time.monotonic() + 60  # the last checks finish off the training path
        while not trust.queue.empty() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        loop.close()
    return loop, verdicts


class WatchedOutput(io.StringIO):
    """A console's output that sets `seen` once `text` was written."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.seen = text, threading.Event()

    def write(self, chunk: str) -> int:
        written = super().write(chunk)
        if self.text in self.getvalue():
            self.seen.set()
        return written


class ReplaceLastStage(RunHooks):
    """After step `at_step`, the only last-stage replica goes away; a new one joins once the
    coordinator says it waits for one (`waiting`: its announcement expired, the stage is empty)."""

    def __init__(self, swarm: Swarm, config: RunConfig, at_step: int,
                 waiting: threading.Event) -> None:
        self.swarm, self.config = swarm, config
        self.at_step, self.waiting = at_step, waiting
        self.joined = threading.Event()

    def after_step(self, loop: TrainingLoop, record: Any) -> None:
        if record.step != self.at_step:
            return
        self.swarm.kill(self.swarm.peer(1, "inference"))

        def replace() -> None:
            if self.waiting.wait(timeout=120):
                join(self.swarm, self.config, "replacement")
                self.joined.set()

        threading.Thread(target=replace, name="replace last stage", daemon=True).start()


@pytest.mark.network
@pytest.mark.parametrize("at_step", [1, 3], ids=["generation waits", "final evaluation waits"])
def test_a_run_whose_last_stage_lost_its_replica_waits_for_a_new_one(
        at_step: int, tiny_sharp_dir: Path, tmp_path: Path) -> None:
    config = eval_config(
        tiny_sharp_dir, host={"run_dir": str(tmp_path / "runs")},
        train={"steps": 3, "micro_batch_size": 8, "max_staleness": 2,
               "zero_variance_groups": "keep", "lr": 1e-3},
        swarm={"sessions_in_flight": 2, "announce_every_s": 1.0, "avoid_failed_peer_s": 2.0, "retries": 2},
        trust={"verify_fraction": 0.0})
    out = WatchedOutput("waiting for peers: stage 1 has no inference replica")
    with start_swarm(config, [*LAYOUT, (1, "inference")]) as swarm:
        # The dead replica's announcement lives 5 announcements (5 s): then the stage is empty,
        # and the coordinator waits (which the replacement waits for, not for a time).
        replacing = ReplaceLastStage(swarm, config, at_step, out.seen)
        loop, _ = coordinate_and_run(config, swarm, [replacing],
                                     Console(file=out, width=200))
        assert replacing.joined.is_set()
        assert loop.step == config.train.steps
    text = out.getvalue()
    assert "waiting for peers: stage 1 has no inference replica" in text, text
    assert "every stage has an inference replica again" in text, text
    assert (config.path / "eval_after.json").is_file()
