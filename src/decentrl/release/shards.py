"""Checkpoint shards across hosts. Each training peer writes its stage's checkpoint to its own
disk (`--checkpoint-dir`) as two files (learn/checkpoints.py): the shard, the stage's weights,
which is all a release needs, and the optimizer state, which only resuming that stage's training
needs and which never leaves the peer's disk. At every checkpoint the coordinator writes, into
its own run folder, the shards' manifest: each stage's shard sha256, size and the training peer
that holds it, signed with the run owner's key (`checkpoints/v<N>/shards.json`); a size beyond
what the stage's weights can take (`shard_bytes_limit`) is refused. For the release it fetches
every shard that the run folder lacks, or holds a different copy of, from the stage's training
peer over the swarm, in chunks (`checkpoint_shard`), and keeps it only if it hashes to what the
manifest says; `decentrl export` then reads the run folder alone, and refuses a shard the
manifest disowns. On one machine the peers write into the run folder itself: nothing moves."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec
import torch

from decentrl.errors import DecentrlError
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.model.loading import file_sha256
from decentrl.net.identity import Identity, SignatureError, verify
from decentrl.net.protocol import SHARD_CHUNK_BYTES
from decentrl.net.text import peer_text
from decentrl.net.training_messages import ShardChunk, ShardRequest

MANIFEST_FILE = "shards.json"
SHA256_HEX_CHARS = 64
HEX_DIGITS = frozenset("0123456789abcdef")
SIGNATURE_DOMAIN = b"decentrl/shards/1"
# A shard holds a stage's weights twice (the learner's, and what its replicas served), each value
# at most float32 (the learner's master dtype, and the published state's).
SHARD_COPIES = 2
FLOAT32_BYTES = 4
# torch.save's framing of one tensor (zip entry, name, alignment, pickle record: a few hundred
# bytes) and of the file, counted generously; and half again on top, so an honest shard is never
# refused, while a lying peer still cannot make the coordinator fetch more than that.
TENSOR_FRAMING_BYTES = 4096
FILE_FRAMING_BYTES = 2**20
SHARD_MARGIN = 1.5


class ShardRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    stage: int
    peer: str  # the training peer that wrote it
    sha256: str
    bytes: int


class ShardManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    shards: list[ShardRecord]


class ShardError(DecentrlError, RuntimeError):
    """A shard that is missing, or is not the one the run owner signed."""


def shard_bytes_limit(tensors: Mapping[str, torch.Tensor]) -> int:
    """The most bytes a stage's shard may take, given the stage's state dict (`tensors`: shapes
    and dtypes, model/run_stage.py `stage_shapes`)."""
    values = sum(t.numel() * max(t.element_size(), FLOAT32_BYTES) for t in tensors.values())
    framing = TENSOR_FRAMING_BYTES * len(tensors) + FILE_FRAMING_BYTES
    return int(SHARD_MARGIN * (SHARD_COPIES * values + framing))


def reported_shard(stage: int, peer: str, sha256: str, size: int, limit: int) -> ShardRecord:
    """The record of the shard a training peer says it saved (its CHECKPOINT reply); ShardError
    if the reply cannot describe a shard of the stage: a size outside 1..`limit` (a lying peer
    would have the coordinator fetch it whole), or no sha256."""
    if not 0 < size <= limit:
        raise ShardError(f"training peer {peer[-8:]} reports a {size}-byte checkpoint shard for "
                         f"stage {stage}, whose weights take 1 to {limit} bytes: refused")
    if len(sha256) != SHA256_HEX_CHARS or not all(c in HEX_DIGITS for c in sha256):
        raise ShardError(f"training peer {peer[-8:]} reports {peer_text(sha256, 80)!r} as the "
                         f"sha256 of stage {stage}'s checkpoint shard: not {SHA256_HEX_CHARS} "
                         "lowercase hex digits")
    return ShardRecord(stage=stage, peer=peer, sha256=sha256, bytes=size)


def manifest_path(layout: CheckpointLayout, version: int) -> Path:
    return layout.folder(version) / MANIFEST_FILE


def write_manifest(layout: CheckpointLayout, manifest: ShardManifest, owner: Identity) -> None:
    body = msgspec.json.encode(manifest)
    signed = {"manifest": json.loads(body),
              "signature": owner.sign(SIGNATURE_DOMAIN + body).hex()}
    path = manifest_path(layout, manifest.version)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(signed, indent=1))
    os.replace(staging, path)


def read_manifest(layout: CheckpointLayout, version: int, owner: str) -> ShardManifest | None:
    """The owner-signed manifest of checkpoint `version`; None where there is none (a local
    run's). Raises ShardError if it is malformed or not signed by `owner`."""
    path = manifest_path(layout, version)
    if not path.is_file():
        return None
    try:
        signed = json.loads(path.read_text())
        body = msgspec.json.encode(signed["manifest"])
        verify(owner, SIGNATURE_DOMAIN + body, bytes.fromhex(signed["signature"]))
        manifest = msgspec.json.decode(body, type=ShardManifest)
    except (ValueError, KeyError, TypeError, SignatureError, msgspec.DecodeError) as error:
        raise ShardError(f"{path} is not a shard manifest the run's owner signed: "
                         f"{error}") from None
    if manifest.version != version:
        raise ShardError(f"{path} describes version {manifest.version}, not {version}")
    return manifest


def check_shard(path: Path, record: ShardRecord) -> str:
    """`path`'s sha256; ShardError unless it is the shard `record` describes."""
    if not path.is_file():
        raise ShardError(f"{path} is missing (stage {record.stage}'s shard is held by training "
                         f"peer {record.peer[-8:]}: the coordinator fetches it for the release)")
    digest = file_sha256(path)
    if digest != record.sha256:
        raise ShardError(f"{path} is not the shard the run's owner signed for stage "
                         f"{record.stage} (sha256 {record.sha256[:12]}...)")
    return digest


Fetch = Callable[[ShardRequest], tuple[ShardChunk, dict[str, torch.Tensor]]]


def fetch_shard(fetch: Fetch, version: int, record: ShardRecord, destination: Path,
                chunk_bytes: int = SHARD_CHUNK_BYTES) -> None:
    """Download `record`'s shard through `fetch` (one `checkpoint_shard` call to its peer, for
    at most `chunk_bytes`: less where the peer is reached through a relay) into `destination`,
    kept only if it hashes to `record.sha256`."""
    if not 0 < chunk_bytes <= SHARD_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {SHARD_CHUNK_BYTES}], got {chunk_bytes}")
    staging = destination.with_suffix(".part")
    digest = hashlib.sha256()
    offset = 0
    destination.parent.mkdir(parents=True, exist_ok=True)
    try:
        with staging.open("wb") as out:
            while offset < record.bytes:
                count = min(chunk_bytes, record.bytes - offset)
                reply, tensors = fetch(ShardRequest(version=version, offset=offset, count=count))
                data = tensors.get("data")
                if reply.total != record.bytes or data is None or data.dtype != torch.uint8 \
                        or data.numel() != count:
                    raise ShardError(f"stage {record.stage}'s peer sent {reply.total} bytes in "
                                     f"all, {None if data is None else data.numel()} now; the "
                                     f"manifest says {record.bytes}, {count} asked")
                chunk = data.numpy().tobytes()
                digest.update(chunk)
                out.write(chunk)
                offset += count
        if digest.hexdigest() != record.sha256:
            raise ShardError(f"stage {record.stage}'s shard from {record.peer[-8:]} does not "
                             "hash to what the run's owner signed; not kept")
        os.replace(staging, destination)
    finally:
        staging.unlink(missing_ok=True)


def missing_shards(layout: CheckpointLayout, manifest: ShardManifest) -> list[ShardRecord]:
    """The shards of `manifest` that the run folder lacks or holds another copy of."""
    missing = []
    for record in manifest.shards:
        try:
            check_shard(layout.stage_file(manifest.version, record.stage), record)
        except ShardError:
            missing.append(record)
    return missing
