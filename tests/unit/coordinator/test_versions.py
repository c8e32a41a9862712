"""Weight versions in rollouts: a stage's weights may change between two decode steps of a running
generation, and the group records which versions sampled which of its tokens (`version_spans`).
Local generation with weight swaps mid-generation, generation's span bookkeeping, ingestion
refusing spans that are malformed or disagree with `stage_versions`, and a swarm replica that
takes its training peer's published update while a session runs through it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from helpers import build
from swarm_helpers import ObservedChain, Swarm, start_swarm, tiny_run_config

from decentrl.config import RunConfig
from decentrl.coordinator.ingest import Ingestion, RejectedGroup
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.learn.batch import build_batch
from decentrl.learn.losses import StaleRolloutError, check_staleness
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.stages import StageModule
from decentrl.net.protocol import INFERENCE_STEP, Role, Rpc
from decentrl.rollout.chain import LocalChain, StepResult
from decentrl.rollout.generate import generate, version_spans
from decentrl.rollout.sampling import SamplingConfig, sampling_config
from decentrl.rollout.types import RolloutGroup, VersionSpan, check_version_spans
from decentrl.stage.peer import StagePeer
from decentrl.tasks import make_task

CPU = torch.device("cpu")
# A generous bound on a delta's trip from publisher to replica (well under a second on loopback).
UPDATE_WAIT_S = 60.0


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    """The tiny model with sharp distributions: a change of weights moves log-probs visibly (at
    the default init every distribution is nearly uniform, whatever the weights)."""
    return load_model(str(tiny_sharp_dir))


def run_config(model_dir: Path, num_stages: int, group_size: int, max_new_tokens: int,
               data_plane: str = "peer_to_peer") -> RunConfig:
    return tiny_run_config(model_dir, num_stages, rollout={
        "group_size": group_size, "prompts_per_step": 2, "max_new_tokens": max_new_tokens,
        "temperature": 0.9, "top_k": 30}, swarm={"data_plane": data_plane})


def rollout_worker(chain: Any, config: RunConfig, model: LoadedModel,
                   scheduler: PromptScheduler) -> RolloutWorker:
    task = make_task(config.task.name, **config.task.options)
    return RolloutWorker(chain, None, task, model.tokenizer, config.rollout, scheduler,
                         config.seed)


def fresh_weights(stage: StageModule, seed: int) -> dict[str, torch.Tensor]:
    """Another random model's weights for `stage`: every tensor redrawn with its own mean and
    spread (norm weights, all ones, stay ones)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: t.mean() + t.std() * torch.randn(t.shape, generator=generator)
            for name, t in stage.state_dict().items()}


