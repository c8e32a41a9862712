"""What a node keeps for the DHT (net/dht_storage.py): only its run's keys, each kind within its
real size, for at most a few announce periods, within budgets per writer, per key and in total;
every refusal counted by reason and losing nothing kept. First the storage alone (records as
hivemind hands them to it, a clock moved by hand), then each flood from a stranger node on a
loopback swarm, with the honest records still read as before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.p2p import PeerID
from hivemind.utils import timed_storage
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from decentrl.config import SwarmConfig
from decentrl.net import dht_storage
from decentrl.net.dht_storage import (
    MAX_KEY_BYTES,
    MAX_RECORD_TTL_S,
    OFFER_BYTES,
    PEER_RECORD_BYTES,
    STAGE_WRITERS,
    BoundedDHTStorage,
    RunNamespace,
    key_id,
)
from decentrl.net.directory import Directory
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import (
    HostOffer,
    PeerRecord,
    coordinator_key,
    ended_key,
    lineage_key,
    offer_key,
    stage_key,
)
from decentrl.net.reach import route_key
from decentrl.net.records import MAX_RECORD_BYTES
from decentrl.net.wire import TensorLimits, encode_struct
from tests.swarm.test_signed_records import signed

RUN = "bounded"
NOW = 1_000_000.0
OWNER, WRITER = Identity.generate().peer_id, Identity.generate().peer_id


def value(body_bytes: int) -> bytes:
    """A stored value as hivemind keeps it: the body serialized, then a signature's room."""
    return MSGPackSerializer.dumps(bytes(body_bytes)) + bytes(64)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """DHT time, for the bounds and for hivemind's own expiry, moved by the test."""
    now = [NOW]
    monkeypatch.setattr(dht_storage, "get_dht_time", lambda: now[0])
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: now[0])
    return now


@pytest.fixture
def storage(clock: list[float]) -> BoundedDHTStorage:
    kept = BoundedDHTStorage()
    kept.join(RunNamespace(RUN, OWNER, 2, announce_every_s=2.0))
    return kept


STAGE = key_id(stage_key(RUN, 0))
BIG = MAX_RECORD_BYTES - 1024


def test_a_node_that_joined_no_run_keeps_route_records_of_their_own_peer_only(
        clock: list[float]) -> None:
    kept = BoundedDHTStorage()
    assert kept.store_subkey(key_id(route_key(WRITER)), WRITER, value(300), NOW + 60)
    assert not kept.store_subkey(key_id(route_key(OWNER)), WRITER, value(300), NOW + 60)
    assert not kept.store_subkey(STAGE, WRITER, value(300), NOW + 10)
    assert kept.refused == {"outside this node's run": 2}


def test_only_the_runs_keys_and_the_owners_records_under_the_owners_keys(
        storage: BoundedDHTStorage) -> None:
    assert storage.store_subkey(STAGE, WRITER, value(300), NOW + 10)
    assert storage.store_subkey(key_id(stage_key(RUN, 1)), WRITER, value(300), NOW + 10)
    for key in (coordinator_key(RUN), lineage_key(RUN, 0), ended_key(RUN)):
        assert storage.store_subkey(key_id(key), OWNER, value(300), NOW + 10), key
        assert not storage.store_subkey(key_id(key), WRITER, value(300), NOW + 10), key
    for key in (stage_key(RUN, 2), stage_key("another-run", 0), "anything/at/all"):
        assert not storage.store_subkey(key_id(key), WRITER, value(300), NOW + 10), key
    assert not storage.store(STAGE, value(300), NOW + 10)  # a plain value: no writer named
    assert storage.refused == {"not its writer's key": 3, "outside this node's run": 3,
                               "no subkey": 1}


def test_a_training_peers_offer_is_kept_under_its_own_offer_key_only_and_small(
        storage: BoundedDHTStorage) -> None:
    """Offers (HostOffer) to a planning owner: a peer writes its own offer key, never another
    peer's (a stranger cannot speak for an admitted peer), an offer is a kilobyte at most, and
    a node keeps offers whatever run it joined (the offering peers wait for a run whose nodes
    do not exist yet), as it keeps route records."""
    own = key_id(offer_key(WRITER))
    assert storage.store_subkey(own, WRITER, value(200), NOW + 10)
    assert not storage.store_subkey(key_id(offer_key(OWNER)), WRITER, value(200), NOW + 10)
    assert not storage.store_subkey(own, WRITER, value(OFFER_BYTES + 8), NOW + 10)
    assert storage.refused == {"outside this node's run": 1, "over its kind's size": 1}
    largest = encode_struct(HostOffer(run="r" * 100, role="training", memory_mb=2**31,
                                      speed=1e12))
    assert len(largest) < OFFER_BYTES // 4
    assert BoundedDHTStorage().store_subkey(own, WRITER, value(200), NOW + 10)


