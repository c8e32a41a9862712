"""The `sync` section: how a stage's new weights reach its inference replicas (sync/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.config.base import Section


class SyncConfig(Section):
    """How a stage's new weights reach its inference replicas (sync/)."""

    mode: Literal["sparse", "dense"] = Field("sparse", description="sparse: top-k int8 deltas "
                                             "with error feedback; dense: a keyframe every version")
    density: float = Field(0.01, gt=0, le=1, description="fraction of each tensor's entries an "
                           "update carries")
    selection: Literal["magnitude", "served_changes"] = Field(
        "served_changes", description="which entries a sparse update carries: magnitude, those "
        "that moved most; served_changes, only those whose served bf16 value differs from the "
        "learner's, those that moved most first (bench update-bytes)")
    values: Literal["int8_delta", "bf16_value"] = Field(
        "int8_delta", description="how a sparse update's entries are sent: int8_delta, the "
        "difference quantized to int8 in blocks of 256; bf16_value, the learner's bf16 value "
        "itself (2 bytes), which replicas then serve exactly")
    keyframe_every: int = Field(50, ge=1, description="versions between dense keyframes (late "
                                "joiners and recovery start from the latest)")
    chunks_per_update: int = Field(32, ge=1, description="an update is cut into about this many "
                                   "hashed chunks that replicas fetch from each other")
    peer_exchange: bool = Field(True, description="replicas fetch chunks from each other; off: "
                                "every replica downloads every update from the publisher")
    parallel_fetches: int = Field(8, ge=1, description="chunk requests a replica keeps in flight")
    chunk_wait_s: float = Field(2.0, ge=0, description="how long a replica holds a request for "
                                "a chunk it is still fetching itself")
