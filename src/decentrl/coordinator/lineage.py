"""The coordinator's half of weight lineage: after each step of a stage (and when a training peer
connects, or rolls back to a checkpoint), it asks the stage's training peer for the hash of the
state its replicas are brought to at the new version (`train_published`) and signs it into the
stage's `LineageRecord` in the DHT, with the publisher's peer id. Replicas follow that publisher
only, and only to states whose hash the record gives (sync/distribute.py WeightFollower): a
stranger announcing a newer version, or a publisher offering anything the coordinator did not
see it make, moves no replica.

The queries run on one background thread, in order: the training loop does not wait for the
publisher's encoding, and a version is signed only after every earlier event of its stage. A
query that fails is retried; a version still unsigned is signed with its stage's next one. A
batch of several optimizer steps publishes a version per step in a burst: a step's event that
a later event of its stage already follows in the queue is left to that one, which signs every
version in between (a dense publisher keeps only its newest state, and a replica of a dense
stage only ever fetches that: there only the newest is signed).

Each answer also says how far the published state is from the training peer's learner
(`ServedFidelity`); the newest of each stage goes into the step metrics (`fidelity_fields`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from decentrl.config import RunConfig
from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import (
    TRAIN_PUBLISHED,
    LineageRecord,
    PublishedRequest,
    ServedFidelity,
    lineage_key,
)
from decentrl.net.wire import WireError, encode_struct

log = logging.getLogger(__name__)

SIGN_ATTEMPTS = 3


@dataclass(frozen=True)
class Published:
    """`peer` published `version` of `stage`; `restart`: its chain starts there (a training peer
    that connected or rolled back), so the versions signed before are void."""

    stage: int
    peer: str
    version: int
    restart: bool


class LineageSigner:
    def __init__(self, node: SwarmNode, config: RunConfig, session: str) -> None:
        """`session`: the run manifest's (net/session.py); replicas take the records of that
        session only, so a chain signed at an earlier start of the run is void."""
        self.node, self.run, self.session = node, config.name, session
        # A replica more than this many versions behind is planned from a keyframe, and
        # keyframes are at most keyframe_every versions apart: every manifest of its plan is here.
        self.keep = 2 * config.sync.keyframe_every + 8
        self.ttl_s = 5 * config.swarm.announce_every_s
        self.timeout_s = config.swarm.request_timeout_s
        self.retry_pause_s = config.swarm.announce_every_s
        self.dense = config.sync.mode == "dense"
        self.records: dict[int, LineageRecord] = {}
        self._queued: dict[int, int] = {}  # by stage: its events in the queue
        self.fidelity: dict[int, ServedFidelity] = {}  # by stage, of its newest signed version
        self._lock = threading.Lock()
        self._events: queue.Queue[Published | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="lineage", daemon=True)
        self._thread.start()

    def published(self, stage: int, peer: str, version: int, restart: bool = False) -> None:
        with self._lock:
            self._queued[stage] = self._queued.get(stage, 0) + 1
        self._events.put(Published(stage, peer, version, restart))

    def fidelity_fields(self) -> dict[str, Any]:
        """StepRecord's fidelity fields, from each stage's newest signed version: the share of
        the learner's movement not yet served and the fraction of bf16 entries served
        differently, over every stage and per stage."""
        with self._lock:
            fidelity = dict(sorted(self.fidelity.items()))
        if not fidelity:
            return {}
        every = ServedFidelity(
            unserved_square=sum(f.unserved_square for f in fidelity.values()),
            moved_square=sum(f.moved_square for f in fidelity.values()),
            differing=sum(f.differing for f in fidelity.values()),
            entries=sum(f.entries for f in fidelity.values()))
        return {"served_gap": every.unserved_share,
                "served_bf16_differing": every.differing_fraction,
                "served_gap_by_stage": {stage: f.unserved_share for stage, f in fidelity.items()},
                "served_bf16_differing_by_stage": {stage: f.differing_fraction
                                                   for stage, f in fidelity.items()}}

    def wait(self) -> None:
        """Until every event so far is signed (or failed)."""
        self._events.join()

    def renew(self) -> None:
        """Announce every stage's record again (DHT entries expire unless renewed)."""
        with self._lock:
            records = list(self.records.values())
        for record in records:
            self._announce(record)

    def close(self) -> None:
        """Sign what is queued (the last step's version too), then stop."""
        self._events.put(None)
        self._thread.join(timeout=SIGN_ATTEMPTS * (self.timeout_s + self.retry_pause_s) + 5)

    def _work(self) -> None:
        while (event := self._events.get()) is not None:
            with self._lock:
                self._queued[event.stage] -= 1
                # A restart is never left out: the events after it must not continue the chain
                # it voids.
                superseded = self._queued[event.stage] > 0 and not event.restart
            try:
                if not superseded:
                    self._sign_with_retries(event)
            finally:
                self._events.task_done()
        self._events.task_done()

    def _sign_with_retries(self, event: Published) -> None:
        # Retried in place, so the versions of a stage are still signed in order: a version left
        # unsigned holds its stage's replicas until a later one is (the last one, for good).
        for attempt in range(1, SIGN_ATTEMPTS + 1):
            try:
                self._sign(event)
                return
            except (RemoteError, MessageLost, WireError, TimeoutError) as error:
                log.warning("lineage of stage %d v%d not signed (attempt %d of %d): %s",
                            event.stage, event.version, attempt, SIGN_ATTEMPTS, error)
            if attempt < SIGN_ATTEMPTS:
                time.sleep(self.retry_pause_s)

    def _sign(self, event: Published) -> None:
        with self._lock:
            old = self.records.get(event.stage)
        continues = old is not None and not event.restart and old.publisher == event.peer
        signed: dict[int, str] = {}
        if old is not None and continues and not self.dense:
            # A version whose signing failed before is signed with the next one (the publisher
            # keeps the hashes of its recent updates): a replica cannot step over an unsigned one.
            for version in range(max(max(old.hashes) + 1, event.version - self.keep),
                                 event.version):
                try:
                    signed[version] = self._published_hash(event.peer, version)
                except (RemoteError, MessageLost, WireError, TimeoutError) as error:
                    log.warning("lineage of stage %d v%d left unsigned: %s", event.stage,
                                version, error)
        signed[event.version], fidelity = self._published(event.peer, event.version)
        with self._lock:
            old = self.records.get(event.stage)
            if old is not None and old.hashes.get(event.version, signed[event.version]) \
                    != signed[event.version]:
                # A training peer restarts at the state its replicas served (stage/training.py
                # `_load`); one that cannot (a checkpoint without it) puts new weights behind a
                # version number groups already recorded, and checks of those groups fail.
                log.warning("stage %d v%d signed again with another state (%s, was %s): groups "
                            "generated at v%d before now may fail their checks", event.stage,
                            event.version, signed[event.version][:12],
                            old.hashes[event.version][:12], event.version)
            hashes = dict(old.hashes) if continues and old is not None else {}
            hashes.update(signed)
            kept = sorted(hashes)[-self.keep:]
            record = LineageRecord(stage=event.stage, publisher=event.peer,
                                   hashes={version: hashes[version] for version in kept},
                                   session=self.session)
            self.records[event.stage] = record
            if fidelity is not None:
                self.fidelity[event.stage] = fidelity
            elif event.restart:  # a state restored whole: what was measured before is void
                self.fidelity.pop(event.stage, None)
        self._announce(record)

    def _published_hash(self, peer: str, version: int) -> str:
        return self._published(peer, version)[0]

    def _published(self, peer: str, version: int) -> tuple[str, ServedFidelity | None]:
        """The state hash `peer` published at `version`, and its fidelity if it measured one
        that can be true (one that cannot is logged and left out: it is only a metric)."""
        reply, _ = self.node.call_sync(peer, TRAIN_PUBLISHED, PublishedRequest(version=version),
                                       timeout=self.timeout_s)
        fidelity = reply.fidelity
        if fidelity is not None:
            try:
                fidelity.check()
            except ValueError as error:
                log.warning("stage publisher %s v%d: %s", peer[-8:], version, error)
                fidelity = None
        return reply.state_hash, fidelity

    def _announce(self, record: LineageRecord) -> None:
        self.node.run(self.node.announce(lineage_key(self.run, record.stage),
                                         encode_struct(record), self.ttl_s),
                      timeout=self.timeout_s)