def test_records_live_a_few_announce_periods_at_most(clock: list[float],
                                                      storage: BoundedDHTStorage) -> None:
    assert not storage.store_subkey(STAGE, WRITER, value(300), NOW + 10 * 365 * 86400)
    assert not storage.store_subkey(STAGE, WRITER, value(300), NOW + MAX_RECORD_TTL_S + 10)
    assert storage.store_subkey(STAGE, WRITER, value(300), NOW + MAX_RECORD_TTL_S)
    assert storage.refused == {"expiry too far": 2}
    with pytest.raises(ValueError, match="the DHT keeps records for up to 120s, renew it"):
        storage.check_ttl(stage_key(RUN, 0), 600)
    # A run that announces slowly keeps its records proportionally longer.
    slow = BoundedDHTStorage()
    slow.join(RunNamespace(RUN, OWNER, 1, announce_every_s=60.0))
    assert slow.store_subkey(STAGE, WRITER, value(300), NOW + 300)


def test_each_kind_of_record_is_bounded_to_its_real_size(storage: BoundedDHTStorage) -> None:
    honest = encode_struct(PeerRecord(
        name="a volunteer with a long name" * 3, stage=0, layers=(10, 20), role="both",
        version=10**6, tokens_per_s=1e4, free_sessions=64, training_ready=True,
        bytes_sent=2**50, bytes_relayed=2**50, verifies=True, rows_per_tick=12.5))
    assert len(honest) < PEER_RECORD_BYTES / 4
    assert storage.store_subkey(STAGE, WRITER, value(len(honest)), NOW + 10)
    assert not storage.store_subkey(STAGE, OWNER, value(MAX_RECORD_BYTES), NOW + 10)
    assert storage.store_subkey(key_id(coordinator_key(RUN)), OWNER, value(MAX_RECORD_BYTES),
                                NOW + 10)
    assert storage.refused == {"over its kind's size": 1}


def test_writers_keys_and_the_store_are_each_within_their_budget(
        monkeypatch: pytest.MonkeyPatch, storage: BoundedDHTStorage) -> None:
    # A peer: its announcement in two stages and its routes, no more; its renewals pass.
    wide = BoundedDHTStorage()
    wide.join(RunNamespace(RUN, OWNER, 3, announce_every_s=2.0))
    stages = [key_id(stage_key(RUN, stage)) for stage in range(3)]
    full = value(PEER_RECORD_BYTES)
    assert wide.store_subkey(key_id(route_key(WRITER)), WRITER, value(2000), NOW + 10)
    assert [wide.store_subkey(key, WRITER, full, NOW + 10) for key in stages] == [
        True, True, False]
    assert wide.store_subkey(stages[0], WRITER, full, NOW + 12)
    assert wide.refused == {"writer over its budget": 1}
    # The owner: a record under each key of its run, at the size limit of each.
    owned = [coordinator_key(RUN), lineage_key(RUN, 0), lineage_key(RUN, 1), stage_key(RUN, 0)]
    sizes = [MAX_RECORD_BYTES, MAX_RECORD_BYTES, MAX_RECORD_BYTES, PEER_RECORD_BYTES]
    assert all(storage.store_subkey(key_id(key), OWNER, value(size), NOW + 10)
               for key, size in zip(owned, sizes))
    # A key: STAGE_WRITERS writers at most, whoever comes later; those kept may renew.
    crowd = [Identity.generate().peer_id for _ in range(STAGE_WRITERS)]
    assert all(storage.store_subkey(STAGE, peer, value(300), NOW + 10) for peer in crowd[1:])
    assert not storage.store_subkey(STAGE, WRITER, value(300), NOW + 10)
    assert storage.store_subkey(STAGE, crowd[1], value(300), NOW + 12)
    assert storage.refused == {"key full": 1}
    assert storage.key_bytes(STAGE) <= MAX_KEY_BYTES
    # The whole store: past its budget, newcomers are refused and nothing kept is lost.
    monkeypatch.setattr(dht_storage, "MAX_STORED_BYTES", storage.stored_bytes + 500)
    late = key_id(stage_key(RUN, 1))
    assert storage.store_subkey(late, WRITER, value(300), NOW + 10)
    assert not storage.store_subkey(late, crowd[2], value(300), NOW + 10)
    assert storage.refused["storage full"] == 1
    assert len(storage.get(STAGE).value) == STAGE_WRITERS  # type: ignore[union-attr,arg-type]


