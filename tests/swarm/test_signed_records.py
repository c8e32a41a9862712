"""The signed directory (net/records.py): every DHT record is signed by the writer its subkey
names. A forged, overwritten, replayed, prolonged, unsigned or oversized record, or one whose
subkey is not an Ed25519 peer id, is refused when a stranger asks an honest node to store it and
ignored when a stranger returns it to a lookup, each refusal counted by reason; a validly signed
record whose body is malformed is skipped by every reader and counted, never fatal to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time
from swarm_helpers import start_swarm, tiny_run_config, weights_of

from decentrl.coordinator.manifest import publish_manifest, read_manifest, run_manifest
from decentrl.launch.join import choose_stage
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.directory import Directory
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import (
    LineageRecord,
    PeerRecord,
    RunManifest,
    lineage_key,
    stage_key,
)
from decentrl.net.records import (
    MAX_RECORD_BYTES,
    SignedRecordValidator,
    decode_records,
    record_payload,
)
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits, encode_struct
from tests.swarm.test_identity import RSA_PEER_ID
from tests.swarm.test_sync import assert_serves_published, fake_step, follow_all, sync_config

KEY = "decentrl/run/stage0"
KEY_ID = DHTID.generate(source=KEY).to_bytes()
LATER = 2e9  # an expiration time (DHT time is wall-clock seconds)
NOT_A_PEER_ID = "subkey is not an Ed25519 peer id"


def record(subkey: object, body: bytes = b"body", key_id: bytes = KEY_ID,
           expiration: float = LATER) -> DHTRecord:
    """A record as hivemind hands it to a validator: subkey and value serialized, unsigned."""
    return DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(body),
                     expiration)


def signed(identity: Identity, body: bytes = b"body", key_id: bytes = KEY_ID,
           expiration: float = LATER) -> DHTRecord:
    """`identity`'s own record, signed as its node signs it before storing it."""
    unsigned = record(identity.peer_id, body, key_id, expiration)
    return replace(unsigned, value=SignedRecordValidator(identity).sign_value(unsigned))


def forged(signer: Identity, writer: str, body: bytes = b"body", key_id: bytes = KEY_ID,
           expiration: float = LATER) -> bytes:
    """A stored value for `writer`'s subkey, signed by `signer`'s key: what a stranger makes."""
    value = MSGPackSerializer.dumps(body)
    return value + signer.sign(record_payload(key_id, writer, value, expiration))


# ---- the validator ----------------------------------------------------------------------------

def test_a_record_signed_by_its_writer_passes_and_reads_back_as_written() -> None:
    writer = Identity.generate()
    validator = SignedRecordValidator(Identity.generate())  # any node checks any writer's record
    good = signed(writer, b"announcement")
    assert validator.validate(good)
    assert MSGPackSerializer.loads(validator.strip_value(good)) == b"announcement"
    at_the_limit = signed(writer, bytes(MAX_RECORD_BYTES))
    assert validator.validate(at_the_limit)
    assert validator.refused == {}


