"""Peer identities and signed messages: a node's Ed25519 key is its libp2p identity, every request
and reply is signed by its sender and checked against the authenticated peer id before anything
else is decoded, and a node blocks a sender of repeated malformed requests for a while."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.proto import crypto_pb2
from swarm_helpers import call_raw, envelope

from decentrl.errors import DecentrlError, SenderFault
from decentrl.net.identity import Identity, SignatureError, public_key_of, verify
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import Rpc
from decentrl.net.serving import REPLY_CACHE_SIZE
from decentrl.net.wire import TensorLimits

# An RSA peer id ("Qm..."): a sha2-256 multihash of its key, so the key is not in the id.
RSA_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class Echo(msgspec.Struct, frozen=True):
    text: str


ECHO = Rpc("echo", Echo, Echo, "any peer")


# ---- keys and signatures -----------------------------------------------------------------------

def test_key_file_round_trips_to_the_same_peer_id(tmp_path: Path) -> None:
    identity = Identity.generate()
    assert identity.peer_id.startswith("12D3KooW")
    path = tmp_path / "key"
    identity.write_libp2p_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert key.key_type == crypto_pb2.KeyType.Ed25519 and len(key.data) == 64
    again = Identity(Ed25519PrivateKey.from_private_bytes(key.data[:32]))
    assert again.peer_id == identity.peer_id
    verify(identity.peer_id, b"data", again.sign(b"data"))
    with pytest.raises(FileExistsError, match="File exists"):  # never over another key
        identity.write_libp2p_key(path)
    assert identity.peer_id in repr(identity)


def test_a_peer_id_verifies_its_signatures_and_nothing_else() -> None:
    identity, other = Identity.generate(), Identity.generate()
    data = b"activations " * 100
    signature = identity.sign(data)
    public_key_of(identity.peer_id).verify(signature, data)  # what verify() does
    verify(identity.peer_id, data, signature)
    flipped = bytearray(signature)
    flipped[5] ^= 1
    altered = data[:-1] + b"!"
    for peer, message, sig in [(identity.peer_id, data, bytes(flipped)),
                               (identity.peer_id, altered, signature),
                               (other.peer_id, data, signature),
                               (identity.peer_id, data, signature[:10])]:
        with pytest.raises(SignatureError, match=rf"bad signature: not signed by peer "
                                                 rf"{peer[-8:]}"):
            verify(peer, message, sig)


@pytest.mark.parametrize(("peer_id", "message"), [
    (RSA_PEER_ID, r"hashed \(RSA\?\) key; only Ed25519 peer ids name their key"),
    ("not-base58-0OIl", "is not base58"),
    ("", "is not an Ed25519 peer id"),
    ("12D3KooW", "is not an Ed25519 peer id"),
])
def test_peer_ids_without_an_ed25519_key_are_refused_clearly(peer_id: str, message: str) -> None:
    with pytest.raises(SignatureError, match=message):
        public_key_of(peer_id)
    with pytest.raises(SignatureError, match=message):
        verify(peer_id, b"data", bytes(64))


# ---- nodes ---------------------------------------------------------------------------------------

@contextmanager
def nodes(count: int, **options: Any) -> Iterator[list[SwarmNode]]:
    """`count` loopback nodes, the first started with `options`; every one shut down on exit."""
    started: list[SwarmNode] = []
    try:
        started.append(SwarmNode.start("server", [], LinkProfile(), TensorLimits(), **options))
        for index in range(1, count):
            started.append(SwarmNode.start(f"node{index}", started[0].addresses(), LinkProfile(),
                                           TensorLimits()))
        yield started
    finally:
        for node in started:
            node.shutdown()


def serve_echo(node: SwarmNode) -> list[str]:
    """Serve "echo" (a text of "bad" is a SenderFault, as a handler's PeerError is); returns the
    texts the handler saw."""
    seen: list[str] = []

    async def echo(request: Request[Echo]) -> Reply:
        seen.append(request.body.text)
        if request.body.text == "bad":
            raise SenderFault("bad text")
        return Reply(Echo(request.body.text.upper()))
    node.serve(ECHO, echo)
    return seen


def echo(node: SwarmNode, peer: str, text: str) -> str:
    reply, _ = node.call_sync(peer, ECHO, Echo(text), timeout=10)
    return reply.text


@pytest.mark.network
def test_a_node_runs_as_its_identity() -> None:
    identity = Identity.generate()
    with nodes(2, identity=identity) as (server, other):
        assert server.identity is identity and server.peer_id == identity.peer_id
        assert other.peer_id == other.identity.peer_id and other.peer_id != server.peer_id


@pytest.mark.network
def test_the_key_file_is_private_and_gone_once_the_daemon_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[tuple[Path, int, int]] = []
    real_write = Identity.write_libp2p_key

    def write(identity: Identity, path: str | Path) -> None:
        real_write(identity, path)
        folder = Path(path).parent
        written.append((Path(path), stat.S_IMODE(os.stat(folder).st_mode),
                        stat.S_IMODE(os.stat(path).st_mode)))
    monkeypatch.setattr(Identity, "write_libp2p_key", write)
    with nodes(1) as (server,):
        [(path, folder_mode, file_mode)] = written
        assert (folder_mode, file_mode) == (0o700, 0o600)
        assert not path.exists() and not path.parent.exists()
        assert server.peer_id == server.identity.peer_id


@pytest.mark.network
def test_signed_requests_and_replies_go_through_and_forged_ones_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with nodes(2) as (server, client):
        seen = serve_echo(server)
        strikes: list[tuple[str, str]] = []
        server.on_strike = lambda peer, reason: strikes.append((peer, reason))
        assert echo(client, server.peer_id, "hi") == "HI"

        # A request signed by another key than the one its stream is authenticated with.
        monkeypatch.setattr(client.guard, "identity", Identity.generate())
        with pytest.raises(PeerRefused, match=rf"bad signature: not signed by peer "
                                              rf"{client.peer_id[-8:]}"):
            echo(client, server.peer_id, "forged")
        assert seen == ["hi"]  # the handler never ran
        assert strikes == [(client.peer_id, strikes[0][1])] and "signature" in strikes[0][1]
        assert server.strikes(client.peer_id) == 1 and not server.blocked(client.peer_id)
        monkeypatch.undo()

        # A reply signed by another key than the server's: the caller refuses it.
        monkeypatch.setattr(server.guard, "identity", Identity.generate())
        with pytest.raises(SignatureError, match=rf"not signed by peer {server.peer_id[-8:]}"):
            echo(client, server.peer_id, "reply")
        assert seen == ["hi", "reply"]  # ran once: the caller's retries hit the reply cache
        monkeypatch.undo()
        assert echo(client, server.peer_id, "again") == "AGAIN"


@pytest.mark.network
def test_unsigned_metadata_is_refused_before_the_handler() -> None:
    with nodes(2) as (server, client):
        seen = serve_echo(server)
        unsigned = msgspec.msgpack.encode({"body": msgspec.msgpack.encode(Echo("x")),
                                           "manifest": {}})
        with pytest.raises(RemoteError, match="bad Envelope message.*`signature`"):
            call_raw(client, server.peer_id, "echo", unsigned)
        assert seen == [] and server.strikes(client.peer_id) == 1


@pytest.mark.network
def test_a_refused_request_sent_again_is_one_strike_and_one_run() -> None:
    """A caller whose reply was lost sends the same signed request again (SwarmNode.call): the
    peer refuses it again from its reply cache; a new request is a new strike."""
    with nodes(2) as (server, client):
        seen = serve_echo(server)
        for _ in range(2):
            with pytest.raises(RemoteError, match="bad text"):
                call_raw(client, server.peer_id, "echo", envelope(Echo("bad")),
                         request_id="retried")
        assert seen == ["bad"] and server.strikes(client.peer_id) == 1
        with pytest.raises(RemoteError, match="bad text"):
            call_raw(client, server.peer_id, "echo", envelope(Echo("bad")))
        assert seen == ["bad", "bad"] and server.strikes(client.peer_id) == 2


@pytest.mark.network
def test_strangers_cannot_evict_the_owners_cached_replies() -> None:
    """The reply cache is kept per callers class: a stranger filling the open RPCs' cache with
    many requests leaves the owner's cached reply in place, so the owner's retry of a lost
    reply is answered from it, not run twice."""
    owned = Rpc("owned_echo", Echo, Echo, "coordinator")
    with nodes(3) as (server, owner, stranger):
        seen = serve_echo(server)
        ran: list[str] = []

        async def owned_echo(request: Request[Echo]) -> Reply:
            ran.append(request.body.text)
            return Reply(Echo(request.body.text.upper()))

        async def only_the_owner(sender: str, rpc: Rpc[Any, Any]) -> None:
            if rpc.callers == "coordinator" and sender != owner.peer_id:
                raise SenderFault(f"{rpc.method} is for the owner")
        server.authorize = only_the_owner
        server.serve(owned, owned_echo)
        call_raw(owner, server.peer_id, "owned_echo", envelope(Echo("step")), request_id="kept")
        for index in range(REPLY_CACHE_SIZE + 4):  # more than the cache holds
            call_raw(stranger, server.peer_id, "echo", envelope(Echo(f"flood {index}")),
                     request_id=f"flood {index}")
        assert len(seen) == REPLY_CACHE_SIZE + 4
        call_raw(owner, server.peer_id, "owned_echo", envelope(Echo("step")), request_id="kept")
        assert ran == ["step"]  # the retry was answered from the cache
        # The open RPCs' own cache is bounded: the stranger's first request, evicted, runs again.
        call_raw(stranger, server.peer_id, "echo", envelope(Echo("flood 0")),
                 request_id="flood 0")
        assert len(seen) == REPLY_CACHE_SIZE + 5 and seen[-1] == "flood 0"


class StoppedClock:
    """A strike clock that stands still until the test moves it (monotonic seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.network
def test_a_sender_of_malformed_requests_is_blocked_for_a_while() -> None:
    clock = StoppedClock()
    with nodes(3, strikes_to_block=3, block_s=3.0) as (server, attacker, honest):
        server.strike_book.clock = clock
        seen = serve_echo(server)
        strikes: list[str] = []
        server.on_strike = lambda peer, reason: strikes.append(peer)
        for number in range(3):
            assert server.strikes(attacker.peer_id) == number
            with pytest.raises(PeerRefused, match="bad text"):
                echo(attacker, server.peer_id, "bad")
        assert strikes == [attacker.peer_id] * 3
        assert server.blocked(attacker.peer_id) and server.strikes(attacker.peer_id) == 0

        # Blocked: refused unread (the handler never sees it), even a well-formed request.
        with pytest.raises(PeerRefused, match=r"blocked for 3s after 3 malformed requests"):
            echo(attacker, server.peer_id, "good")
        assert seen == ["bad"] * 3 and len(strikes) == 3  # a refusal is not another strike

        # Another sender is unaffected.
        assert echo(honest, server.peer_id, "fine") == "FINE"
        assert not server.blocked(honest.peer_id) and server.strikes(honest.peer_id) == 0

        # The block lasts block_s, and not longer.
        clock.now += 2.75
        with pytest.raises(PeerRefused, match=r"blocked for 0s after 3 malformed requests"):
            echo(attacker, server.peer_id, "still")
        clock.now += 0.25
        assert not server.blocked(attacker.peer_id)
        assert echo(attacker, server.peer_id, "back") == "BACK"
        assert seen == ["bad"] * 3 + ["fine", "back"]


@pytest.mark.network
def test_a_failing_strike_listener_does_not_break_serving() -> None:
    with nodes(2) as (server, client):
        serve_echo(server)

        def broken(peer: str, reason: str) -> None:
            raise RuntimeError("listener bug")
        server.on_strike = broken
        with pytest.raises(PeerRefused, match="bad text"):
            echo(client, server.peer_id, "bad")
        assert server.strikes(client.peer_id) == 1
        assert echo(client, server.peer_id, "ok") == "OK"


@pytest.mark.network
def test_only_a_sender_fault_in_a_handler_is_a_strike() -> None:
    """A handler's own failure (a bug, a library's ValueError) and a refusal it means without
    blaming the sender (a DecentrlError) are answered with their text, and are no strike; a
    SenderFault is one (decentrl/errors.py)."""
    with nodes(2) as (server, client):
        raised = {"internal": ValueError("a tensor op failed here"),
                  "bug": KeyError("missing"), "busy": DecentrlError("try again later"),
                  "fault": SenderFault("malformed text")}

        async def fail(request: Request[Echo]) -> Reply:
            raise raised[request.body.text]
        server.serve(ECHO, fail)
        strikes: list[str] = []
        server.on_strike = lambda peer, reason: strikes.append(reason)
        for text, message in (("internal", "a tensor op failed here"), ("bug", "missing"),
                              ("busy", "try again later")):
            with pytest.raises(PeerRefused, match=message):
                echo(client, server.peer_id, text)
        assert strikes == [] and server.strikes(client.peer_id) == 0
        with pytest.raises(PeerRefused, match="malformed text"):
            echo(client, server.peer_id, "fault")
        assert strikes == ["echo: malformed text"] and server.strikes(client.peer_id) == 1


def test_node_refuses_nonsense_strike_settings() -> None:
    with pytest.raises(ValueError, match="strikes_to_block >= 1"):
        SwarmNode("x", LinkProfile(), TensorLimits(), strikes_to_block=0)


def test_a_key_file_keeps_its_peer_id_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "peer.key"
    made = Identity.from_file(path)  # made on first use, readable by its owner only
    assert path.stat().st_mode & 0o777 == 0o600
    assert Identity.from_file(path).peer_id == made.peer_id
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        Identity.from_file(path)
    path.chmod(0o600)
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="is not a libp2p private key|does not hold an Ed25519"):
        Identity.from_file(path)