def test_what_expires_gives_its_budget_back(clock: list[float],
                                            storage: BoundedDHTStorage) -> None:
    crowd = [Identity.generate().peer_id for _ in range(STAGE_WRITERS)]
    assert all(storage.store_subkey(STAGE, peer, value(300), NOW + 10) for peer in crowd)
    assert not storage.store_subkey(STAGE, WRITER, value(300), NOW + 10)
    clock[0] = NOW + 11  # the crowd stopped renewing
    assert storage.store_subkey(STAGE, WRITER, value(300), NOW + 20)
    assert storage.key_bytes(STAGE) == storage.stored_bytes < 1024
    assert [writer for writer, _ in storage.get(STAGE).value.items()] == [WRITER]  # type: ignore


# ---- the attacks, from a stranger node -------------------------------------------------------

@contextmanager
def swarm() -> Iterator[tuple[SwarmNode, list[SwarmNode], SwarmNode]]:
    """A coordinator (the run's owner), two replicas announced in stage 0, and a stranger; the
    honest nodes joined the run."""
    nodes: list[SwarmNode] = []
    try:
        nodes.append(SwarmNode.start("coordinator", [], LinkProfile(), TensorLimits()))
        for name in ("replica-1", "replica-2", "stranger"):
            nodes.append(SwarmNode.start(name, nodes[0].addresses(), LinkProfile(),
                                         TensorLimits()))
        coordinator, replicas, stranger = nodes[0], nodes[1:3], nodes[3]
        for node in nodes[:3]:
            node.dht_storage.join(RunNamespace(RUN, coordinator.peer_id, 1, 2.0))
        for replica in replicas:
            announce(replica)
        yield coordinator, replicas, stranger
    finally:
        for node in nodes:
            node.shutdown()


def announce(node: SwarmNode) -> bytes:
    body = encode_struct(PeerRecord(name=node.name, stage=0, layers=(0, 2), role="inference",
                                    version=0, tokens_per_s=0.0, free_sessions=4,
                                    training_ready=False))
    node.run(node.announce(stage_key(RUN, 0), body, 10), timeout=30)
    return body


def signed_value(writer: Identity, key: str, body: bytes, expiration: float) -> bytes:
    """`writer`'s record under `key` as a node stores it: the body, then its signature."""
    return signed(writer, body, DHTID.generate(source=key).to_bytes(), expiration).value


def store_at(stranger: SwarmNode, target: SwarmNode, writer: Identity, key: str, body: bytes,
             expiration: float) -> bool:
    """`writer`'s validly signed record, sent by the stranger straight to `target`."""
    assert stranger.dht is not None
    kept = stranger.run(stranger.dht.protocol.call_store(
        PeerID.from_base58(target.peer_id), [DHTID.generate(source=key)],
        [signed_value(writer, key, body, expiration)], expiration, subkeys=[writer.peer_id]),
        timeout=30)
    assert kept is not None, f"{target.name} did not answer"
    return kept[0]


def plant(stranger: SwarmNode, writer: Identity, key: str, body: bytes,
          expiration: float) -> None:
    """The stranger keeps the record itself and returns it to every lookup, bounds or not."""
    assert stranger.dht is not None
    DHTLocalStorage.store_subkey(stranger.dht.protocol.storage, DHTID.generate(source=key),
                                 writer.peer_id, signed_value(writer, key, body, expiration),
                                 expiration)


