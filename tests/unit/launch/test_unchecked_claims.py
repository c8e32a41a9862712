"""Claims nobody checks steer nothing: a stranger's announcement cannot stall an evaluation
(coordinator/replica_wait.py), draw joiners away from a stage (`--stage auto`, launch/join.py), or
make followers wait on a chunk owner that never serves (sync/sources.py). Each attack comes
from a node that is not the coordinator, and honest work goes on unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from swarm_helpers import start_node, start_swarm, tiny_run_config, weights_of

from decentrl.coordinator.replica_wait import REPLICA_LOOK_S, wait_for_routed_replicas
from decentrl.launch.adversary import BOASTED_SESSIONS
from decentrl.launch.join import choose_stage
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.link import LinkProfile
from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.protocol import SYNC_CHUNK, ChunkRequest, PeerRecord, stage_key
from decentrl.net.wire import TensorLimits, encode_struct
from decentrl.sync.sources import (
    AVOIDED_KEPT,
    BACKOFF_S,
    PROBE_ANSWER_S,
    PROBES_PER_UPDATE,
    SERVED_KEPT,
    SERVED_LIFETIME_S,
    ChunkSources,
)
from tests.swarm.test_signed_records import nodes
from tests.swarm.test_sync import assert_serves_published, fake_step, follow_all, sync_config


def replica_record(name: str, stage: int, version: int = 0,
                   free_sessions: int = 4) -> PeerRecord:
    return PeerRecord(name=name, stage=stage, layers=(0, 2), role="inference", version=version,
                      tokens_per_s=0.0, free_sessions=free_sessions, training_ready=False)


def announce(node: SwarmNode, run: str, record: PeerRecord) -> None:
    """`record` under its stage's key of `run`, written by `node`, and read back from there."""
    key = stage_key(run, record.stage)
    node.run(node.announce(key, encode_struct(record), 60), timeout=30)
    assert node.peer_id in node.run(node.lookup(key), timeout=30)


