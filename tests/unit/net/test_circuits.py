"""The bookkeeping of relayed connections (net/circuits.py): what a connection has room for,
when it must be replaced, and which peers count as reached through a relay."""

from __future__ import annotations

import pytest

from decentrl.net import circuits
from decentrl.net.circuits import CIRCUIT_AGE_S, CIRCUIT_BYTES, PIECE_BYTES, REPLY_ROOM, Circuits

RELAYED = "/ip4/10.250.0.2/tcp/4001/p2p/QmRelay/p2p-circuit"
DIRECT = "/ip4/10.250.0.3/tcp/4001"


def test_a_connection_has_room_until_either_direction_or_its_age_would_pass_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(circuits.time, "monotonic", lambda: now[0])
    circuit = Circuits().opened("peer", RELAYED)
    assert circuit.has_room(100, REPLY_ROOM)
    circuit.received = CIRCUIT_BYTES - REPLY_ROOM
    assert circuit.has_room(100, REPLY_ROOM)
    circuit.received += 1
    assert not circuit.has_room(100, REPLY_ROOM)
    circuit.renewed(RELAYED)
    circuit.sent = CIRCUIT_BYTES - 99
    assert not circuit.has_room(100, 0)
    circuit.renewed(RELAYED)
    now[0] += CIRCUIT_AGE_S
    assert not circuit.has_room(0, 0)
    circuit.renewed(RELAYED)
    circuit.broken = True
    assert not circuit.has_room(0, 0)
    circuit.renewed(RELAYED)
    assert circuit.has_room(0, 0) and circuit.sent == circuit.received == 0


def test_calls_in_flight_hold_their_room_until_they_settle_with_what_they_carried() -> None:
    circuit = Circuits().opened("peer", RELAYED)
    circuit.reserve(1000, REPLY_ROOM)
    circuit.reserve(1000, REPLY_ROOM)
    assert circuit.in_flight == 2 and not circuit.has_room(1000, REPLY_ROOM)
    circuit.settle(1000, REPLY_ROOM, sent=1000, received=300)
    assert circuit.in_flight == 1 and circuit.has_room(1000, REPLY_ROOM)
    circuit.settle(1000, REPLY_ROOM, sent=0, received=0)  # failed before it sent anything
    assert (circuit.in_flight, circuit.sent, circuit.received) == (0, 1000, 300)
    assert (circuit.reserved_sent, circuit.reserved_received) == (0, 0)


def test_peers_reached_through_a_relay_are_asked_in_pieces_until_they_come_directly() -> None:
    table = Circuits()
    assert table.piece_bytes("peer") is None
    table.seen("peer", RELAYED, received=500, sent=2000)
    circuit = table.get("peer")
    assert circuit is not None and (circuit.received, circuit.sent) == (500, 2000)
    assert table.piece_bytes("peer") == PIECE_BYTES
    # Reopened through the relay: the same entry (calls queued on its turn keep their place).
    assert table.opened("peer", RELAYED) is circuit and circuit.received == 0
    table.seen("peer", DIRECT, received=10, sent=10)
    assert table.get("peer") is None and table.piece_bytes("peer") is None


def test_the_table_of_circuits_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(circuits, "MAX_CIRCUITS", 3)
    table = Circuits()
    for peer in "abcd":
        table.opened(peer, RELAYED)
    assert [table.get(p) is not None for p in "abcd"] == [False, True, True, True]


def test_pieces_and_their_envelope_fit_the_room_a_call_keeps() -> None:
    assert PIECE_BYTES + 4096 <= REPLY_ROOM and 2 * REPLY_ROOM <= CIRCUIT_BYTES < 128 * 2**10
