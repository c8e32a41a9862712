"""Before an evaluation, the coordinator waits for the replicas it routes to to serve the learner's
version, so that the evaluation measures the learner's weights and nothing older.

Anyone can announce a replica, so the wait never depends on every announcement: a record that
never reaches the version (measured on the earlier code, whose wait covered every announced
replica: each evaluation stalled 120 s) would hold it to its bound. It waits for a quorum instead: on
every stage, one replica that the directory would give a session to now (`Directory.routed`:
room, not banned, not avoided after a failure) claims the version. Where the coordinator has
already given sessions to some of a stage's routed replicas, only those count: a new identity's
claim alone does not end the wait. Sessions prefer the newest version
(`Directory.choose_inference`), so the evaluation's sessions go to the replicas that made the
quorum. A stage with no replica to route to at all has nothing to wait for here: the sessions
wait for one to join (`StageWait`, coordinator/swarm_backend.py), and say so. The wait ends at
REPLICA_WAIT_S in any case, and says what it waited for."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from decentrl.net.protocol import PeerRecord

log = logging.getLogger(__name__)

# The longest an evaluation waits for a stage's replicas to catch up. A replica takes an update
# within about a second of the coordinator signing it (its follow loop wakes every
# announce_every_s / 2; the update applies in 0.9 s on loopback) and announces the new version
# at once; a keyframe over a slow uplink takes longer, and past this the evaluation goes on
# with what the replicas serve (each group records the versions that generated it).
REPLICA_WAIT_S = 30.0
# How often the wait reads the directory afresh (a DHT read per stage).
REPLICA_LOOK_S = 0.5


class RoutingDirectory(Protocol):
    num_stages: int

    def refresh(self) -> None: ...
    def routed(self, stage: int) -> list[tuple[str, PeerRecord]]: ...
    def sessions_opened(self) -> dict[str, int]: ...


@dataclass
class ReplicaWait:
    """What a wait for `version` found: per stage, the routed replicas at the version that made
    its quorum (empty: none did within the bound) and how many replicas were routed, and how
    long it took."""

    version: int
    ready: list[list[str]]
    routed: list[int]
    waited_s: float

    @property
    def complete(self) -> bool:
        """Every stage has a quorum."""
        return all(self.ready)

    @property
    def done(self) -> bool:
        """Every stage has a quorum or no replica to route to (nothing to wait for here)."""
        return all(peers or not routed for peers, routed in zip(self.ready, self.routed))

    def text(self) -> str:
        stages = "; ".join(
            f"stage {stage}: {', '.join(peer[-8:] for peer in peers)}" if peers
            else f"stage {stage}: none of {routed} routed" if routed
            else f"stage {stage}: no replica routed"
            for stage, (peers, routed) in enumerate(zip(self.ready, self.routed)))
        return (f"replicas at v{self.version} after {self.waited_s:.1f}s "
                f"({'quorum' if self.complete else 'no quorum'}; {stages})")


def stage_quorum(routed: list[tuple[str, PeerRecord]], talked_to: set[str],
                 version: int) -> list[str]:
    """The routed replicas of one stage that count towards its quorum and serve `version`: those
    the coordinator gave sessions to, or every routed one where it gave none."""
    known = [(peer, record) for peer, record in routed if peer in talked_to]
    return sorted(peer for peer, record in known or routed if record.version == version)


def wait_for_routed_replicas(directory: RoutingDirectory, version: int,
                             bound_s: float = REPLICA_WAIT_S,
                             clock: Callable[[], float] = time.monotonic,
                             sleep: Callable[[float], None] = time.sleep) -> ReplicaWait:
    """Until every stage has a routed replica at `version` or none routed at all (see the
    module's docstring), or `bound_s` has passed; reads the directory afresh every
    REPLICA_LOOK_S."""
    started = clock()
    while True:
        directory.refresh()
        talked_to = set(directory.sessions_opened())
        routed = [directory.routed(stage) for stage in range(directory.num_stages)]
        result = ReplicaWait(version, [stage_quorum(replicas, talked_to, version)
                                       for replicas in routed],
                             [len(replicas) for replicas in routed], clock() - started)
        if result.done or result.waited_s >= bound_s:
            (log.info if result.complete else log.warning)("evaluation: %s", result.text())
            return result
        sleep(REPLICA_LOOK_S)
