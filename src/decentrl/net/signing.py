"""What a message's signature covers: every request and every reply carries an `Envelope` with
its body, its tensor manifest and its sender's Ed25519 signature of `message_digest`, checked
against the authenticated remote peer id before its tensors are decoded. The signature vouches
for the message itself, also where someone relays it later."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from hivemind.proto import runtime_pb2

from decentrl.net.identity import Identity, verify
from decentrl.net.wire import TensorManifest, encode_struct

SIGNATURE_DOMAIN = b"decentrl/1"
MessageKind = Literal["request", "reply"]
_KIND_BYTE: dict[MessageKind, bytes] = {"request": b"\x00", "reply": b"\x01"}


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every message's metadata: the method's own struct (msgpack bytes), the tensor manifest,
    and the sender's Ed25519 signature of `message_digest`."""

    body: bytes
    manifest: TensorManifest
    signature: bytes


def _length(data: bytes | Sequence[Any]) -> bytes:
    return len(data).to_bytes(8, "little")


def message_digest(kind: MessageKind, method: str, request_id: str, body: bytes,
                   manifest: TensorManifest, parts: Sequence[runtime_pb2.Tensor]) -> bytes:
    """sha256 of everything a message's signature vouches for. Every field is length-prefixed,
    so no two messages share an encoding; the kind, method and request id tie a reply to its
    request. Of each tensor part only the buffer: the manifest fixes its dtype, shape and
    compression (decode_tensors refuses a part that differs from it), and chunking is not part
    of the message."""
    digest = hashlib.sha256(SIGNATURE_DOMAIN + _KIND_BYTE[kind])
    for data in (method.encode(), request_id.encode(), body, encode_struct(manifest)):
        digest.update(_length(data))
        digest.update(data)
    digest.update(_length(parts))
    for part in parts:
        buffer = part.buffer  # a copy per access under protobuf's upb backend: take it once
        digest.update(_length(buffer))
        digest.update(buffer)
    return digest.digest()


def signed_envelope(identity: Identity, kind: MessageKind, method: str, request_id: str,
                    body: bytes, manifest: TensorManifest,
                    parts: Sequence[runtime_pb2.Tensor]) -> bytes:
    """A message's metadata: its Envelope, signed by `identity`, encoded."""
    signature = identity.sign(message_digest(kind, method, request_id, body, manifest, parts))
    return encode_struct(Envelope(body, manifest, signature))


def verify_envelope(sender: str, kind: MessageKind, method: str, request_id: str,
                    envelope: Envelope, parts: Sequence[runtime_pb2.Tensor]) -> None:
    """Raise SignatureError (a WireError) unless `sender` signed this message."""
    digest = message_digest(kind, method, request_id, envelope.body, envelope.manifest, parts)
    verify(sender, digest, envelope.signature)
