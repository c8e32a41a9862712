"""Provenance: who computed what in one generation session, so that a spot-check can name the
peer that lied. Per stage: which replica served which columns of the session (a failover hands
the rest to another replica), where a replica rebuilt the stage's KV cache by a replay from
position 0, and the coordinator's secret sketches of what they delivered (commit.py), with the
seed of the sketch matrix. It never leaves the coordinator: a stage that knew the seed could lie
where the sketch does not look.

A session may carry several groups, its rows their rows one group after the other, left-padded
to the session's longest prompt. A group is checked on its own (trust/verify.py): its share of
the session (`group_shares`) keeps the sketches of its rows, renumbered from 0, and says where
the rows sat (`first_row`, for the seeded draw of the session's rows) and how many prompt
columns the session had (its columns, those `served` and `rebuilt` name, are the session's)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import RolloutGroup
from decentrl.trust.commit import Sketches, sketch_matrix


@dataclass(frozen=True)
class Commitment:
    """A stage's signed commitment to what it sent on in a peer-to-peer session (net/
    push_messages.py StepCommit): columns [start, start + new) under route `epoch`, the digest
    of the session's row digests of them."""

    peer: str
    epoch: int
    start: int
    new: int
    digest: bytes
    receiver: str = ""  # the next stage's replica it was pushed to (it keeps it too)


@dataclass
class StageProvenance:
    served: list[tuple[int, str]] = field(default_factory=list)  # (first column, peer), in order
    sketches: list[Sketches] = field(default_factory=list)  # of the columns they computed
    # Drawn by the coordinator (an unpredictable source), per session and stage.
    seed: int = field(default_factory=lambda: secrets.randbits(63))
    # The first column of each step that a replica served by replaying the session from position
    # 0 (a failover, or a retry after a timeout, even to the same replica). The replay recomputed
    # every earlier column's keys and values with that replica's weights, the version the step
    # reports, not the versions recorded for the earlier steps: a spot-check replays there too.
    rebuilt: list[int] = field(default_factory=list)
    # A peer-to-peer session's (swarm.data_plane): what the stage committed to instead of the
    # sketches, which a spot-check takes from its reveals (trust/reveal.py).
    commitments: list[Commitment] = field(default_factory=list)

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

    def matrix(self, dims: int, hidden_size: int) -> torch.Tensor:
        """The stage's secret sketch matrix, regenerated from its seed."""
        return sketch_matrix(self.seed, dims, hidden_size)

    def of_rows(self, first: int, count: int, dims: int) -> StageProvenance:
        """This stage's record for rows [first, first + count) of the session alone, renumbered
        from 0."""
        sketches = Sketches.concat(self.sketches, dims)
        kept = (sketches.rows >= first) & (sketches.rows < first + count)
        return StageProvenance(
            list(self.served),
            [Sketches(sketches.rows[kept] - first, sketches.positions[kept],
                      sketches.values[kept])],
            self.seed, list(self.rebuilt), list(self.commitments))


@dataclass
class Provenance:
    stages: list[StageProvenance]
    # Where a group's rows sat in the session that generated it (a session of several groups):
    # its first row there, and the session's prompt columns (None: the group's own prompt).
    first_row: int = 0
    prompt_columns: int | None = None
    # How the session's last stage was asked to sample (None: the run's rollout sampling); an
    # evaluation's greedy sessions sample at temperature 0.
    sampling: SamplingConfig | None = None
    # A peer-to-peer session's id, under which its stages reveal what they sent ("": relayed),
    # and when its last step was answered (time.monotonic): the reveal window runs from there.
    session: str = ""
    finished: float = 0.0

    @classmethod
    def empty(cls, num_stages: int) -> Provenance:
        return cls([StageProvenance() for _ in range(num_stages)])

    def stage_peers(self, stage: int) -> set[str]:
        return {peer for _, peer in self.stages[stage].served}

    def peers(self) -> set[str]:
        return {peer for stage in range(len(self.stages)) for peer in self.stage_peers(stage)}


def group_shares(session: Provenance, groups: list[RolloutGroup], dims: int) -> list[Provenance]:
    """Each of `groups`' share of the `session` that generated them all, their rows in that order
    (`dims`: the sketches' dimensions)."""
    prompt_columns = max(len(r.prompt_tokens) for group in groups for r in group.rollouts)
    shares, first = [], 0
    for group in groups:
        count = len(group.rollouts)
        shares.append(Provenance([stage.of_rows(first, count, dims) for stage in session.stages],
                                 first, prompt_columns, session.sampling, session.session,
                                 session.finished))
        first += count
    return shares
