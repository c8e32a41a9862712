"""State that grows with what peers send stays bounded: a flood of distinct identities (or ids)
leaves every table at or under its cap, and what the cap evicts is what matters least (stale
strikes, ended blocks, unbanned standings, peers no longer seen), while the totals stay exact.
No network: tables are fed directly, as the node's loop or the coordinator's threads would."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from rich.console import Console
from swarm_helpers import tiny_run_config

from decentrl.config import SyncConfig
from decentrl.net import directory as directory_module
from decentrl.net import strikes as strikes_module
from decentrl.net.circuits import Circuits
from decentrl.net.directory import NEWCOMER_PLACES, PEERS_PER_STAGE, Directory, PeerState
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import Empty, PeerRecord
from decentrl.net.strikes import BLOCK_TABLE_SIZE, STRIKE_TABLE_SIZE, Strikes
from decentrl.net.wire import encode_struct
from decentrl.observe.live import NAMES_KEPT, SwarmObserver
from decentrl.observe.metrics import (
    EVENTS_SHOWN,
    MetricsLog,
    SwarmRecord,
    TrustRecord,
    read_metrics,
)
from decentrl.sync.chunks import OTHER_PEERS, PEERS_COUNTED, count_bytes
from decentrl.sync.delta import PublishedState
from decentrl.sync.distribute import WeightFollower, make_update
from decentrl.sync.sources import AVOIDED_KEPT, Source
from decentrl.trust.gate import GROUPS_TRACKED, RecentIds, Trust
from decentrl.trust.provenance import Provenance
from decentrl.trust.reputation import (
    BANS_EXPLAINED,
    DETAIL_CHARS,
    EVENTS_KEPT,
    STANDINGS_KEPT,
    Reputation,
)


def identities(count: int, prefix: str = "stranger") -> list[str]:
    return [f"{prefix}-{index:06d}" for index in range(count)]


# ---- the node's strike and block tables ----------------------------------------------------

@pytest.fixture
def node() -> Strikes:
    node = Strikes("victim", strikes_to_block=3)
    node.clock = lambda: 1000.0
    return node


def test_a_flood_of_struck_identities_keeps_the_strike_table_at_its_cap(node: Strikes) -> None:
    node.strike("regular", "inference_step", ValueError("bad"))  # struck first: stalest
    for sender in identities(STRIKE_TABLE_SIZE + 100):
        node.strike(sender, "inference_step", ValueError("bad"))
    assert len(node._times) == STRIKE_TABLE_SIZE
    assert node.count("regular") == 0  # forgotten: it starts over, as a fresh identity would
    assert node.count(identities(STRIKE_TABLE_SIZE + 100)[-1]) == 1


def test_a_flood_of_blocked_identities_keeps_the_block_table_at_its_cap(
        node: Strikes, caplog: pytest.LogCaptureFixture) -> None:
    senders = identities(BLOCK_TABLE_SIZE + 50)
    with caplog.at_level(logging.ERROR, logger=strikes_module.__name__):  # a line per strike
        for sender in senders:
            for _ in range(node.strikes_to_block):
                node.strike(sender, "inference_step", ValueError("bad"))
    assert len(node._blocks) == BLOCK_TABLE_SIZE
    assert not node._times  # every one of them was blocked
    # The blocks that end first went: the newest senders stay blocked.
    assert not node.blocked(senders[0]) and node.blocked(senders[-1])


# ---- the coordinator's reputation ----------------------------------------------------------

def test_a_flood_of_identities_keeps_the_reputation_bounded_and_bans_in_force() -> None:
    reputation = Reputation(ban_score=0.5, ban_s=60.0)
    for _ in range(2):
        reputation.record("liar", "failed", "forged log-probs")
    assert reputation.banned("liar")
    flood = identities(STANDINGS_KEPT + 500)
    for peer in flood:
        reputation.record(peer, "malformed", "x" * 10_000)
    assert len(reputation.standings) == STANDINGS_KEPT
    assert reputation.banned("liar")  # a banned peer is the last to be forgotten
    assert reputation.counts("liar") == {"failed": 2}
    assert reputation.counts(flood[0]) == {}  # the least recently seen went first
    assert len(reputation.events) == EVENTS_KEPT
    assert reputation.events_recorded == len(flood) + 2
    assert all(len(e.detail) <= DETAIL_CHARS + len("…(+10000 chars)") for e in reputation.events)
    # Banned throwaway identities: each ban counts, the first few are explained.
    for peer in identities(BANS_EXPLAINED + 20, "banned"):
        reputation.record(peer, "proved", "signed claim contradicts delivery")
    assert len(reputation.ban_causes) == BANS_EXPLAINED
    assert reputation.ban_causes["liar"] == "failed: forged log-probs"


def test_the_observer_writes_what_the_reputation_still_holds_and_says_what_it_lost(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    directory = Directory(cast(SwarmNode, None), config.name, 1, config.swarm)
    reputation = Reputation(ban_score=0.0, ban_s=60.0)
    metrics = MetricsLog(tmp_path / "metrics.jsonl", 0.0)
    observer = SwarmObserver(config, directory, reputation, metrics, lambda: 0, lambda: 0, dict)
    reputation.record("first", "passed")
    observer.record()
    for peer in identities(EVENTS_KEPT + 30):
        reputation.record(peer, "malformed", "bad")
    with caplog.at_level(logging.WARNING, logger="decentrl.observe.live"):
        observer.record()
        observer.record()  # nothing new: nothing written, nothing lost
    lost = ("30 verification events since the last snapshot were dropped unwritten: more arrived "
            "than the reputation keeps")
    assert [r.getMessage() for r in caplog.records if r.name == "decentrl.observe.live"] == [lost]
    written = read_metrics(metrics.path).trust
    assert len(written) == 1 + EVENTS_KEPT
    assert written[1].peer == identities(EVENTS_KEPT + 30)[30]
    # In memory, only what the dashboard shows.
    assert len(metrics.of(TrustRecord)) == EVENTS_SHOWN
    assert len(metrics.of(SwarmRecord)) == 1 and len(read_metrics(metrics.path).snapshots) == 3


# ---- what the observer and the directory keep of announcements -----------------------------

def record(name: str, stage: int = 0) -> PeerRecord:
    return PeerRecord(name=name, stage=stage, layers=(0, 2), role="inference", version=0,
                      tokens_per_s=0.0, free_sessions=1, training_ready=False)


class DhtNode:
    """The DHT as the directory reads it, with `entries` announced under every stage's key."""

    def __init__(self, entries: dict[str, bytes]) -> None:
        self.entries = entries

    async def lookup(self, key: str) -> dict[str, bytes]:
        return dict(self.entries)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run(coroutine)


