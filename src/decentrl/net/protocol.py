"""What peers say to each other: the DHT records they announce and the body of every RPC. Bodies
are msgspec structs decoded strictly (unknown fields, wrong types and missing fields are errors);
tensors travel beside them (net/node.py) and are checked where they are used."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import msgspec
import torch

from decentrl.net.wire import WireError
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import RolloutGroup

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


def lineage_key(run: str, stage: int) -> str:
    return f"decentrl/{run}/lineage{stage}"


class RosterEntry(Body):
    """A training peer the run's owner admitted: it trains `stage` and publishes its weights,
    since the learner version `since`."""

    stage: int
    peer_id: str
    since: int


class RunManifest(Body):
    """The run as its owner (the coordinator, whose key is the run's identity) declares it,
    under `coordinator_key(run)` with the owner's peer id as subkey: the DHT record's signature
    is the owner's, so a peer that knows the owner's id knows the manifest is genuine. A peer
    joins only a run whose manifest names its config (by hash) and its model (by hash)."""

    run: str
    config_json: str  # the run config every peer builds its stage from
    config_hash: str  # sha256 of config_json
    model_hash: str  # model/loading.py model_fingerprint of the base model
    stages: list[tuple[int, int]]  # each stage's layers [start, stop)
    roster: list[RosterEntry]  # the admitted training peers, one per stage once connected


class LineageRecord(Body):
    """The owner's signed record of one stage's weights (under `lineage_key`): who publishes them
    (an admitted training peer) and the hash of the state replicas must hold at each recent
    version. A replica applies an update only from `publisher` and only when the state it makes
    hashes to what this record says for that version."""

    stage: int
    publisher: str
    hashes: dict[int, str]  # version -> state hash, the newest versions only


class RolloutsQueued(Body):
    queued: bool  # False: the coordinator's inbox is full, try again later


# ---- inference ----------------------------------------------------------------------------

class InferenceStep(Body):
    """Feed positions [start, start + T) of a session. Tensors: `inputs` ([B, T] token ids at
    stage 0, else [B, T, hidden]), `positions` [B, T], `key_valid` [B, start + T]. A session is
    opened by its first step (start 0); the last stage samples with `sampling` and `seed`."""

    session: str
    start: int
    batch: int
    max_length: int
    sampling: SamplingConfig | None = None
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
    sampling: SamplingConfig | None = None
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


class PublishedRequest(Body):
    version: int


class PublishedHash(Body):
    """What a training peer's replicas are brought to at `version`: the hash of that state."""

    version: int
    state_hash: str


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



# ---- the table of RPCs --------------------------------------------------------------------
#
# Every RPC is declared here once: its request and reply bodies, the tensors a request may carry
# (any other name, a missing required one or the wrong kind of dtype is refused before the
# handler runs), the tensors a reply may carry, the request's size limit, and who may call it.
# SwarmNode.serve and SwarmNode.call take these declarations, not method names, so a handler
# cannot skip the checks and a caller cannot send another body.

# Who may call (net/authority.py enforces it before a request is read): any peer; the run's
# coordinator (its owner) only; the coordinator and the peers announced in the served stage.
Callers = Literal["any peer", "coordinator", "same stage"]
# A tensor's dtype: "float" is any floating dtype (activations travel compressed); "ids or float"
# is stage 0's token ids or a later stage's hidden states (the handler knows which it serves).
DtypeKind = Literal["int64", "bool", "float", "float32", "uint8", "ids or float"]

# A request without tensors is a few hundred bytes; this leaves room, and nothing more.
SMALL_REQUEST_BYTES = 64 * 2**10
# A rollout group is token ids and log-probs, a few hundred KiB even for long completions.
MAX_SUBMISSION_BYTES = 8 * 2**20
COMMITMENT_TENSORS = ("commit_rows", "commit_positions", "commit_indices", "commit_values")
# A training micro-batch (learn/batch.py TrainBatch), field by field.
BATCH_TENSORS: dict[str, DtypeKind] = {
    "prompts": "int64", "prompt_valid": "bool", "prompt_positions": "int64",
    "completions": "int64", "completion_valid": "bool", "completion_generated": "bool",
    "completion_positions": "int64", "prompt_of": "int64", "behaviour_logprobs": "float32",
    "advantages": "float32", "staleness": "int64"}
_EXACT_DTYPES = {"int64": torch.long, "bool": torch.bool, "float32": torch.float32,
                 "uint8": torch.uint8}


class TensorRule(NamedTuple):
    kind: DtypeKind
    required: bool = True

    def admits(self, dtype: torch.dtype) -> bool:
        if self.kind == "float":
            return dtype.is_floating_point
        if self.kind == "ids or float":
            return dtype == torch.long or dtype.is_floating_point
        return dtype == _EXACT_DTYPES[self.kind]


Req = TypeVar("Req")
Rep = TypeVar("Rep")


@dataclass(frozen=True)
class Rpc(Generic[Req, Rep]):
    method: str
    request: type[Req]
    reply: type[Rep]
    callers: Callers
    tensors: Mapping[str, TensorRule] = field(default_factory=dict)  # a request's
    reply_tensors: tuple[str, ...] = ()  # the names a reply may carry
    # A request's size limit; None: the node's own (TensorLimits), for activations and batches.
    max_bytes: int | None = SMALL_REQUEST_BYTES

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise WireError unless a request's tensors are the ones this RPC takes."""
        unknown = sorted(set(tensors) - set(self.tensors))
        if unknown:
            raise WireError(f"{self.method} takes no tensors {unknown}")
        missing = sorted(name for name, rule in self.tensors.items()
                         if rule.required and name not in tensors)
        if missing:
            raise WireError(f"{self.method} needs tensors {missing}")
        for name, tensor in tensors.items():
            if not self.tensors[name].admits(tensor.dtype):
                raise WireError(f"{self.method} tensor {name} must be {self.tensors[name].kind}, "
                                f"got {tensor.dtype}")

    def check_reply_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise WireError if a reply carries a tensor this RPC's replies never carry."""
        unknown = sorted(set(tensors) - set(self.reply_tensors))
        if unknown:
            raise WireError(f"a {self.method} reply carries no tensors {unknown}")


STEP_TENSORS = {"inputs": TensorRule("ids or float"), "positions": TensorRule("int64"),
                "key_valid": TensorRule("bool")}

INFERENCE_STEP = Rpc(
    "inference_step", InferenceStep, InferenceReply, "coordinator", STEP_TENSORS,
    ("hidden", *COMMITMENT_TENSORS, "tokens", "logprobs"), None)
CLOSE_SESSION = Rpc("close_session", CloseSession, Empty, "coordinator")
VERIFY_STEP = Rpc(
    "verify_step", VerifyStep, VerifyReply, "coordinator",
    {**STEP_TENSORS, "targets": TensorRule("int64", required=False)},
    ("hidden", "logprobs", "margins"), None)
TRAIN_FORWARD = Rpc(
    "train_forward", TrainForward, TrainForwardReply, "coordinator",
    {**{name: TensorRule(kind) for name, kind in BATCH_TENSORS.items()},
     "prompt_in": TensorRule("ids or float"), "completion_in": TensorRule("ids or float"),
     "proximal": TensorRule("float32", required=False),
     "reference": TensorRule("float32", required=False)},
    ("prompt_out", "completion_out", "row_surprise", "row_log_ratio"), None)
TRAIN_BACKWARD = Rpc(
    "train_backward", TrainBackward, Empty, "coordinator",
    {"prompt_grad": TensorRule("float", required=False),
     "completion_grad": TensorRule("float", required=False)},
    ("prompt_grad", "completion_grad"), None)
TRAIN_GRAD_NORM = Rpc("train_grad_norm", Empty, GradNorm, "coordinator")
TRAIN_STEP = Rpc("train_step", TrainStep, VersionReply, "coordinator")
TRAIN_DISCARD = Rpc("train_discard", Empty, VersionReply, "coordinator")
CHECKPOINT = Rpc("checkpoint", CheckpointRequest, VersionReply, "coordinator")
TRAIN_PUBLISHED = Rpc("train_published", PublishedRequest, PublishedHash, "coordinator")
SYNC_PLAN = Rpc("sync_plan", SyncPlanRequest, SyncPlan, "same stage")
SYNC_CHUNK = Rpc("sync_chunk", ChunkRequest, Empty, "same stage", reply_tensors=("data",))
SUBMIT_ROLLOUTS = Rpc("submit_rollouts", RolloutGroup, RolloutsQueued, "any peer",
                      max_bytes=MAX_SUBMISSION_BYTES)

RPCS: dict[str, Rpc[Any, Any]] = {rpc.method: rpc for rpc in (
    INFERENCE_STEP, CLOSE_SESSION, VERIFY_STEP, TRAIN_FORWARD, TRAIN_BACKWARD, TRAIN_GRAD_NORM,
    TRAIN_STEP, TRAIN_DISCARD, CHECKPOINT, TRAIN_PUBLISHED, SYNC_PLAN, SYNC_CHUNK, SUBMIT_ROLLOUTS)}
