"""Signed DHT records: every record we write is signed by its writer, its subkey is the writer's
peer id, and every node checks both before it stores a record or uses one it found.

The check is hivemind's record-validator mechanism (`RecordValidatorBase`, given to
`DHTNode.create`): hivemind calls `sign_value` on each record this node stores, `validate` on
each record another node asks it to store (`rpc_store`) and on each record another node returns
to a lookup, and `strip_value` on each validated record before handing it to the application.
A stored value is the value as hivemind serialized it (msgpack), followed by the writer's 64-byte
Ed25519 signature of `record_payload`: a domain tag, the key's DHT id, the writer's peer id, the
value and the expiration time. So nobody can forge a record, overwrite another writer's record
(the subkey names the only key that may sign it), replay it under another key, or extend its
expiry. A record is refused when it has no subkey, its subkey is not an Ed25519 peer id, it is
over `MAX_RECORD_BYTES`, or its signature does not verify; refusals are counted by reason.

The signature vouches for who wrote a record, not for what it says: a body is decoded strictly by
its reader (`decode_records`), and a validly signed body that does not decode is skipped and
counted, never fatal to the reader."""

from __future__ import annotations

import logging
import struct
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Literal, TypeVar

import msgspec
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from decentrl.errors import DecentrlError
from decentrl.net.identity import Identity, SignatureError, public_key_of, verify
from decentrl.net.wire import WireError, decode_struct

log = logging.getLogger(__name__)

RECORD_DOMAIN = b"decentrl/dht-record/1"
SIGNATURE_BYTES = 64
# The largest body a record may carry. Our records are small (a peer's announcement is ~150
# bytes, the run config ~2 KB); the cap leaves room for a run manifest with a roster of several
# hundred peers (~70 bytes each), and bounds what any one writer makes every node on a key's path
# store and every reader fetch, on each refresh, for each key it reads.
MAX_RECORD_BYTES = 64 * 1024
# hivemind serializes a bytes value as one msgpack bin: a header of at most 5 bytes.
_MSGPACK_BIN_HEADER_BYTES = 5


def stored_value_bytes(body_bytes: int) -> int:
    """The most a stored value takes for a body of `body_bytes`: the body as hivemind serialized
    it, then the writer's signature."""
    return body_bytes + _MSGPACK_BIN_HEADER_BYTES + SIGNATURE_BYTES


_MAX_STORED_VALUE_BYTES = stored_value_bytes(MAX_RECORD_BYTES)
# An Ed25519 peer id is 52 base58 characters; its msgpack str has a 2-byte header. Anything much
# longer is refused before it is decoded (base58 decoding is quadratic in the length).
_MAX_SUBKEY_BYTES = 64

RefusalReason = Literal["no subkey", "subkey is not an Ed25519 peer id", "oversized",
                        "bad signature"]
R = TypeVar("R", bound=msgspec.Struct)


class RecordRefused(DecentrlError, ValueError):
    """A record this node would refuse to store: the reason is one of `RefusalReason`."""

    def __init__(self, reason: RefusalReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: RefusalReason = reason


def record_payload(key_id: bytes, writer: str, value: bytes, expiration_time: float) -> bytes:
    """What a record's signature covers. Every field is length-prefixed (the expiration time is a
    fixed 8-byte double), so no two records share an encoding."""
    parts = [RECORD_DOMAIN, key_id, writer.encode(), value]
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts) \
        + struct.pack(">d", expiration_time)


def record_writer(subkey: bytes) -> str:
    """The peer id a record's subkey (as hivemind serialized it) names. Raises RecordRefused
    unless it is an Ed25519 peer id, the only kind whose key signs the record."""
    if len(subkey) > _MAX_SUBKEY_BYTES:
        raise RecordRefused("subkey is not an Ed25519 peer id",
                            f"a subkey of {len(subkey)} bytes")
    try:
        writer = msgspec.msgpack.decode(subkey, type=str | None)
    except msgspec.DecodeError:
        raise RecordRefused("subkey is not an Ed25519 peer id", "not a string") from None
    if writer is None:  # hivemind's subkey of a plain value
        raise RecordRefused("no subkey", "every record must be under its writer's peer id")
    try:
        public_key_of(writer)
    except SignatureError as error:
        raise RecordRefused("subkey is not an Ed25519 peer id", str(error)) from None
    return writer


def check_record(record: DHTRecord) -> None:
    """Raise RecordRefused unless `record` is signed by the peer its subkey names, within the
    size limit."""
    writer = record_writer(record.subkey)
    if len(record.value) > _MAX_STORED_VALUE_BYTES:
        raise RecordRefused("oversized", f"{len(record.value)} bytes from {writer[-8:]}, over "
                                         f"{MAX_RECORD_BYTES} of body")
    if len(record.value) < SIGNATURE_BYTES:
        raise RecordRefused("bad signature", f"a value of {len(record.value)} bytes from "
                                             f"{writer[-8:]} has no room for one")
    value, signature = record.value[:-SIGNATURE_BYTES], record.value[-SIGNATURE_BYTES:]
    try:
        verify(writer, record_payload(record.key, writer, value, record.expiration_time),
               signature)
    except SignatureError as error:
        raise RecordRefused("bad signature", str(error)) from None


class SignedRecordValidator(RecordValidatorBase):
    """The one record validator of a node: signs what `identity` writes under its own peer id,
    refuses everything `check_record` refuses, and counts refusals by reason (`refused`)."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._lock = threading.Lock()  # validate runs on the node's loop; `refused` anywhere
        self._refused: Counter[str] = Counter()

    def sign_value(self, record: DHTRecord) -> bytes:
        try:
            writer = record_writer(record.subkey)
        except RecordRefused:
            return record.value  # unsigned: validate refuses it, also before storing it here
        if writer != self.identity.peer_id:
            return record.value  # not ours to sign: likewise refused
        payload = record_payload(record.key, writer, record.value, record.expiration_time)
        return record.value + self.identity.sign(payload)

    def validate(self, record: DHTRecord) -> bool:
        try:
            check_record(record)
        except RecordRefused as refused:
            with self._lock:
                self._refused[refused.reason] += 1
            log.debug("DHT record refused: %s", refused)
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-SIGNATURE_BYTES]  # only called on records that validated

    @property
    def refused(self) -> dict[str, int]:
        """Records refused so far (at storage and at read), by reason."""
        with self._lock:
            return dict(self._refused)

    @property
    def priority(self) -> int:
        # Validated first and stripped last, should another validator ever join: the signature
        # covers the value as every other validator left it.
        return 10


def decode_records(entries: Mapping[str, bytes], record_type: type[R], stage: int | None = None
                   ) -> tuple[dict[str, R], int]:
    """The bodies of `entries` ({writer: body}, as SwarmNode.lookup returns them) that decode as
    `record_type` (and, given `stage`, are of that stage), by writer; and how many were skipped.
    Anyone may write under any key: a body that does not decode, or is of another stage, is
    skipped, never raised."""
    if stage is not None and "stage" not in record_type.__struct_fields__:
        raise TypeError(f"{record_type.__name__} has no stage to filter on")
    found: dict[str, R] = {}
    for writer, body in entries.items():
        try:
            record = decode_struct(body, record_type)
        except WireError as error:
            log.debug("skipping a malformed record from %s: %s", writer[-8:], error)
            continue
        if stage is not None and getattr(record, "stage", None) != stage:
            log.debug("skipping a %s of another stage from %s", record_type.__name__,
                      writer[-8:])
            continue
        found[writer] = record
    return found, len(entries) - len(found)
