"""Fuzzed reading of what peers publish and how their messages are framed: route records
(net/reach.py), signed DHT records and the bodies inside them (net/records.py), and the frames of
an RPC stream (net/streams.py). Whatever comes in is refused with a ValueError that says why, or
accepted and then holds what the check promises; never another exception, never a hang.

As in tests/unit/net/test_fuzz.py, each test counts its examples by branch and asserts both ran."""

from __future__ import annotations

import asyncio

import msgspec
from fuzzing import EDITS, FUZZ, Outcomes, message_bytes, mutate
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from decentrl.net.identity import Identity
from decentrl.net.protocol import PeerRecord, stage_key
from decentrl.net.reach import (
    MAX_ADDRESS_CHARS,
    MAX_ROUTES,
    RouteRecord,
    check_route_record,
    dialable,
    ip_tcp,
    multiaddr_protocols,
    through_relay,
)
from decentrl.net.records import MAX_RECORD_BYTES, SignedRecordValidator, decode_records
from decentrl.net.streams import FrameReader, FrameRefused
from decentrl.net.wire import WireError, decode_struct, encode_struct

RELAY = Identity.generate().peer_id

# ---- route records -----------------------------------------------------------------------------

OCTET = st.integers(0, 255)
PORT = st.integers(0, 70_000)
IP4 = st.builds("/ip4/{}.{}.{}.{}".format, OCTET, OCTET, OCTET, OCTET)
HOST = st.one_of(IP4, st.sampled_from(["/ip6/::1", "/ip6/fe80::1", "/dns4/example.org"]))
DIRECT = st.builds("{}/tcp/{}".format, HOST, PORT)
CIRCUIT = st.builds("{}/p2p/{}/p2p-circuit".format, DIRECT,
                    st.sampled_from([RELAY, RELAY[:-1], "QmNotAPeer", ""]))
ADDRESS = st.one_of(DIRECT, CIRCUIT, st.builds("{}/udp/{}".format, HOST, PORT),
                    st.text(max_size=40),
                    st.builds(lambda a, b: a + b, DIRECT, st.text(max_size=12)))
WELL_FORMED_ROUTES = st.fixed_dictionaries({
    "addresses": st.lists(ADDRESS, max_size=MAX_ROUTES + 1), "relayed": st.booleans()
}).map(msgspec.msgpack.encode)
ROUTE_BYTES = st.one_of(
    WELL_FORMED_ROUTES, message_bytes(RouteRecord),
    st.tuples(WELL_FORMED_ROUTES, EDITS).map(lambda pair: mutate(*pair)))


