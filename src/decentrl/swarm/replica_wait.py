"""Before an evaluation, the coordinator waits for the replicas it routes to to serve the learner's
version, so that the evaluation measures the learner's weights and nothing older.

Anyone can announce a replica, so the wait never depends on every announcement: a record that
never reaches the version (measured on `main`, where the wait covered every announced replica:
each evaluation stalled 120 s) would hold it to its bound. It waits for a quorum instead: on
every stage, one replica that the directory would give a session to now (`Directory.routed`:
room, not banned, not avoided after a failure) claims the version. Where the coordinator has
already had sessions served on some of a stage's routed replicas, only those count: a new
identity's claim alone does not end the wait. Sessions prefer the newest version
(`Directory.choose_inference`), so the evaluation's sessions go to the replicas that made the
quorum. The wait ends at REPLICA_WAIT_S in any case, and says what it waited for."""

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
    its quorum (empty: none did within the bound), and how long it took."""

    version: int
    ready: list[list[str]]
    waited_s: float

    @property
    def complete(self) -> bool:
        return all(self.ready)

    def text(self) -> str:
        stages = "; ".join(
            f"stage {stage}: {', '.join(peer[-8:] for peer in peers)}" if peers
            else f"stage {stage}: none" for stage, peers in enumerate(self.ready))
        return (f"replicas at v{self.version} after {self.waited_s:.1f}s "
                f"({'quorum' if self.complete else 'no quorum'}; {stages})")


def stage_quorum(routed: list[tuple[str, PeerRecord]], talked_to: set[str],
                 version: int) -> list[str]:
    """The routed replicas of one stage that count towards its quorum and serve `version`: those
    the coordinator had sessions served on, or every routed one where it had none."""
    known = [(peer, record) for peer, record in routed if peer in talked_to]
    return sorted(peer for peer, record in known or routed if record.version == version)


def wait_for_routed_replicas(directory: RoutingDirectory, version: int,
                             bound_s: float = REPLICA_WAIT_S,
                             clock: Callable[[], float] = time.monotonic,
                             sleep: Callable[[float], None] = time.sleep) -> ReplicaWait:
    """Until every stage has a routed replica at `version` (see the module's docstring), or
    `bound_s` has passed; reads the directory afresh every REPLICA_LOOK_S."""
    started = clock()
    while True:
        directory.refresh()
        talked_to = set(directory.sessions_opened())
        ready = [stage_quorum(directory.routed(stage), talked_to, version)
                 for stage in range(directory.num_stages)]
        waited = clock() - started
        if all(ready) or waited >= bound_s:
            result = ReplicaWait(version, ready, waited)
            (log.info if result.complete else log.warning)("evaluation: %s", result.text())
            return result
        sleep(REPLICA_LOOK_S)