Attack = Callable[[Identity, Identity], DHTRecord]
ATTACKS: dict[str, tuple[Attack, str]] = {
    "forged signature": (
        lambda honest, stranger: replace(record(honest.peer_id),
                                         value=forged(stranger, honest.peer_id)),
        "bad signature"),
    "someone else's subkey": (  # a node signs only under its own peer id: this stays unsigned
        lambda honest, stranger: replace(
            record(honest.peer_id, b"x" * 100),
            value=SignedRecordValidator(stranger).sign_value(record(honest.peer_id, b"x" * 100))),
        "bad signature"),
    "unsigned and short": (lambda honest, stranger: record(honest.peer_id), "bad signature"),
    "tampered expiration": (
        lambda honest, stranger: replace(signed(honest), expiration_time=LATER + 3600),
        "bad signature"),
    "tampered body": (
        lambda honest, stranger: replace(signed(honest, b"version 1"), value=signed(
            honest, b"version 1").value.replace(b"version 1", b"version 9")),
        "bad signature"),
    "replayed under another key": (
        lambda honest, stranger: replace(signed(honest),
                                         key=DHTID.generate(source="other").to_bytes()),
        "bad signature"),
    "subkey '0'": (lambda honest, stranger: replace(signed(honest),
                                                    subkey=MSGPackSerializer.dumps("0")),
                   NOT_A_PEER_ID),
    "subkey 0 (an int)": (lambda honest, stranger: record(0), NOT_A_PEER_ID),
    "RSA peer id": (lambda honest, stranger: record(RSA_PEER_ID), NOT_A_PEER_ID),
    "long subkey": (lambda honest, stranger: record("1" * 10_000), NOT_A_PEER_ID),
    "no subkey": (lambda honest, stranger: record(None), "no subkey"),
    "oversized": (lambda honest, stranger: signed(honest, bytes(MAX_RECORD_BYTES + 1)),
                  "oversized"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_bad_record_is_refused_and_its_reason_counted(attack: str) -> None:
    make, reason = ATTACKS[attack]
    validator = SignedRecordValidator(Identity.generate())
    assert not validator.validate(make(Identity.generate(), Identity.generate()))
    assert validator.refused == {reason: 1}


def test_refusals_are_counted_from_any_number_of_threads() -> None:
    validator = SignedRecordValidator(Identity.generate())
    bad = record(None)
    with ThreadPoolExecutor(4) as pool:
        assert not any(pool.map(lambda _: validator.validate(bad), range(400)))
    assert validator.refused == {"no subkey": 400}


def peer_record(name: str, stage: int = 0, version: int = 0,
                role: str = "inference") -> PeerRecord:
    return PeerRecord(name=name, stage=stage, layers=(0, 2), role=role,  # type: ignore[arg-type]
                      version=version, tokens_per_s=0.0, free_sessions=4, training_ready=False)


def test_readers_skip_and_count_bodies_that_do_not_decode_or_belong_elsewhere() -> None:
    entries = {"good": encode_struct(peer_record("a")), "garbage": b"\xff\x00",
               "lineage": encode_struct(LineageRecord(stage=0, publisher="p", hashes={1: "h"}, session="s")),
               "elsewhere": encode_struct(peer_record("b", stage=1))}
    found, skipped = decode_records(entries, PeerRecord, stage=0)
    assert found == {"good": peer_record("a")} and skipped == 3
    assert decode_records(entries, PeerRecord) == (
        {"good": peer_record("a"), "elsewhere": peer_record("b", stage=1)}, 2)
    with pytest.raises(TypeError, match="RunManifest has no stage to filter on"):
        decode_records(entries, RunManifest, stage=0)


# ---- against live nodes -----------------------------------------------------------------------

@contextmanager
def nodes(count: int, initial_peers: list[str] | None = None) -> Iterator[list[SwarmNode]]:
    """`count` nodes on loopback, the first one bootstrapping the others."""
    started: list[SwarmNode] = []
    try:
        for index in range(count):
            peers = initial_peers or (started[0].addresses() if started else [])
            started.append(SwarmNode.start(f"n{index}", peers, LinkProfile(), TensorLimits()))
        yield started
    finally:
        for node in started:
            node.shutdown()


def store_at(stranger: SwarmNode, target: str, key: str, value: bytes, subkey: object,
             expiration: float) -> bool:
    """A stranger's hand-made store request to `target`, past its own node's validator."""
    stored = stranger.run(stranger.dht.protocol.call_store(  # type: ignore[union-attr]
        PeerID.from_base58(target), [DHTID.generate(source=key)], [value], expiration,
        subkeys=[subkey]), timeout=30)
    assert stored is not None, f"{target[-8:]} did not answer the store request"
    return stored[0]


def plant(stranger: SwarmNode, key: str, subkey: object, value: bytes, expiration: float) -> None:
    """A record in the stranger's own storage, as a node without a validator or bounds keeps
    anything: it returns it to every lookup that asks it."""
    DHTLocalStorage.store_subkey(stranger.dht.protocol.storage,  # type: ignore[union-attr]
                                 DHTID.generate(source=key), subkey, value, expiration)


def join(members: list[SwarmNode], run: str = "run", num_stages: int = 1) -> None:
    """`members` keep the DHT records of `run`, owned by the first of them."""
    for member in members:
        member.dht_storage.join(RunNamespace(run, members[0].peer_id, num_stages, 2.0))


@pytest.mark.network
def test_a_stranger_cannot_forge_overwrite_or_prolong_an_honest_record() -> None:
    with nodes(3) as (honest, reader, stranger):
        join([honest, reader])
        body = encode_struct(peer_record("honest"))
        honest.run(honest.announce(KEY, body, 60), timeout=30)  # the stranger keeps none
        with pytest.raises(ValueError, match=f"over the DHT's limit of {MAX_RECORD_BYTES}"):
            honest.run(honest.announce(KEY, bytes(MAX_RECORD_BYTES + 1), 60), timeout=30)
        lie = encode_struct(peer_record("honest", version=99))
        later = get_dht_time() + 60
        # The honest record as stored (signed), which anyone can fetch, with its expiry pushed.
        found = stranger.run(stranger.dht.protocol.call_find(  # type: ignore[union-attr]
            PeerID.from_base58(honest.peer_id), [DHTID.generate(source=KEY)]), timeout=30)
        assert found is not None
        (stored, _), = found.values()
        signed_value = stored.value.get(honest.peer_id).value
        attempts = {
            "forged": (forged(stranger.identity, honest.peer_id, lie, KEY_ID, later),
                       honest.peer_id),
            "unsigned": (MSGPackSerializer.dumps(lie) + bytes(64), honest.peer_id),
            "prolonged": (signed_value, honest.peer_id),
            "subkey 0": (forged(stranger.identity, "0", lie, KEY_ID, later), "0"),
            "no subkey": (MSGPackSerializer.dumps(lie), None),
        }
        for target in (honest, reader):
            for attempt, (value, subkey) in attempts.items():
                assert not store_at(stranger, target.peer_id, KEY, value, subkey, later), attempt
            assert target.refused_records == {"bad signature": 3, NOT_A_PEER_ID: 1,
                                              "no subkey": 1}
        # The stranger keeps the forgery itself and returns it to lookups: they ignore it.
        plant(stranger, KEY, honest.peer_id, attempts["forged"][0], later)
        for node in (honest, reader):
            assert node.run(node.lookup(KEY), timeout=30) == {honest.peer_id: body}
        assert reader.refused_records["bad signature"] > 3


@pytest.mark.network
def test_a_stranger_writing_subkey_0_stops_no_directory_and_no_sync(tiny_sharp_dir: Path
                                                                     ) -> None:
    config = sync_config(tiny_sharp_dir)
    layout = [(0, "training"), (0, "inference"), (0, "inference")]
    with start_swarm(config, layout) as swarm, \
            nodes(1, swarm.client.addresses()) as (stranger,):
        trainer_peer, replicas = swarm.peer(0, "training"), swarm.peers[1:]
        later = get_dht_time() + 60
        hostile = {stage_key(config.name, 0): encode_struct(peer_record("zero")),
                   lineage_key(config.name, 0): encode_struct(
                       LineageRecord(stage=0, publisher=stranger.peer_id, hashes={99: "h"},
                                     session=new_session()))}
        for key, body in hostile.items():
            value = forged(stranger.identity, "0", body, DHTID.generate(source=key).to_bytes(),
                           later)
            for peer in [swarm.client, *(p.node for p in swarm.peers)]:
                assert not store_at(stranger, peer.peer_id, key, value, "0", later)
            plant(stranger, key, "0", value, later)
        directory = swarm.directory()
        assert set(directory.records()) == {p.node.peer_id for p in swarm.peers}
        assert directory.skipped_records == 0  # refused by the validator, never decoded
        fake_step(swarm, trainer_peer, 1)
        follow_all(replicas)
        for replica in replicas:
            assert_serves_published(replica, trainer_peer)
        assert all(p.node.refused_records[NOT_A_PEER_ID] >= 2 for p in swarm.peers)


@pytest.mark.network
def test_a_signed_but_malformed_body_is_skipped_and_counted(tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm, \
            nodes(1, swarm.client.addresses()) as (stranger,):
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        for key, body in {stage_key(config.name, 0): b"\xff not a record",
                          lineage_key(config.name, 0): encode_struct(peer_record("wrong type"))
                          }.items():
            stranger.run(stranger.announce(key, body, 60), timeout=30)
        directory = Directory(swarm.client, config.name, 1, config.swarm)
        directory.refresh()
        assert set(directory.records()) == {p.node.peer_id for p in swarm.peers}
        assert directory.skipped_records == 1
        assert choose_stage(swarm.client, config, "inference") == 0
        fake_step(swarm, trainer_peer, 1)
        follower = weights_of(replica).follower
        assert replica.node.run(weights_of(replica).follow(), timeout=60)
        assert_serves_published(replica, trainer_peer)
        # The stage key's garbage is skipped and counted; the stranger's record under the
        # lineage key is not even read: only the run owner's lineage counts.
        assert follower.skipped_records >= 1
        # Well signed, so the stage key kept its garbage; the lineage key is the owner's alone.
        assert swarm.client.refused_records == {"not its writer's key": 1}


@pytest.mark.network
def test_only_the_run_owners_manifest_is_read(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    with nodes(3) as (owner, stranger, joiner):
        publish_manifest(owner, run_manifest(config, roster=[], session=new_session()), 60)
        assert read_manifest(joiner, config.name, owner.peer_id).config_json == \
            config.run_json()
        # A stranger announces a run of the same name with its own config: a peer told the
        # owner's id never reads it.
        hostile = config.model_copy(update={"seed": config.seed + 1})
        publish_manifest(stranger, run_manifest(hostile, roster=[], session=new_session()), 60)
        assert read_manifest(joiner, config.name, owner.peer_id).config_json == \
            config.run_json()
        assert read_manifest(joiner, config.name, stranger.peer_id).config_json == \
            hostile.run_json()