class Clock:
    """A clock that moves only when the code under test sleeps (or the test moves it)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def never_sleeps(seconds: float) -> None:
    raise AssertionError(f"the wait slept {seconds}s: it waited on a claim")


# ---- the evaluation's wait for replicas --------------------------------------------------------

@pytest.mark.network
def test_a_fake_replica_record_does_not_stall_the_evaluation(tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm, \
            nodes(1, swarm.client.addresses()) as (stranger,):
        stranger.dht_storage.join(RunNamespace.of(config, swarm.client.peer_id))
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        fake_step(swarm, trainer_peer, 1)
        follow_all([replica])  # the honest replica serves v1 and says so
        # A stranger announces a replica of stage 0 that stays at v0 forever.
        announce(stranger, config.name, replica_record("stuck", 0, version=0))
        directory = swarm.directory()
        records = directory.records()
        assert records[stranger.peer_id].version == 0 and records[replica.node.peer_id].version == 1
        waited = wait_for_routed_replicas(directory, 1, clock=Clock(), sleep=never_sleeps)
        assert waited.complete and waited.ready == [[replica.node.peer_id]]
        assert waited.waited_s == 0 and "quorum" in waited.text()


class Replicas:
    """A directory of one stage whose routed replicas the test sets, round by round."""

    num_stages = 1

    def __init__(self, rounds: list[dict[str, int]], talked_to: set[str]) -> None:
        self.rounds, self.talked_to, self.round = rounds, talked_to, -1

    def refresh(self) -> None:
        self.round = min(self.round + 1, len(self.rounds) - 1)

    def routed(self, stage: int) -> list[tuple[str, PeerRecord]]:
        return [(peer, replica_record(peer, stage, version))
                for peer, version in self.rounds[self.round].items()]

    def sessions_opened(self) -> dict[str, int]:
        return {peer: 1 for peer in self.talked_to}


def test_the_wait_ends_when_a_replica_it_routes_to_catches_up() -> None:
    clock = Clock()
    directory = Replicas([{"honest": 0, "stuck": 0}, {"honest": 0, "stuck": 0},
                          {"honest": 1, "stuck": 0}], talked_to={"honest"})
    waited = wait_for_routed_replicas(directory, 1, clock=clock, sleep=clock.sleep)
    assert waited.complete and waited.ready == [["honest"]]
    assert clock.slept == [REPLICA_LOOK_S] * 2


def test_a_new_identitys_claim_alone_does_not_end_the_wait_and_the_bound_does() -> None:
    # The coordinator gave sessions to "honest", still at v0; a new identity says v1.
    clock = Clock()
    directory = Replicas([{"honest": 0, "newcomer": 1}], talked_to={"honest"})
    waited = wait_for_routed_replicas(directory, 1, bound_s=5.0, clock=clock,
                                      sleep=clock.sleep)
    assert not waited.complete and waited.ready == [[]]
    assert waited.waited_s == 5.0 and "no quorum; stage 0: none of 2 routed" in waited.text()
    # Before any session (the first evaluation), whatever is routed counts.
    fresh = Replicas([{"honest": 1, "newcomer": 0}], talked_to=set())
    assert wait_for_routed_replicas(fresh, 1, clock=Clock(), sleep=never_sleeps).complete


def test_a_stage_with_no_replica_to_route_to_is_left_to_the_sessions_wait() -> None:
    # The stage's only replica died: its record expires, and the wait ends there (the sessions'
    # StageWait waits for a new one, and says so).
    clock = Clock()
    directory = Replicas([{"dead": 0}, {}], talked_to={"dead"})
    waited = wait_for_routed_replicas(directory, 1, clock=clock, sleep=clock.sleep)
    assert waited.done and not waited.complete and clock.slept == [REPLICA_LOOK_S]
    assert "stage 0: no replica routed" in waited.text()


# ---- --stage auto ------------------------------------------------------------------------------

JOINERS = 6


@pytest.mark.network
def test_stage_auto_spreads_joiners_despite_a_boasting_record(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2)
    with nodes(2 + JOINERS) as (owner, boaster, *joiners):
        for node in (owner, boaster, *joiners):  # every node of the run keeps its records
            node.dht_storage.join(RunNamespace.of(config, owner.peer_id))
        # A stranger's record claims room for a million sessions at stage 0 (BoastingPeer's).
        announce(boaster, config.name, replica_record("boaster", 0,
                                                      free_sessions=BOASTED_SESSIONS))
        chosen = []
        for number, joiner in enumerate(joiners):  # one after another, as peers join
            stage = choose_stage(joiner, config, "inference")
            chosen.append(stage)
            announce(joiner, config.name, replica_record(f"joiner{number}", stage))
        # Each announcing peer counts once: the stages never differ by more than one replica,
        # the boaster included.
        per_stage = [chosen.count(stage) + (stage == 0) for stage in (0, 1)]
        assert abs(per_stage[0] - per_stage[1]) <= 1, chosen
        assert chosen[0] == 1  # the stage without a replica first
        assert owner.peer_id  # the bootstrap node: no part in the choice


# ---- weight-sync chunk owners ------------------------------------------------------------------

@pytest.mark.network
def test_a_fake_chunk_owner_does_not_make_followers_wait(tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        stranger = start_node(config, "stranger", swarm.client.addresses(), TensorLimits(),
                              LinkProfile())
        stranger.dht_storage.join(RunNamespace.of(config, swarm.client.peer_id))
        follower = weights_of(replica).follower
        # For each request the stranger got: whether the follower held every chunk of v1 then.
        asked: list[bool] = []
        try:
            stranger.sizes = swarm.client.sizes or trainer_peer.node.sizes

            async def anyone(sender: str, rpc: object) -> None:
                pass  # the attacker's own node takes any request
            stranger.authorize = anyone

            async def hold_forever(request: Request[ChunkRequest]) -> Reply:
                held = follower.updates.get(("delta", 1))
                asked.append(held is not None and held.complete)
                await asyncio.Event().wait()  # never answers; cancelled when the node stops
                raise AssertionError("unreachable")
            stranger.serve(SYNC_CHUNK, hold_forever)
            # The stranger announces an inference replica of stage 0: it owns every other chunk.
            announce(stranger, config.name, replica_record("owner", 0))
            fake_step(swarm, trainer_peer, 1)
            follow_all([replica])  # and waits for its probes
            assert_serves_published(replica, trainer_peer)  # the state hash checked out
            sources = follower.sources
            # Its chunks came from the publisher at once; it was asked only once every chunk of
            # v1 was in hand (a probe, off the update's path), stayed silent and is now avoided.
            chunks = len(follower.updates[("delta", 1)].have)
            rank = sorted([replica.node.peer_id, stranger.peer_id]).index(stranger.peer_id)
            owned = len(range(rank, chunks, 2))  # every other chunk, in the owners' rotation
            assert sources.fallbacks == owned
            assert asked == [True] and sources.unanswered == 1
            assert sources.avoids(stranger.peer_id)
            fake_step(swarm, trainer_peer, 2)
            follow_all([replica])
            assert_serves_published(replica, trainer_peer)
            assert asked == [True]  # not asked again while it backs off
            assert stranger.peer_id not in sources.served and sources.fallbacks == owned
        finally:
            stranger.shutdown()


def named(count: int, prefix: str) -> list[str]:
    """Peer ids that sort in the order made."""
    return [f"{prefix}{index:05d}" for index in range(count)]


def sources_with(clock: Clock) -> ChunkSources:
    return ChunkSources(timeout_s=22.0, chunk_wait_s=2.0, ban_s=30.0, clock=clock)


def test_owners_earn_the_wait_and_lose_it_after_their_lifetime() -> None:
    clock = Clock()
    sources = sources_with(clock)
    owners = sources.owners(["b", "c"], "a")
    assert owners == ["a", "b", "c"]
    # Unproven: straight to the publisher, counted; probed after the update, briefly.
    assert [s.peer for s in sources.for_chunk("b", "a", "publisher", relayed=False)] == \
        ["publisher"] and sources.fallbacks == 1
    probes = sources.probes(owners, "a")
    assert sorted(s.peer for s in probes) == ["b", "c"]
    assert {s.timeout_s for s in probes} == {2.0 + PROBE_ANSWER_S}
    sources.good_chunk("b")
    proven = sources.for_chunk("b", "a", "publisher", relayed=False)
    assert [(s.peer, s.timeout_s) for s in proven] == [("b", 22.0), ("publisher", 22.0)]
    assert [s.peer for s in sources.probes(owners, "a")] == ["c"]
    # Its own chunks and a relayed owner's come from the publisher, not counted as fallbacks.
    assert [s.peer for s in sources.for_chunk("a", "a", "publisher", False)] == ["publisher"]
    assert [s.peer for s in sources.for_chunk("b", "a", "publisher", True)] == ["publisher"]
    assert sources.fallbacks == 1
    clock.now += SERVED_LIFETIME_S + 1
    assert not sources.proven("b")


def test_many_unproven_owners_get_a_bounded_number_of_probes_per_update() -> None:
    sources = sources_with(Clock())
    owners = sources.owners(named(1000, "fake"), "me")
    assert len(sources.probes(owners, "me")) == PROBES_PER_UPDATE


def test_a_silent_source_backs_off_and_the_tables_stay_bounded() -> None:
    clock = Clock()
    sources = sources_with(clock)
    sources.no_answer("silent", "publisher")
    sources.no_answer("publisher", "publisher")  # the last resort is never avoided
    assert sources.avoids("silent") and not sources.avoids("publisher")
    assert sources.owners(["silent", "b"], "a") == ["a", "b"]
    clock.now += BACKOFF_S + 1
    assert not sources.avoids("silent")
    for peer in named(AVOIDED_KEPT + 10, "forger"):
        sources.bad_chunk(peer)
    for peer in named(SERVED_KEPT + 10, "served"):
        sources.good_chunk(peer)
    assert len(sources.avoided) == AVOIDED_KEPT and len(sources.served) == SERVED_KEPT
    assert not sources.avoids("forger00000") and sources.avoids(f"forger{AVOIDED_KEPT + 9:05d}")


def test_a_ban_outlasts_a_later_backoff() -> None:
    clock = Clock()
    sources = ChunkSources(timeout_s=22.0, chunk_wait_s=2.0, ban_s=600.0, clock=clock)
    sources.bad_chunk("liar")
    sources.no_answer("liar", "publisher")
    clock.now += BACKOFF_S + 1
    assert sources.avoids("liar")