def test_a_flood_of_announcements_keeps_peers_already_known(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    dht = DhtNode({"honest": encode_struct(record("honest"))})
    directory = Directory(cast(SwarmNode, dht), "run", 1, config.swarm)
    directory.refresh()
    # Sorted before the honest peer's id, so a reader that took the first entries would lose it.
    dht.entries = {peer: encode_struct(record(peer)) for peer in identities(2 * PEERS_PER_STAGE,
                                                                           "another")}
    dht.entries["honest"] = encode_struct(record("honest"))
    with caplog.at_level(logging.WARNING, logger=directory_module.__name__):
        directory.refresh()
    assert len(directory.peers) == PEERS_PER_STAGE and "honest" in directory.peers
    assert [r.getMessage() for r in caplog.records] == [
        f"stage 0: {2 * PEERS_PER_STAGE + 1} announcements, keeping 1 of 1 known peers and "
        f"{PEERS_PER_STAGE - 1} of {2 * PEERS_PER_STAGE} newcomers"]


def test_a_flood_of_tiny_records_takes_no_place_from_a_replica_that_comes_later(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    dht = DhtNode({"honest": encode_struct(record("honest"))})
    directory = Directory(cast(SwarmNode, dht), "run", 1, config.swarm)
    directory.refresh()
    # More one-byte records than the directory has places, then a replica announces itself.
    dht.entries.update({peer: b"\x00" for peer in identities(PEERS_PER_STAGE + 44, "tiny")})
    dht.entries["late"] = encode_struct(record("late"))
    directory.refresh()
    assert set(directory.peers) == {"honest", "late"}
    assert directory.skipped_records == PEERS_PER_STAGE + 44


def test_newcomers_past_the_cap_are_drawn_fairly_and_a_crowd_that_came_first_keeps_no_one_out(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    crowd = identities(2 * PEERS_PER_STAGE, "crowd")
    dht = DhtNode({peer: encode_struct(record(peer)) for peer in crowd})
    directory = Directory(cast(SwarmNode, dht), "run", 1, config.swarm, random=random.Random(7))
    directory.refresh()  # the crowd fills every place first
    assert len(directory.peers) == PEERS_PER_STAGE
    dht.entries["late"] = encode_struct(record("late"))
    refreshes = 0
    while "late" not in directory.peers:
        directory.refresh()
        refreshes += 1
        assert len(directory.peers) == PEERS_PER_STAGE
    # A newcomer's chance per refresh is at least NEWCOMER_PLACES in the newcomers' number: a
    # few refreshes, never "never" (first come, first kept would keep it out for good).
    assert refreshes <= 20
    # Known peers keep their places while newcomers share theirs: the draw only churns the
    # crowd it admitted, one refresh to the next.
    before = set(directory.peers)
    directory.refresh()
    assert len(before & set(directory.peers)) >= PEERS_PER_STAGE - NEWCOMER_PLACES


def test_the_observer_remembers_a_bounded_number_of_names(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    directory = Directory(cast(SwarmNode, None), config.name, 1, config.swarm)
    observer = SwarmObserver(config, directory, Reputation(0.5, 60.0),
                             MetricsLog(tmp_path / "metrics.jsonl", 0.0), lambda: 0, lambda: 0,
                             dict)
    for wave in range(3):  # peers come and go, NAMES_KEPT at a time
        directory.peers = {peer: PeerState(record(peer))
                           for peer in identities(NAMES_KEPT, f"wave{wave}")}
        observer.peers()
    assert len(observer.names) == NAMES_KEPT
    assert set(observer.names) == set(identities(NAMES_KEPT, "wave2"))


# ---- the coordinator's memory of groups ----------------------------------------------------

def test_the_gate_tracks_a_bounded_number_of_groups(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    # What the gate configures on a node; nothing here goes over the network.
    node = cast(SwarmNode, SimpleNamespace(strikes_to_block=0, block_s=0.0, on_strike=None))
    trust = Trust(config, node, Directory(node, config.name, 1, config.swarm), 32, 0,
                  Console(quiet=True))
    groups = identities(GROUPS_TRACKED + 10, "group")
    for group_id in groups:
        provenance = Provenance.empty(1)
        provenance.stages[0].serve(0, "replica")
        trust.produced(group_id, provenance)
    assert len(trust.provenance) == GROUPS_TRACKED
    assert groups[0] not in trust.provenance and groups[-1] in trust.provenance
    assert (trust.verified.size, trust.failed.size) == (GROUPS_TRACKED, GROUPS_TRACKED)


def test_recent_ids_keep_the_newest() -> None:
    ids = RecentIds(100)
    for group_id in identities(1000, "group"):
        ids.add(group_id)
    ids.add("group-000950")  # renewed: now the newest
    for group_id in identities(50, "late"):
        ids.add(group_id)
    assert len(ids) == 100
    assert "group-000950" in ids and "group-000949" not in ids and "group-000999" in ids
    with pytest.raises(ValueError, match="size of at least 1"):
        RecentIds(0)


# ---- weight sync: traffic counters and banned sources --------------------------------------

def test_traffic_counters_name_a_bounded_number_of_peers_and_keep_exact_totals() -> None:
    counter: Counter[str] = Counter()
    for peer in identities(PEERS_COUNTED + 100):
        count_bytes(counter, peer, 10)
    count_bytes(counter, identities(1)[0], 5)  # already counted by name
    assert len(counter) == PEERS_COUNTED + 1
    assert counter[OTHER_PEERS] == 100 * 10 and counter[identities(1)[0]] == 15
    assert sum(counter.values()) == (PEERS_COUNTED + 100) * 10 + 5


class ChunkNode:
    """Serves no RPC and answers every chunk request with bytes that match no hash; reaches
    every peer directly."""

    peer_id = "replica"
    circuits = Circuits()

    def serve(self, rpc: Any, handler: Any) -> None:
        pass

    async def call(self, peer: str, rpc: Any, body: Any, **options: Any
                   ) -> tuple[Empty, dict[str, torch.Tensor]]:
        return Empty(), {"data": torch.zeros(8, dtype=torch.uint8)}


def test_a_flood_of_bad_chunk_sources_keeps_the_banned_table_at_its_cap() -> None:
    follower = WeightFollower(cast(SwarmNode, ChunkNode()), "run", 0, SyncConfig(),
                              PublishedState.of(0, {"w": torch.zeros(2)}),
                              lambda version, changes: None, timeout_s=1.0, ban_s=60.0,
                              owner="owner")
    update = make_update(0, 1, "delta", (0, "base"), "after", bytes(range(8)), 1)
    sources = identities(AVOIDED_KEPT + 50, "forger")

    async def fetch_from_every_source() -> None:
        for source in sources:
            assert not await follower._fetch_chunk(update, 0, Source(source, 1.0), "owner")
    asyncio.run(fetch_from_every_source())
    avoided = follower.sources.avoided
    assert follower.sources.bad_chunks == len(sources)
    assert len(avoided) == AVOIDED_KEPT
    assert follower.sources.avoids(sources[-1]) and sources[0] not in avoided
    assert len(follower.received_total) == PEERS_COUNTED + 1
    assert sum(update.received.values()) == 8 * len(sources)


def test_sessions_given_are_counted_across_a_drop_out_and_the_count_table_is_bounded(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directory_module, "OPENED_KEPT", 3)
    config = tiny_run_config(tiny_model_dir, 1)
    directory = Directory(cast(SwarmNode, None), config.name, 1, config.swarm)

    def announce(peer: str) -> None:
        directory.peers[peer] = PeerState(PeerRecord(
            name=peer, stage=0, layers=(0, 1), role="inference", version=0, tokens_per_s=0.0,
            free_sessions=100, training_ready=False))
    announce("steady")
    for _ in range(2):
        assert directory.choose_inference(0) == "steady"
    del directory.peers["steady"]  # its announcement was late: it left the directory
    announce("steady")
    assert directory.choose_inference(0) == "steady"
    assert directory.sessions_opened() == {"steady": 3}
    del directory.peers["steady"]
    for peer in identities(5, "throwaway"):
        announce(peer)
        assert directory.choose_inference(0) == peer
        del directory.peers[peer]
    assert len(directory.sessions_opened()) == 3 and "steady" not in directory.sessions_opened()