@FUZZ
@given(sent=ROUTE_BYTES)
@example(sent=encode_struct(RouteRecord(["/ip4/10.0.0.1/tcp/4000"], relayed=False)))
@example(sent=encode_struct(RouteRecord([f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"],
                                        relayed=True)))
def read_route_record(outcomes: Outcomes, sent: bytes) -> None:
    """What SwarmNode.routes_of does with a peer's record, then what its dial does with each
    address (net/daemon.py `Daemon.dial` takes a ValueError as "no connection this way")."""
    try:
        record = decode_struct(sent, RouteRecord)
        check_route_record(record)
    except ValueError as error:  # WireError included
        assert str(error)
        outcomes.refuse()
        return
    assert 0 < len(record.addresses) <= MAX_ROUTES
    for address in record.addresses:
        assert len(address) <= MAX_ADDRESS_CHARS
        assert ip_tcp(multiaddr_protocols(address))
        assert through_relay(address) == record.relayed
        try:
            dialable(address)
        except ValueError:
            pass
    outcomes.accept()


def test_any_route_record_is_refused_or_lists_only_tcp_routes_of_its_kind(
        fuzz_outcomes: Outcomes) -> None:
    read_route_record(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- signed DHT records ------------------------------------------------------------------------

WRITER = Identity.generate()
VALIDATOR = SignedRecordValidator(WRITER)
KEY = DHTID.generate(source=stage_key("fuzz", 0)).to_bytes()
ANNOUNCED = encode_struct(PeerRecord(name="p", stage=0, layers=(0, 4), role="inference",
                                     version=3, tokens_per_s=1.0, free_sessions=2,
                                     training_ready=False))
EXPIRATION = 1.0e9
# The record as hivemind stores it: the body serialized as a msgpack bin, then the signature.
GENUINE = DHTRecord(KEY, msgspec.msgpack.encode(WRITER.peer_id), msgspec.msgpack.encode(ANNOUNCED),
                    EXPIRATION)
SIGNED = DHTRecord(GENUINE.key, GENUINE.subkey, VALIDATOR.sign_value(GENUINE), EXPIRATION)
SUBKEYS = st.one_of(st.just(SIGNED.subkey), st.binary(max_size=80),
                    st.just(msgspec.msgpack.encode(None)),
                    st.just(msgspec.msgpack.encode(Identity.generate().peer_id)),
                    st.tuples(st.just(SIGNED.subkey), EDITS).map(lambda pair: mutate(*pair)))
VALUES = st.one_of(st.just(SIGNED.value), st.binary(max_size=200),
                   st.tuples(st.just(SIGNED.value), EDITS).map(lambda pair: mutate(*pair)),
                   st.just(b"\x00" * (MAX_RECORD_BYTES + 200)))


@FUZZ
@given(key=st.one_of(st.just(KEY), st.binary(min_size=20, max_size=20)), subkey=SUBKEYS,
       value=VALUES, expiration=st.one_of(st.just(EXPIRATION), st.floats()))
@example(key=KEY, subkey=SIGNED.subkey, value=SIGNED.value, expiration=EXPIRATION)
def validate_record(outcomes: Outcomes, key: bytes, subkey: bytes, value: bytes,
                    expiration: float) -> None:
    """What a node does with a record another node asks it to store or returns to a lookup:
    only the writer's own record, exactly as it was signed, passes."""
    record = DHTRecord(key, subkey, value, expiration)
    refused = sum(VALIDATOR.refused.values())
    if not VALIDATOR.validate(record):
        assert sum(VALIDATOR.refused.values()) == refused + 1  # counted, by reason
        outcomes.refuse()
        return
    assert msgspec.msgpack.decode(subkey) == WRITER.peer_id
    assert (key, value, expiration) == (KEY, SIGNED.value, EXPIRATION)
    assert VALIDATOR.strip_value(record) == GENUINE.value
    outcomes.accept()


def test_only_a_record_exactly_as_its_writer_signed_it_validates(
        fuzz_outcomes: Outcomes) -> None:
    validate_record(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


BODIES = st.one_of(message_bytes(PeerRecord),
                   st.tuples(st.just(ANNOUNCED), EDITS).map(lambda pair: mutate(*pair)))


@FUZZ
@given(entries=st.dictionaries(st.text(max_size=8), BODIES, max_size=4))
@example(entries={WRITER.peer_id: ANNOUNCED})
def read_records(outcomes: Outcomes, entries: dict[str, bytes]) -> None:
    """A lookup's validly signed bodies, as a directory reads them: each decodes as a PeerRecord
    of the stage asked for, or is skipped and counted."""
    found, skipped = decode_records(entries, PeerRecord, stage=0)
    assert len(found) + skipped == len(entries)
    assert all(isinstance(record, PeerRecord) and record.stage == 0
               for record in found.values())
    assert found.keys() <= entries.keys()
    if skipped:
        outcomes.refuse()
    else:
        outcomes.accept()


def test_record_bodies_decode_as_their_type_and_stage_or_are_skipped(
        fuzz_outcomes: Outcomes) -> None:
    read_records(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- stream framing ----------------------------------------------------------------------------

def frame(payload: bytes, error: bool = False) -> bytes:
    marker = P2P.ERROR_MARKER if error else P2P.MESSAGE_MARKER
    return marker + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


REQUEST = runtime_pb2.ExpertRequest(uid="abc", metadata=b"m" * 40)
HONEST_STREAM = frame(REQUEST.SerializeToString()) * 2 + frame(b"", error=True)
STREAM_LIMIT = 4 * len(HONEST_STREAM)
STREAMS = st.one_of(
    st.tuples(st.just(HONEST_STREAM), EDITS).map(lambda pair: mutate(*pair)),
    st.lists(st.builds(frame, st.one_of(st.just(REQUEST.SerializeToString()),
                                        st.binary(max_size=64)), st.booleans()),
             max_size=6).map(b"".join),
    st.binary(max_size=128))


async def read_stream(sent: bytes) -> tuple[list[runtime_pb2.ExpertRequest] | None,
                                            FrameReader]:
    """A server's reading of a caller that sent `sent` and closed its side: its requests (None:
    it went away before its end frame), and after a refusal the rest read away, as net/serving.py
    does."""
    reader = asyncio.StreamReader()
    reader.feed_data(sent)
    reader.feed_eof()
    frames = FrameReader(reader, "fuzz request", STREAM_LIMIT, idle_s=5.0)
    try:
        return await frames.requests(runtime_pb2.ExpertRequest), frames
    except FrameRefused:
        await frames.discard_rest(STREAM_LIMIT)
        raise


@FUZZ
@given(sent=STREAMS)
@example(sent=HONEST_STREAM)
def read_framed_requests(outcomes: Outcomes, sent: bytes) -> None:
    try:
        requests, frames = asyncio.run(read_stream(sent))
    except WireError as error:
        assert str(error).startswith("fuzz request")
        outcomes.refuse()
        return
    assert frames.received <= STREAM_LIMIT
    if requests is None:  # cut before its end: nothing is served
        outcomes.refuse()
        return
    assert frames.ended and all(isinstance(r, runtime_pb2.ExpertRequest) for r in requests)
    outcomes.accept()


def test_framed_requests_are_read_whole_within_the_limit_or_refused(
        fuzz_outcomes: Outcomes) -> None:
    read_framed_requests(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()