def teacher_forced(stages: list[StageModule], group: RolloutGroup, config: RunConfig
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(behaviour log-probs [G, C], the same tokens' log-probs under `stages` in one pass over
    the whole sequences [G, C], the mask of real completion tokens [G, C])."""
    rows = len(group.rollouts)
    batch = build_batch(group.rollouts, [0.0] * rows, [0] * rows, 0)
    trainer = PipelineTrainer.local(stages, config.train,
                                    loss_config_from(config.train, config.rollout.max_new_tokens),
                                    sampling_config(config.rollout), torch.float32)
    return (batch.behaviour_logprobs, trainer._chain_logprobs(stages, batch),
            batch.completion_valid)


# ---- a local chain swaps weights between two decode steps ------------------------------------

def test_local_weight_swaps_mid_generation_are_recorded_per_token(
        sharp: LoadedModel, tiny_sharp_dir: Path) -> None:
    config = run_config(tiny_sharp_dir, 2, group_size=4, max_new_tokens=12)
    chain = LocalChain(build(sharp, 2))
    v1 = [fresh_weights(stage, seed=10 + i) for i, stage in enumerate(chain.stages)]
    # Step i samples completion token i (step 0 is the prefill): stage 1 moves to v1 after
    # token 3, stage 0 after token 6.
    swaps = {3: 1, 6: 0}  # after step -> the stage that moves to v1

    def swap(session: Any, step: int) -> None:
        if step in swaps:
            chain.load_stage(swaps[step], 1, v1[swaps[step]])
    observed = ObservedChain(chain, after_step=swap)
    scheduler = PromptScheduler(config.seed)
    groups = rollout_worker(observed, config, sharp, scheduler).generate_groups(scheduler.next(2))

    every_span = [VersionSpan(start=0, versions=[0, 0]), VersionSpan(start=4, versions=[0, 1]),
                  VersionSpan(start=7, versions=[1, 1])]
    assert max(len(r.completion_tokens) for r in groups[0].rollouts) > 7  # saw both swaps
    for group in groups:
        longest = max(len(r.completion_tokens) for r in group.rollouts)
        # A group whose rows all stopped before a swap does not list the later spans.
        assert group.version_spans == [s for s in every_span if s.start < longest]
        assert group.stage_versions == [0, 0]  # per stage, the oldest that sampled a token
        check_version_spans(group, 2)

    behaviour, under_v0, valid = teacher_forced(build(sharp, 2), groups[0], config)
    before, after = valid.clone(), valid.clone()
    before[:, 4:], after[:, :4] = False, False
    # Tokens 0-3 were computed with v0 alone: their behaviour log-probs are what a teacher-forced
    # v0 pass computes (to fp32 summation order, as in test_rollout's importance ratio of 1).
    torch.testing.assert_close(behaviour[before], under_v0[before], atol=1e-4, rtol=0)
    # Tokens from 4 on were sampled with stage 1 (from 7 on, both stages) at v1, and v0 would
    # have given them other log-probs. A teacher-forced v1 pass would not reproduce them either:
    # the cache the post-swap steps attend to holds the keys and values v0 computed for the
    # earlier positions, where a clean v1 pass has v1's. The spans name the weights that took
    # the sampling step, which is what the off-policy corrections weigh.
    assert (behaviour[after] - under_v0[after]).abs().min() > 1e-3


def test_spans_follow_the_versions_of_each_step_and_cover_only_a_rows_tokens() -> None:
    """Rows of one session share its steps; a row that stopped early lists only the spans that
    cover its tokens, and generation merges steps with equal versions into one span."""
    stop = 7
    script = [[5, stop, 6, 6, 6], [4, 4, 4, 4, 4]]
    step_versions = [(0, 0), (0, 1), (0, 1), (2, 1), (2, 1)]
    chain = ScriptedVersions(script, step_versions)
    first, second = generate(chain, [[1], [2]], 5, SamplingConfig(temperature=0.0), {stop}, 0)
    assert first.tokens == [5, stop] and len(second.tokens) == 5
    assert first.spans == [VersionSpan(start=0, versions=[0, 0]),
                           VersionSpan(start=1, versions=[0, 1])]
    assert second.spans == version_spans(step_versions) == [
        VersionSpan(start=0, versions=[0, 0]), VersionSpan(start=1, versions=[0, 1]),
        VersionSpan(start=3, versions=[2, 1])]
    assert first.versions == (0, 0) and second.versions == (0, 0)


class ScriptedVersions:
    """A chain whose sessions emit script[row][step] and report step_versions[step]."""

    def __init__(self, script: list[list[int]], step_versions: list[tuple[int, ...]]) -> None:
        self.script, self.step_versions = script, step_versions

    @property
    def device(self) -> torch.device:
        return CPU

    def versions(self) -> tuple[int, ...]:
        return self.step_versions[-1]

    def open_session(self, batch: int, max_length: int) -> ScriptedVersionsSession:
        return ScriptedVersionsSession(self)


class ScriptedVersionsSession:
    def __init__(self, chain: ScriptedVersions) -> None:
        self.chain, self.steps = chain, 0

    def step(self, *args: Any) -> StepResult:
        tokens = torch.tensor([row[self.steps] for row in self.chain.script])
        versions = self.chain.step_versions[self.steps]
        self.steps += 1
        return StepResult(tokens, torch.zeros(len(tokens)), versions)

    def close(self) -> None:
        pass


# ---- a rollout whose stages ran at different versions -----------------------------------------

def test_a_mixed_version_rollout_is_bounded_by_its_oldest_stage_and_corrected_as_recorded(
        sharp: LoadedModel, tiny_sharp_dir: Path) -> None:
    """Stage 0 at the learner's version 3, stage 1 three versions behind (other weights): the
    staleness the bound sees is the oldest stage's, and the loss weighs the tokens with the
    log-probs the mixed chain that sampled them recorded, which neither version alone gives."""
    config = tiny_run_config(tiny_sharp_dir, 2, rollout={
        "group_size": 4, "prompts_per_step": 1, "max_new_tokens": 8, "temperature": 0.9,
        "top_k": 30}, train={"micro_batch_size": 4, "max_staleness": 3})
    learner = build(sharp, 2)
    for stage in learner:
        stage.version = 3
    stale = fresh_weights(learner[1], seed=7)
    chain = LocalChain(build(sharp, 2))
    chain.load_stage(0, 3, learner[0].state_dict())
    chain.load_stage(1, 0, stale)
    scheduler = PromptScheduler(config.seed)
    worker = rollout_worker(chain, config, sharp, scheduler)
    [group] = worker.generate_groups(scheduler.next(1))
    assert group.stage_versions == [3, 0]

    # Ingestion and the loop's re-check before a batch both take the oldest stage.
    assert Ingestion(config, worker.task, sharp.tokenizer, scheduler).check(group, 3) == 3
    assert check_staleness(3, group.stage_versions, max_staleness=3) == 3
    with pytest.raises(StaleRolloutError):
        check_staleness(3, group.stage_versions, max_staleness=2)
    tighter = tiny_run_config(tiny_sharp_dir, 2, rollout=config.rollout.model_dump(),
                              train={"max_staleness": 2})
    with pytest.raises(StaleRolloutError):
        Ingestion(tighter, worker.task, sharp.tokenizer, scheduler).check(group, 3)

    mixed = build(sharp, 2)
    mixed[1].load_state_dict(stale)
    behaviour, under_mixed, valid = teacher_forced(mixed, group, config)
    _, under_learner, _ = teacher_forced(learner, group, config)
    torch.testing.assert_close(behaviour[valid], under_mixed[valid], atol=1e-4, rtol=0)
    assert (behaviour[valid] - under_learner[valid]).abs().max() > 0.1

    trainer = PipelineTrainer.local(learner, config.train,
                                    loss_config_from(config.train, config.rollout.max_new_tokens),
                                    sampling_config(config.rollout), torch.float32)
    batch = build_batch(group.rollouts, [1.0, -1.0, 0.5, -0.5], [3] * 4, 0)
    metrics = trainer.train_step(batch)
    # The loss's behaviour KL is KL(recorded mu || learner): k3 over the real tokens.
    log_ratio = (under_learner - behaviour)[valid]
    expected = (log_ratio.exp() - 1 - log_ratio).mean()
    assert metrics["behaviour_kl"] == pytest.approx(float(expected), rel=1e-3)
    assert metrics["behaviour_kl"] > 0.01


# ---- ingestion refuses spans that are malformed or disagree with stage_versions ---------------

def span(start: int, *versions: int) -> VersionSpan:
    return VersionSpan(start=start, versions=list(versions))


@pytest.mark.parametrize(("spans", "stage_versions", "message"), [
    ([], [0, 0], "version_spans is empty"),
    ([span(1, 0, 0)], [0, 0], "must start at token 0, the first starts at 1"),
    ([span(0, 0, 0), span(2, 1, 0), span(2, 1, 1)], [0, 0], "must increase: 2 follows 2"),
    ([span(0, 0, 0), span(2, 1, 0), span(1, 1, 1)], [0, 0], "must increase: 1 follows 2"),
    ([span(0, 0, 0), span(1, 0, 0)], [0, 0], "have the same versions"),
    ([span(0, 0, 0, 0)], [0, 0, 0], "has 3 versions, the run has 2 stages"),
    ([span(0, 0, -1)], [0, -1], "negative version"),
    ([span(0, 0, 0), span(99, 1, 0)], [0, 0], "at 99 covers no token"),
    # A group that claims fresher weights than sampled its first tokens, to pass staleness.
    ([span(0, 0, 0), span(1, 1, 0)], [1, 0], (r"stage_versions \[1, 0\] is not the per-stage "
                                              r"minimum of version_spans, \[0, 0\]")),

    # A later span that claims weights the learner has not made yet.
    ([span(0, 0, 0), span(1, 1, 0)], [0, 0], "rollout version 1 is newer than learner version 0"),
])
def test_ingestion_refuses_bad_version_spans(
        sharp: LoadedModel, tiny_sharp_dir: Path, spans: list[VersionSpan],
        stage_versions: list[int], message: str) -> None:
    config = run_config(tiny_sharp_dir, 2, group_size=2, max_new_tokens=4)
    scheduler = PromptScheduler(config.seed)
    worker = rollout_worker(LocalChain(build(sharp, 2)), config, sharp, scheduler)
    [group] = worker.generate_groups(scheduler.next(1))
    ingestion = Ingestion(config, worker.task, sharp.tokenizer, scheduler)
    bad = msgspec.structs.replace(group, version_spans=spans, stage_versions=stage_versions)
    with pytest.raises(RejectedGroup, match=message):
        ingestion.check(bad, learner_version=0)
    # Through ingest (the coordinator's path, which stores only what it returns): counted and
    # dropped, and nothing taken: the problem is still open to the genuine group.
    assert ingestion.ingest(bad, learner_version=0) is None
    assert (ingestion.stats.rejected, ingestion.stats.accepted) == (1, 0)
    assert ingestion.stats.reasons == {"RejectedGroup": 1}
    assert ingestion.ingest(group, learner_version=0) is not None


# ---- a swarm replica takes an update from its training peer while a session runs through it --

def publish_and_follow(swarm: Swarm, training_peer: StagePeer, replica_peer: StagePeer,
                       version: int, tensors: dict[str, torch.Tensor], timeout_s: float) -> None:
    """`version` of a stage's weights from its training peer to a replica, the way an optimizer
    step's update travels: the publisher encodes a delta against what it published before, the
    coordinator signs its hash into the stage's lineage; the replica fetches the plan and the chunks, checks the state hash and commits
    the changed entries on its compute thread, between two requests it serves."""
    assert training_peer.training is not None and replica_peer.replica is not None
    training_peer.training.publisher.publish(version, tensors).result(timeout_s)
    swarm.sign(training_peer, version)
    # The follow loop may have caught the announcement first; either way, once this returns
    # the replica holds the update (one sync at a time).
    replica_peer.node.run(replica_peer.replica.follow(), timeout=timeout_s)


@pytest.mark.network
def test_swarm_replica_update_mid_generation_is_recorded(
        sharp: LoadedModel, tiny_sharp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Relayed: the coordinator's calls show every stage's reply and its version.
    config = run_config(tiny_sharp_dir, 3, group_size=3, max_new_tokens=10,
                        data_plane="coordinator")
    layout: list[tuple[int, Role]] = [(0, "inference"), (1, "training"), (1, "inference"),
                                      (2, "inference")]
    with start_swarm(config, layout) as swarm:
        training_peer, replica_peer = swarm.peer(1, "training"), swarm.peer(1, "inference")
        assert training_peer.training is not None and replica_peer.replica is not None
        # Stands in for the weights an optimizer step leaves on the training peer.
        new = fresh_weights(training_peer.training.model, seed=1)
        stage_of = {peer.node.peer_id: peer.index for peer in swarm.peers}
        replies: list[tuple[int, int]] = []  # (stage, version) of every inference reply
        call_sync = swarm.client.call_sync

        def recording_call(peer: str, rpc: Rpc[Any, Any], *args: Any, **kwargs: Any) -> Any:
            reply, out = call_sync(peer, rpc, *args, **kwargs)
            if rpc is INFERENCE_STEP:
                replies.append((stage_of[peer], reply.version))
            return reply, out
        monkeypatch.setattr(swarm.client, "call_sync", recording_call)

        # Another thread publishes v1 of stage 1 once the prefill is done and has the replica
        # follow it; generation does not wait for it before step 3, so the update lands between
        # two decode steps somewhere in between, wherever the replica's compute thread takes it.
        prefilled, followed = threading.Event(), threading.Event()
        update_errors: list[BaseException] = []

        def update() -> None:
            try:
                assert prefilled.wait(UPDATE_WAIT_S)
                publish_and_follow(swarm, training_peer, replica_peer, 1, new, UPDATE_WAIT_S)
            except BaseException as error:  # noqa: BLE001 - reported by the session's wait
                update_errors.append(error)
            finally:
                followed.set()

        def after_step(session: Any, step: int) -> None:
            if step == 0:
                prefilled.set()
            if step == 2:
                assert followed.wait(2 * UPDATE_WAIT_S)
                assert not update_errors, f"the update failed: {update_errors}"

        updater = threading.Thread(target=update, daemon=True)
        updater.start()
        chain = ObservedChain(swarm.chain(sharp.spec), after_step=after_step)
        scheduler = PromptScheduler(config.seed)
        [group] = rollout_worker(chain, config, sharp, scheduler).generate_groups(
            scheduler.next(1))
        updater.join(UPDATE_WAIT_S)
        # The replica serves exactly what the publisher published, and it came as a delta.
        publisher, follower = training_peer.training.publisher, replica_peer.replica.follower
        assert (replica_peer.version, follower.state.hash) == (1, publisher.state.hash)
        assert ("delta", 1) in follower.updates
        served = replica_peer.replica.served.model.state_dict()
        for name, value in publisher.state.tensors.items():
            assert torch.equal(served[name].float(), value), name

    # One reply per stage and step, in stage order (no failover happened).
    steps = len(replies) // 3
    assert [stage for stage, _ in replies] == [0, 1, 2] * steps
    step_versions = [tuple(v for _, v in replies[i:i + 3]) for i in range(0, len(replies), 3)]
    # A step per token: the group's longest completion is as long as the session ran.
    assert steps == max(len(r.completion_tokens) for r in group.rollouts)
    assert group.version_spans == version_spans(step_versions)
    switched = step_versions.index((0, 1, 0))
    assert 1 <= switched <= 3
    assert group.version_spans == [span(0, 0, 0, 0), span(switched, 0, 1, 0)]
    assert group.stage_versions == [0, 0, 0]
    check_version_spans(group, 3)
