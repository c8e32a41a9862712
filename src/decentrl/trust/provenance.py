"""Provenance: who computed what in one generation session, so that a spot-check can name the
peer that lied. Per stage: which replica served which columns of the session (a failover hands
the rest to another replica), the activation commitments those replicas signed, and where a
replica rebuilt the stage's KV cache by a replay from position 0."""

from __future__ import annotations

from dataclasses import dataclass, field

from decentrl.trust.commit import Commitment


@dataclass
class StageProvenance:
    served: list[tuple[int, str]] = field(default_factory=list)  # (first column, peer), in order
    commitments: list[Commitment] = field(default_factory=list)  # of the columns they computed
    # The first column of each step that a replica served by replaying the session from position
    # 0 (a failover, or a retry after a timeout, even to the same replica). The replay recomputed
    # every earlier column's keys and values with that replica's weights, the version the step
    # reports, not the versions recorded for the earlier steps: a spot-check replays there too.
    rebuilt: list[int] = field(default_factory=list)

    def peer_at(self, column: int) -> str:
        """The replica whose output the session used at `column`."""
        if not self.served:
            raise ValueError("no replica served this stage")
        found = self.served[0][1]
        for first, peer in self.served:
            if first > column:
                break
            found = peer
        return found

    def serve(self, column: int, peer: str, rebuilt: bool = False) -> None:
        """`peer` computed this stage from `column` on; `rebuilt`: by a replay from position 0."""
        if rebuilt:
            self.rebuilt.append(column)
        if not self.served or self.served[-1][1] != peer:
            self.served.append((column, peer))


@dataclass
class Provenance:
    stages: list[StageProvenance]

    @classmethod
    def empty(cls, num_stages: int) -> Provenance:
        return cls([StageProvenance() for _ in range(num_stages)])

    def stage_peers(self, stage: int) -> set[str]:
        return {peer for _, peer in self.stages[stage].served}

    def peers(self) -> set[str]:
        return {peer for stage in range(len(self.stages)) for peer in self.stage_peers(stage)}
