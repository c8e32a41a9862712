"""What peers say to each other: the DHT records they announce and the body of every RPC. Bodies
are msgspec structs decoded strictly (unknown fields, wrong types and missing fields are errors);
tensors travel beside them (net/node.py) and are checked where they are used."""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["inference", "training", "both"]


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


# ---- DHT records --------------------------------------------------------------------------

def stage_key(run: str, stage: int) -> str:
    return f"decentrl/{run}/stage{stage}"


def coordinator_key(run: str) -> str:
    return f"decentrl/{run}/coordinator"


class PeerRecord(Body):
    """A peer's announcement under its stage's key (subkey: its peer id); it expires unless
    renewed, so a dead peer drops out of the directory by itself."""

    name: str
    stage: int
    layers: tuple[int, int]  # [start, stop)
    role: Role
    version: int
    tokens_per_s: float  # measured inference throughput (0 until it has served)
    free_sessions: int
    training_ready: bool  # a training peer whose weights are loaded and that accepts steps
    bytes_sent: int = 0  # everything this peer has uploaded so far (requests and replies)


def layer_span(layers: tuple[int, int]) -> str:
    """Layers [start, stop) as people count them: (0, 15) -> "0-14"."""
    start, stop = layers
    return f"{start}-{stop - 1}"


def weights_key(run: str, stage: int) -> str:
    return f"decentrl/{run}/weights{stage}"


class CoordinatorRecord(Body):
    config_json: str  # the run config every peer builds its stage from


class InboxRecord(Body):
    """Where rollout groups go: the coordinator's peer id."""

    peer_id: str


class WeightsRecord(Body):
    """A publisher of a stage's weights (subkey: its peer id): its newest version and the hash of
    the state replicas hold at that version."""

    stage: int
    version: int
    state_hash: str


class RolloutsQueued(Body):
    queued: bool  # False: the coordinator's inbox is full, try again later


# ---- inference ----------------------------------------------------------------------------

class Sampling(Body):
    temperature: float
    top_p: float
    top_k: int


class InferenceStep(Body):
    """Feed positions [start, start + T) of a session. Tensors: `inputs` ([B, T] token ids at
    stage 0, else [B, T, hidden]), `positions` [B, T], `key_valid` [B, start + T]. A session is
    opened by its first step (start 0); the last stage samples with `sampling` and `seed`."""

    session: str
    start: int
    batch: int
    max_length: int
    sampling: Sampling | None = None
    seed: int | None = None


class InferenceReply(Body):
    """`hidden` [B, T, hidden] of the new positions, or at the last stage `tokens` and
    `logprobs` [B]; `version` is the weight version that computed them."""

    version: int
    length: int  # positions the session's cache holds now


class CloseSession(Body):
    session: str


class Empty(Body):
    pass


class VerifyStep(Body):
    """Re-execute positions [start, start + T) of a verification session, teacher-forced, with
    the stage's weights rewound to `version` (a spot-check of someone else's rollout). Tensors as
    in InferenceStep; at the last stage also `targets` [B, T] (the token sampled from each
    position, -1 where none was). The last stage scores every target under `sampling`: its
    log-prob and its seeded sampling margin (the draw of decoding step k uses
    step_seed(`sampling_seed`, k); position `prompt_columns - 1 + k` of the session predicts
    completion token k)."""

    session: str
    start: int
    batch: int
    max_length: int
    version: int
    prompt_columns: int
    sampling: Sampling | None = None
    sampling_seed: int | None = None


class VerifyReply(Body):
    """`hidden` [B, T, hidden], or at the last stage `logprobs` and `margins` [B, T] (0 where
    there was no target); `version` is the version that computed them."""

    version: int


# ---- training -----------------------------------------------------------------------------

class TrainForward(Body):
    """One micro-batch through one training stage. Tensors: the micro-batch (TrainBatch fields),
    `prompt_in` / `completion_in` (token ids at stage 0, hidden states after), and at the last
    stage optionally `proximal` / `reference` log-probs."""

    micro: int
    version: int  # the learner version this step starts from; a peer at another version refuses
    last: bool  # compute the loss here (the coordinator's view of the chain)
    total_sequences: int
    total_tokens: int


class TrainForwardReply(Body):
    """`prompt_out` / `completion_out` tensors, or at the last stage the loss metrics."""

    metrics: dict[str, float]


class TrainBackward(Body):
    """Tensors `prompt_grad` / `completion_grad` (none at the last stage)."""

    micro: int


class GradNorm(Body):
    square_norm: float


class TrainStep(Body):
    grad_scale: float
    version: int  # the version after this step; a peer at another version refuses


class VersionReply(Body):
    version: int


class CheckpointRequest(Body):
    action: Literal["save", "load"]
    version: int


# ---- weight updates (sync/) ---------------------------------------------------------------

class UpdateManifest(Body):
    """One published update of a stage: which state it applies to and what it makes, and the
    sha256 of each chunk of its payload, so a chunk is checked before use whoever served it."""

    stage: int
    version: int
    kind: Literal["delta", "keyframe"]
    base_version: int  # the version a delta applies to (-1 for a keyframe)
    base_hash: str  # the state hash a delta applies to ("" for a keyframe)
    state_hash: str  # the published state's hash after applying it
    size: int
    chunk_size: int
    chunk_hashes: list[bytes]


class SyncPlanRequest(Body):
    """From a replica to its stage's publisher: I hold (version, hash), how do I catch up?"""

    stage: int
    version: int
    state_hash: str


class SyncPlan(Body):
    """The updates to apply in order: deltas from the asker's state, or a keyframe and the deltas
    after it."""

    version: int
    manifests: list[UpdateManifest]


class ChunkRequest(Body):
    stage: int
    kind: Literal["delta", "keyframe"]
    version: int
    index: int
    wait_s: float  # how long a replica that is still fetching this chunk may hold the request