@pytest.mark.network
def test_a_stranger_stores_nothing_outside_the_run_nor_for_long_nor_past_its_budget() -> None:
    with swarm() as (coordinator, replicas, stranger):
        replica = replicas[0]
        kept_before = replica.dht_storage.stored_bytes
        in_ten_years = get_dht_time() + 10 * 365 * 86400
        soon = get_dht_time() + 60
        me = stranger.identity
        assert not store_at(stranger, replica, me, "junk/1", bytes(60_000), soon)
        assert not store_at(stranger, replica, me, stage_key("another-run", 0), b"x", soon)
        assert not store_at(stranger, replica, me, stage_key(RUN, 0), b"x", in_ten_years)
        assert not store_at(stranger, replica, me, stage_key(RUN, 0), bytes(60_000), soon)
        assert not store_at(stranger, replica, me, coordinator_key(RUN), b"x", soon)
        # Its own route record is the one key outside the run a node keeps for a stranger.
        assert store_at(stranger, replica, me, route_key(me.peer_id), b"r", soon)
        assert replica.refused_records == {
            "outside this node's run": 2, "expiry too far": 1, "over its kind's size": 1,
            "not its writer's key": 1}
        assert replica.dht_storage.stored_bytes - kept_before < 200
        # Many identities under a stage's key: the key stays within its bound.
        for _ in range(8):
            store_at(stranger, replica, Identity.generate(), stage_key(RUN, 0),
                     bytes(PEER_RECORD_BYTES), soon)
        assert replica.dht_storage.key_bytes(key_id(stage_key(RUN, 0))) <= MAX_KEY_BYTES
        # The honest replicas read as before.
        honest = {r.peer_id for r in replicas}
        assert honest <= set(coordinator.run(coordinator.lookup(stage_key(RUN, 0)), timeout=30))


@pytest.mark.network
def test_a_stage_crowded_by_many_identities_is_still_read_by_a_node_that_joins_later() -> None:
    with swarm() as (coordinator, replicas, stranger):
        soon = get_dht_time() + 60
        # 80 throwaway identities, 64 KiB each, on every honest node and in the stranger's own
        # storage: 5 MiB under the stage's key, past what one DHT reply carries.
        for _ in range(80):
            writer = Identity.generate()
            for node in (coordinator, *replicas):
                assert not store_at(stranger, node, writer, stage_key(RUN, 0), bytes(BIG), soon)
            plant(stranger, writer, stage_key(RUN, 0), bytes(BIG), soon)
        assert all(n.refused_records["over its kind's size"] == 80 for n in (coordinator,
                                                                             *replicas))
        joiner = SwarmNode.start("joiner", coordinator.addresses(), LinkProfile(),
                                 TensorLimits())
        try:
            joiner.dht_storage.join(RunNamespace(RUN, coordinator.peer_id, 1, 2.0))
            found = joiner.run(joiner.lookup(stage_key(RUN, 0)), timeout=60)
        finally:
            joiner.shutdown()
        honest = {r.peer_id for r in replicas}
        assert honest <= set(found)
        assert honest <= set(coordinator.run(coordinator.lookup(stage_key(RUN, 0)), timeout=30))


@pytest.mark.network
def test_a_flood_of_tiny_records_keeps_no_later_replica_out_of_the_directory() -> None:
    with swarm() as (coordinator, replicas, stranger):
        directory = Directory(coordinator, RUN, 1, SwarmConfig())
        directory.refresh()
        assert set(directory.peers) == {r.peer_id for r in replicas}
        soon = get_dht_time() + 60
        for _ in range(300):
            writer = Identity.generate()
            for node in (coordinator, *replicas):
                assert store_at(stranger, node, writer, stage_key(RUN, 0), b"\x00", soon)
        late = SwarmNode.start("late-replica", coordinator.addresses(), LinkProfile(),
                               TensorLimits())
        try:
            late.dht_storage.join(RunNamespace(RUN, coordinator.peer_id, 1, 2.0))
            announce(late)
            directory.refresh()
            assert set(directory.peers) == {late.peer_id, *(r.peer_id for r in replicas)}
            assert directory.skipped_records >= 300
        finally:
            late.shutdown()


@pytest.mark.network
def test_a_find_request_whose_reply_would_not_fit_is_refused_with_a_short_error() -> None:
    with swarm() as (coordinator, replicas, stranger):
        for key in (coordinator_key(RUN), lineage_key(RUN, 0)):
            coordinator.run(coordinator.announce(key, bytes(BIG), 10), timeout=30)
        assert stranger.dht is not None
        asked = [DHTID.generate(source=coordinator_key(RUN))] * 60  # one key, 60 times over
        found = stranger.run(stranger.dht.protocol.call_find(
            PeerID.from_base58(coordinator.peer_id), asked), timeout=30)
        assert found is None  # refused at once (hivemind's own path would time out)
        one = stranger.run(stranger.dht.protocol.call_find(
            PeerID.from_base58(coordinator.peer_id), asked[:1]), timeout=30)
        assert one is not None and one[asked[0]][0] is not None
