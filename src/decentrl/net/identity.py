"""Peer identities: every peer's Ed25519 key pair is its libp2p identity, so its peer id names its
public key and anyone can check what it signed, also when the message reached them through
someone else.

A libp2p peer id of an Ed25519 key is the base58 "identity" multihash (code 0x00: the key is
inline, not hashed) of the protobuf PublicKey{Type=Ed25519, Data=32 bytes}: "12D3KooW...".
The daemon (p2pd `-id`) reads the private key as the protobuf PrivateKey{Type=Ed25519,
Data=seed || public key}, 64 bytes."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from decentrl.net.wire import WireError

KEY_BYTES = 32
# Identity multihash (code 0x00, length 36) of PublicKey{key_type: Ed25519 (field 1 = 1),
# data: 32 bytes (field 2, length 32)}: what precedes the raw key in every Ed25519 peer id.
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
# The multihash code of sha2-256: what an RSA peer id is (its key is too large to inline).
_SHA256_CODE = 0x12


class SignatureError(WireError):
    """A signature did not verify, or the peer id names no key to verify it with."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def peer_id_of(public_key: Ed25519PublicKey) -> str:
    """The libp2p peer id of an Ed25519 public key."""
    return PeerID(_PEER_ID_PREFIX + _raw_public(public_key)).to_base58()


class Identity:
    """A peer's private key. Its `peer_id` is the one its p2p daemon runs under."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.peer_id = peer_id_of(private_key.public_key())

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: str | Path) -> Identity:
        """The identity whose key `path` holds (p2pd's `-id` format); created there, readable by
        its owner only, when the file does not exist yet. A run's owner and its training peers
        keep their peer ids across restarts this way: the swarm admits peer ids."""
        path = Path(path)
        if not path.exists():
            identity = cls.generate()
            path.parent.mkdir(parents=True, exist_ok=True)
            identity.write_libp2p_key(path)
            return identity
        if path.stat().st_mode & 0o077:
            raise PermissionError(f"key file {path} is readable by others (mode "
                                  f"{path.stat().st_mode & 0o777:o}); chmod 600 it")
        key = crypto_pb2.PrivateKey()
        try:
            key.ParseFromString(path.read_bytes())
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise ValueError(f"key file {path} is not a libp2p private key: {error}") from None
        if key.key_type != crypto_pb2.KeyType.Ed25519 or len(key.data) != 2 * KEY_BYTES:
            raise ValueError(f"key file {path} does not hold an Ed25519 key (type "
                             f"{key.key_type}, {len(key.data)} bytes)")
        return cls(Ed25519PrivateKey.from_private_bytes(key.data[:KEY_BYTES]))

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of `data`."""
        return self._key.sign(data)

    def write_libp2p_key(self, path: str | Path) -> None:
        """Write the key as p2pd's `-id` file, readable by its owner only. The file must not
        exist yet: it is created with mode 0600, so the key is never readable by others."""
        seed = self._key.private_bytes_raw()
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                    data=seed + _raw_public(self._key.public_key()))
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(key.SerializeToString())

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"  # never the key


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 public key a peer id inlines. Raises SignatureError for anything else (an RSA
    peer id only hashes its key, so nothing it signed can be checked without more)."""
    try:
        multihash = PeerID.from_base58(peer_id).to_bytes()
    except ValueError as error:
        raise SignatureError(f"peer id {peer_id[-8:]!r} is not base58: {error}") from None
    if multihash[:1] == bytes([_SHA256_CODE]):
        raise SignatureError(f"peer {peer_id[-8:]} has a hashed (RSA?) key; only Ed25519 peer "
                             f"ids name their key, so its signatures cannot be checked")
    if len(multihash) != len(_PEER_ID_PREFIX) + KEY_BYTES \
            or not multihash.startswith(_PEER_ID_PREFIX):
        raise SignatureError(f"peer id {peer_id[-8:]!r} is not an Ed25519 peer id "
                             f"(an identity multihash of a 32-byte Ed25519 public key)")
    return Ed25519PublicKey.from_public_bytes(multihash[len(_PEER_ID_PREFIX):])


def verify(peer_id: str, data: bytes, signature: bytes) -> None:
    """Raise SignatureError unless `signature` is `peer_id`'s signature of `data`."""
    key = public_key_of(peer_id)
    try:
        key.verify(signature, data)
    except InvalidSignature:
        raise SignatureError(f"bad signature: not signed by peer {peer_id[-8:]} (the message "
                             f"was altered, cut short or forged)") from None
