"""The coordinator's lineage signer (coordinator/lineage.py) against a stub publisher: the fidelity
a training peer reports is only a metric, so one that cannot be true is left out of the step
metrics while the version it came with is still signed and announced."""

from __future__ import annotations

from typing import Any

import pytest

from decentrl.config import parse_config
from decentrl.coordinator.lineage import LineageSigner
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
