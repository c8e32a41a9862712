"""The owner's records bound to the session of its newest manifest (net/session.py): a `RunEnded`
or a `LineageRecord` the owner signed at an earlier start of the run acts on nothing, also once
the manifest is no longer live; the records of the session a reader serves still count. (With
real daemons: tests/swarm/test_join_run.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import torch

from decentrl.config import SyncConfig
from decentrl.coordinator.manifest import RunEndWatch
from decentrl.net.circuits import Circuits
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import (
    LineageRecord,
    RunEnded,
    RunManifest,
    coordinator_key,
    ended_key,
    lineage_key,
)
from decentrl.net.session import OwnerSession, new_session
from decentrl.net.wire import encode_struct
from decentrl.sync.delta import PublishedState
from decentrl.sync.distribute import WeightFollower

RUN = "run"
OWNER = "owner"
T = TypeVar("T")


class OwnersRecords:
    """The DHT as a reader sees it: {key: {writer: value}}, which the test edits as the owner
    would (each writer's newest record under a key)."""

    peer_id = "reader"
    circuits = Circuits()

    def __init__(self) -> None:
        self.records: dict[str, dict[str, bytes]] = {}
        self.lookups = 0

    def sign(self, key: str, record: Any) -> None:
        self.records.setdefault(key, {})[OWNER] = encode_struct(record)

    def expire(self, key: str) -> None:
        self.records.pop(key, None)

    async def lookup(self, key: str) -> dict[str, bytes]:
        self.lookups += 1
        return dict(self.records.get(key, {}))

    def run(self, work: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run(work)

    def serve(self, rpc: Any, handler: Any) -> None:
        pass


def manifest(session: str) -> RunManifest:
    return RunManifest(run=RUN, config_json="{}", config_hash="", model_files={}, stages=[],
                       roster=[], session=session)


def test_a_run_end_of_an_earlier_start_is_ignored_and_the_current_one_stops_the_peer() -> None:
    dht, earlier, joined, restarted = OwnersRecords(), new_session(), new_session(), new_session()
    node = cast(SwarmNode, dht)
    dht.sign(coordinator_key(RUN), manifest(joined))
    watch = RunEndWatch(RUN, OWNER, joined)
    assert watch.ended(node) is None and watch.ignored == []
    # The earlier start's record, live for an hour (or stored again by anyone who kept it).
    dht.sign(ended_key(RUN), RunEnded(run=RUN, steps=3, session=earlier))
    assert watch.ended(node) is None and watch.ended(node) is None
    assert watch.ignored == [f"the owner's RunEnded of session {earlier[:8]} is ignored: the "
                             f"run's manifest is of session {joined[:8]} (a record signed at an "
                             "earlier start of the run)"]
    # The coordinator restarts while the peer serves: the peer follows its newest manifest, and
    # ends with the session it ends, also once that manifest expired.
    dht.sign(coordinator_key(RUN), manifest(restarted))
    assert watch.ended(node) is None and watch.session == restarted
    dht.expire(coordinator_key(RUN))
    dht.sign(ended_key(RUN), RunEnded(run=RUN, steps=9, session=joined))
    assert watch.ended(node) is None
    assert watch.ignored[-1].startswith(f"the owner's RunEnded of session {joined[:8]} is "
                                        f"ignored: the run's manifest is of session "
                                        f"{restarted[:8]}")
    dht.sign(ended_key(RUN), RunEnded(run=RUN, steps=12, session=restarted))
    ended = watch.ended(node)
    assert ended is not None and ended.steps == 12


def test_a_lineage_of_an_earlier_start_moves_no_replica() -> None:
    dht, earlier, current = OwnersRecords(), new_session(), new_session()
    follower = WeightFollower(cast(SwarmNode, dht), RUN, 0, SyncConfig(),
                              PublishedState.of(0, {"w": torch.zeros(2)}),
                              lambda version, changes: None, timeout_s=1.0, ban_s=60.0,
                              owner=OWNER)
    old = LineageRecord(stage=0, publisher="old publisher", hashes={40: "old"}, session=earlier)
    new = LineageRecord(stage=0, publisher="publisher", hashes={3: "new"}, session=current)
    dht.sign(coordinator_key(RUN), manifest(current))
    dht.sign(lineage_key(RUN, 0), old)
    assert asyncio.run(follower.lineage()) is None and follower.stale_records == 1
    dht.sign(lineage_key(RUN, 0), new)
    assert asyncio.run(follower.lineage()) == new
    # Once the manifest is no longer live, the session it named still holds.
    dht.expire(coordinator_key(RUN))
    dht.sign(lineage_key(RUN, 0), old)
    assert asyncio.run(follower.lineage()) is None and follower.stale_records == 2


def test_a_route_of_the_restarted_owners_session_is_taken_before_the_next_round() -> None:
    """A resumed coordinator's first routes may reach a peer before its announce round reads the
    new manifest: the peer reads it at once (that route was refused in a CI run). A replayed
    route of an earlier start makes it read again at most once per round."""
    dht, joined, restarted = OwnersRecords(), new_session(), new_session()
    now = [0.0]
    known = OwnerSession(cast(SwarmNode, dht), RUN, OWNER, min_gap_s=0.5, clock=lambda: now[0])

    async def scenario() -> None:
        assert await known.against(joined) is None  # nothing read yet: nothing to check against
        dht.sign(coordinator_key(RUN), manifest(joined))
        assert await known.refresh() == joined and dht.lookups == 1
        assert await known.against(joined) == joined and dht.lookups == 1
        dht.sign(coordinator_key(RUN), manifest(restarted))
        now[0] += 0.5
        assert await known.against(restarted) == restarted and dht.lookups == 2
        # The earlier start's routes, replayed many times within a round: one read, then none.
        now[0] += 0.5
        answers = await asyncio.gather(*(known.against(joined) for _ in range(20)))
        assert answers == [restarted] * 20 and dht.lookups == 3
        now[0] += 0.1
        assert await known.against(joined) == restarted and dht.lookups == 3
        # A manifest that expired (the owner stopped) keeps the session last read.
        dht.expire(coordinator_key(RUN))
        now[0] += 1.0
        assert await known.against(joined) == restarted and dht.lookups == 4

    asyncio.run(scenario())
