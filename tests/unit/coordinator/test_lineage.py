"""The coordinator's lineage signer (coordinator/lineage.py) against a stub publisher: the fidelity
a training peer reports is only a metric, so one that cannot be true is left out of the step
metrics while the version it came with is still signed and announced."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from decentrl.config import parse_config
from decentrl.coordinator.lineage import LineageSigner
from decentrl.net.node import PeerRefused
from decentrl.net.protocol import (
    TRAIN_PUBLISHED,
    LineageRecord,
    PublishedHash,
    PublishedRequest,
    ServedFidelity,
)
from decentrl.net.session import new_session
from decentrl.net.wire import decode_struct

PUBLISHER = "12D3KooWPublisher"
MEASURED = ServedFidelity(unserved_square=1.0, moved_square=4.0, differing=3, entries=100)


class StubPublisher:
    """A node whose training peer answers every `train_published` with `fidelity`, and which
    keeps what the signer announces."""

    def __init__(self, fidelity: ServedFidelity | None) -> None:
        self.fidelity = fidelity
        self.announced: list[LineageRecord] = []

    def call_sync(self, peer: str, rpc: Any, body: PublishedRequest,
                  timeout: float) -> tuple[PublishedHash, None]:
        assert (peer, rpc) == (PUBLISHER, TRAIN_PUBLISHED)
        return PublishedHash(version=body.version, state_hash=f"hash-{body.version}",
                             fidelity=self.fidelity), None

    def announce(self, key: str, value: bytes, ttl_s: float) -> None:
        self.announced.append(decode_struct(value, LineageRecord))

    def run(self, announced: None, timeout: float) -> None:
        """The real node awaits the announcement on its loop; the stub made it already."""


def signed(fidelity: ServedFidelity | None) -> tuple[LineageSigner, StubPublisher]:
    node = StubPublisher(fidelity)
    signer = LineageSigner(node, parse_config({"name": "lineage"}),  # type: ignore[arg-type]
                           new_session())
    signer.published(0, PUBLISHER, 1, restart=True)
    signer.published(0, PUBLISHER, 2)
    signer.wait()
    signer.close()
    return signer, node


def test_a_measured_fidelity_goes_into_the_step_metrics() -> None:
    signer, node = signed(MEASURED)
    assert node.announced[-1].hashes == {1: "hash-1", 2: "hash-2"}
    fields = signer.fidelity_fields()
    assert fields["served_gap"] == pytest.approx(0.5)
    assert fields["served_bf16_differing"] == pytest.approx(0.03)
    assert fields["served_gap_by_stage"] == {0: pytest.approx(0.5)}


@pytest.mark.parametrize("impossible", [
    ServedFidelity(unserved_square=float("nan"), moved_square=4.0, differing=0, entries=10),
    ServedFidelity(unserved_square=1.0, moved_square=-4.0, differing=0, entries=10),
    ServedFidelity(unserved_square=1.0, moved_square=4.0, differing=11, entries=10),
])
def test_a_fidelity_that_cannot_be_true_is_left_out_and_the_version_still_signed(
        impossible: ServedFidelity) -> None:
    signer, node = signed(impossible)
    assert node.announced[-1].hashes == {1: "hash-1", 2: "hash-2"}
    assert node.announced[-1].publisher == PUBLISHER
    assert signer.fidelity_fields() == {}


class BurstPublisher(StubPublisher):
    """A publisher that keeps the hashes of `kept` versions only (a dense one keeps its newest
    state alone), and holds the signer's first question until `release` is set, so that the
    versions of a batch's several updates queue up behind it as they do in a run."""

    def __init__(self, kept: set[int]) -> None:
        super().__init__(MEASURED)
        self.kept = kept
        self.asked: list[int] = []
        self.release = threading.Event()

    def call_sync(self, peer: str, rpc: Any, body: PublishedRequest,
                  timeout: float) -> tuple[PublishedHash, None]:
        self.asked.append(body.version)
        assert self.release.wait(timeout=30)
        if body.version not in self.kept:
            raise PeerRefused(f"no published state at version {body.version}")
        return super().call_sync(peer, rpc, body, timeout)


@pytest.mark.parametrize(("mode", "kept", "asked"), [
    ("sparse", {0, 1, 2, 3, 4}, [0, 1, 2, 3, 4]),  # every delta's hash, a replica steps through
    ("dense", {0, 4}, [0, 4]),  # the newest only: a replica fetches nothing else
])
def test_a_burst_of_versions_is_signed_by_its_last(mode: str, kept: set[int],
                                                   asked: list[int]) -> None:
    node = BurstPublisher(kept)
    config = parse_config({"name": "lineage", "sync": {"mode": mode}})
    signer = LineageSigner(node, config, new_session())  # type: ignore[arg-type]
    signer.published(0, PUBLISHER, 0, restart=True)
    for version in range(1, 5):  # one batch of four updates, published while v0 is signed
        signer.published(0, PUBLISHER, version)
    node.release.set()
    signer.wait()
    signer.close()
    assert node.asked == asked
    # v0, then v4 with every version between that replicas need: never a failed question.
    assert [sorted(record.hashes) for record in node.announced] == [[0], sorted(kept)]


def test_a_restart_in_a_burst_is_signed_and_voids_what_came_before() -> None:
    node = BurstPublisher({0, 1, 2})
    signer = LineageSigner(node, parse_config({"name": "lineage"}),  # type: ignore[arg-type]
                           new_session())
    signer.published(0, PUBLISHER, 0, restart=True)
    signer.published(0, PUBLISHER, 1)
    signer.published(0, PUBLISHER, 2)
    signer.published(0, PUBLISHER, 1, restart=True)  # a rollback to a checkpoint at v1
    signer.published(0, PUBLISHER, 2)
    node.release.set()
    signer.wait()
    signer.close()
    # The first v1 and v2 are left to the events after them; the rollback is not, so the new
    # v2 continues from it and no hash of the discarded branch stays in the record.
    assert node.asked == [0, 1, 2]
    assert [sorted(record.hashes) for record in node.announced] == [[0], [1], [1, 2]]
