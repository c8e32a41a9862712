"""What peers say to each other: the DHT records they announce, the body of every RPC (those that
drive a training peer are in net/training_messages.py) and the table of RPCs. Bodies are msgspec
structs decoded strictly (unknown fields, wrong types and missing fields are errors); tensors
travel beside them (net/streams.py, net/calls.py) and are checked where they are used."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import torch

from decentrl.learn.batch import BATCH_FIELDS
from decentrl.net import push_messages as push
from decentrl.net import training_messages as training
from decentrl.net.evidence import EvidenceReply, EvidenceRequest
from decentrl.net.sizes import (
    ACK_REPLY_BYTES,
    SMALL_REQUEST_BYTES,
    SizeLimit,
    activation_pair_bytes,
    evidence_reply_bytes,
    forward_request_bytes,
    logprobs_chain_reply_bytes,
    outcome_reply_bytes,
    push_request_bytes,
    reveal_reply_bytes,
    step_reply_bytes,
    step_request_bytes,
    submission_bytes,
    tape_reply_bytes,
    train_chain_reply_bytes,
    train_chain_request_bytes,
    verify_reply_bytes,
    with_envelope,
)
from decentrl.net.wire import Body, WireError
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import RolloutGroup

Role = Literal["inference", "training", "both"]


# ---- DHT records --------------------------------------------------------------------------

def stage_key(run: str, stage: int) -> str:
    return f"decentrl/{run}/stage{stage}"


def coordinator_key(run: str) -> str:
    return f"decentrl/{run}/coordinator"



class ComputeTime(Body):
    """What a peer's compute thread did since it started (net/compute.py): seconds running each
    kind of work, and seconds alive (the rest is idle)."""

    training_s: float = 0.0
    weights_s: float = 0.0
    verification_s: float = 0.0
    generation_s: float = 0.0
    alive_s: float = 0.0


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
    bytes_relayed: int = 0  # what of it went through relays (net/reach.py)
    # A training peer that re-executes spot-checks of its stage on a copy of the weights its
    # replicas serve (an inference replica always does).
    verifies: bool = False
    compute: ComputeTime = ComputeTime()
    rows_per_tick: float = 0.0  # rows its batched inference forwards took on average


def layer_span(layers: tuple[int, int]) -> str:
    """Layers [start, stop) as people count them: (0, 15) -> "0-14"."""
    start, stop = layers
    return f"{start}-{stop - 1}"


def lineage_key(run: str, stage: int) -> str:
    return f"decentrl/{run}/lineage{stage}"


def offer_key(peer_id: str) -> str:
    """A training peer's own key for its `HostOffer` (only it may write there; any node keeps
    it, as it keeps route records: the peer waits for a run's plan before any node of the run
    would otherwise keep its records)."""
    return f"decentrl/offers/{peer_id}"


class HostOffer(Body):
    """What a training peer offers a run whose owner plans the stages from its peers
    (coordinator/planning.py), announced while it waits for the run's manifest: the memory it
    gives the model (`memory_mb`: its memory limit, or what its device has) and its measured
    speed (`speed`: a matrix product's GFLOP/s at its own device, dtype and threads). Only the
    run's admitted training peers' offers count: a stranger's plan nobody."""

    run: str
    role: Role
    memory_mb: int
    speed: float


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
    joins only a run whose manifest names its config (by hash) and the model files it reads (by
    hash)."""

    run: str
    config_json: str  # the run config every peer builds its stage from
    config_hash: str  # sha256 of config_json
    # sha256 of the base model's files by name (config.json, the shards' index, each shard):
    # a peer checks those it reads (an 8B model's stage reads a few of its shards).
    model_files: dict[str, str]
    stages: list[tuple[int, int]]  # each stage's layers [start, stop)
    roster: list[RosterEntry]  # the admitted training peers, one per stage once connected
    # Drawn at each start of the coordinator (net/session.py): every other record the owner
    # signs for the run names it, and counts only while it is this manifest's.
    session: str
    # The training peer each stage was planned for, where the owner planned the stages from its
    # peers' offers (coordinator/planning.py): that peer takes that stage. Empty otherwise.
    planned: list[str] = []


def ended_key(run: str) -> str:
    return f"decentrl/{run}/ended"


class RunEnded(Body):
    """The owner's word that its run is over (under `ended_key`, owner's subkey): its peers
    stop serving, unless told to keep serving. It ends the session it names only: a resumed run
    (a new session) is not stopped by the record of an earlier start, which lives an hour."""

    run: str
    steps: int
    session: str


class LineageRecord(Body):
    """The owner's signed record of one stage's weights (under `lineage_key`): who publishes them
    (an admitted training peer) and the hash of the state replicas must hold at each recent
    version. A replica applies an update only from `publisher` and only when the state it makes
    hashes to what this record says for that version."""

    stage: int
    publisher: str
    hashes: dict[int, str]  # version -> state hash, the newest versions only
    session: str  # the manifest's (net/session.py): versions of an earlier start are void


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
    `logprobs` [B]; from a stage with mixture-of-experts layers also `experts` [B, T, its sparse
    layers, top_k] (int8 or int16, model/moe.py routing_dtype): the experts each position went
    to. `version` is the weight version that computed them."""

    version: int
    length: int  # positions the session's cache holds now


class CloseSession(Body):
    session: str


class DialBackRequest(Body):
    """Dial me back (net/dialback.py): at the address my request came from, on these TCP ports,
    and through these relays (full multiaddrs of peers connected to you)."""

    ports: list[int]
    relays: list[str]


class DialBackReply(Body):
    direct: str  # the address a fresh connection reached the sender at ("" if none)
    relayed: list[str]  # the circuit addresses that reached it
    errors: list[str]  # why each other attempt failed


class Empty(Body):
    pass


class VerifyStep(Body):
    """Re-execute positions [start, start + T) of a verification session, teacher-forced, with
    the stage's weights rewound to `version` (a spot-check of someone else's rollout). Tensors as
    in InferenceStep; at the last stage also `targets` [B, T] (the token sampled from each
    position, -1 where none was). The last stage scores every target under `sampling`: its
    log-prob and its seeded sampling margin (the draw of decoding step k uses
    step_seed(`sampling_seed`, k); position `prompt_columns - 1 + k` of the session predicts
    completion token k). The rows are rows [`first_row`, `first_row` + B) of the session that
    sampled them (a session of several groups is checked a group at a time): the draw of a step
    is those rows of the noise drawn for `first_row` + B rows. At a stage with mixture-of-experts
    layers, `experts` [B, T, its sparse layers, top_k] (optional) are the experts the original
    replica claimed for these positions (FREE_ROUTE where it claimed none), to be scored against
    the re-execution's routers."""

    session: str
    start: int
    batch: int
    max_length: int
    version: int
    prompt_columns: int
    sampling: SamplingConfig | None = None
    sampling_seed: int | None = None
    first_row: int = 0


class VerifyReply(Body):
    """`hidden` [B, T, hidden], or at the last stage `logprobs` and `margins` [B, T] (0 where
    there was no target); with claimed `experts`, also `routing_gaps` [B, T] (model/moe.py
    `routing_gaps`, the largest over the stage's sparse layers); `version` is the version that
    computed them."""

    version: int


# ---- a training peer's published weights ---------------------------------------------------

class PublishedRequest(Body):
    version: int


class ServedFidelity(Body):
    """How far what a stage's replicas serve at a version is from its learner's weights, measured
    by the training peer when it publishes (sync/delta.py `served_fidelity`), in bf16 (what
    replicas serve): squared L2 norms of learner - served and of learner - the state it started
    from (its first or rolled-back state), and the entries whose served value differs from the
    learner's."""

    unserved_square: float
    moved_square: float
    differing: int
    entries: int

    @property
    def unserved_share(self) -> float:
        """The share of the learner's movement (in L2) the replicas do not serve yet."""
        return math.sqrt(self.unserved_square / self.moved_square) if self.moved_square > 0 \
            else 0.0

    @property
    def differing_fraction(self) -> float:
        return self.differing / self.entries if self.entries else 0.0

    def check(self) -> None:
        """ValueError naming the field if the figures cannot be true."""
        if not (math.isfinite(self.unserved_square) and self.unserved_square >= 0
                and math.isfinite(self.moved_square) and self.moved_square >= 0):
            raise ValueError(f"fidelity norms must be finite and >= 0, got "
                             f"{self.unserved_square} and {self.moved_square}")
        if not 0 <= self.differing <= self.entries:
            raise ValueError(f"fidelity: {self.differing} differing entries out of "
                             f"{self.entries}")


class PublishedHash(Body):
    """What a training peer's replicas are brought to at `version`: the hash of that state, and
    how far it is from the learner (None: not measured, a state restored whole)."""

    version: int
    state_hash: str
    fidelity: ServedFidelity | None = None


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
    # A piece of the chunk: bytes [offset, offset + count) of it (count 0: to its end). A peer
    # reached through a relay is asked in pieces that fit a relayed connection (net/circuits.py).
    offset: int = 0
    count: int = 0



# ---- the table of RPCs --------------------------------------------------------------------
#
# Every RPC is declared here once: its request and reply bodies, the tensors a request may carry
# (any other name, a missing required one or the wrong kind of dtype is refused before the
# handler runs), the tensors a reply may carry, the size limits of a request and of a reply
# (see "size limits" below), and who may call it.
# SwarmNode.serve and SwarmNode.call take these declarations, not method names, so a handler
# cannot skip the checks and a caller cannot send another body.

# Who may call (net/authority.py enforces it before a request is read): any peer; the run's
# coordinator (its owner) only; the coordinator and the peers announced in the served stage; the
# coordinator and the peers announced in the stage before it (a pushed activation).
Callers = Literal["any peer", "coordinator", "same stage", "previous stage"]
# A tensor's dtype: "float" is any floating dtype (activations travel compressed); "ids or float"
# is stage 0's token ids or a later stage's hidden states (the handler knows which it serves);
# "experts" is a mixture of experts' recorded expert indices (int8 or int16, model/moe.py
# routing_dtype: the handler knows which its model uses).
DtypeKind = Literal["int64", "bool", "float", "float32", "uint8", "ids or float", "experts"]

# A sync plan: a keyframe's manifest and the deltas after it, 32 bytes per chunk hash.
MAX_SYNC_PLAN_BYTES = 4 * 2**20
# The data of one chunk of a weight update (sync/distribute.py cuts none larger).
SYNC_CHUNK_DATA_BYTES = 2 * 2**20
# A stretch of a checkpoint shard fetched from its training peer (release/shards.py).
SHARD_CHUNK_BYTES = 2 * 2**20
# A stretch of a training state in an audit (trust/audit.py), and the parameter names beside it.
STATE_CHUNK_FLOATS = 2**21
STATE_CHUNK_BYTES = 4 * STATE_CHUNK_FLOATS + 2**20
_EXACT_DTYPES: dict[DtypeKind, torch.dtype] = {"int64": torch.long, "bool": torch.bool,
                                               "float32": torch.float32, "uint8": torch.uint8}
# A training micro-batch (learn/batch.py TrainBatch), field by field with the dtype it declares
# (a dtype with no kind here fails at import, not on the wire).
BATCH_TENSORS: dict[str, DtypeKind] = {
    name: {dtype: kind for kind, dtype in _EXACT_DTYPES.items()}[rule.dtype]
    for name, rule in BATCH_FIELDS.items()}


class TensorRule(NamedTuple):
    kind: DtypeKind
    required: bool = True

    def admits(self, dtype: torch.dtype) -> bool:
        if self.kind == "float":
            return dtype.is_floating_point
        if self.kind == "ids or float":
            return dtype == torch.long or dtype.is_floating_point
        if self.kind == "experts":
            return dtype in (torch.int8, torch.int16)
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
    max_bytes: SizeLimit = SMALL_REQUEST_BYTES  # a request's bytes on the wire
    max_reply_bytes: SizeLimit = SMALL_REQUEST_BYTES

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
    ("hidden", "tokens", "logprobs", "experts"), step_request_bytes, step_reply_bytes)
CLOSE_SESSION = Rpc("close_session", CloseSession, Empty, "coordinator")
VERIFY_STEP = Rpc(
    "verify_step", VerifyStep, VerifyReply, "coordinator",
    {**STEP_TENSORS, "targets": TensorRule("int64", required=False),
     "experts": TensorRule("experts", required=False)},
    ("hidden", "logprobs", "margins", "routing_gaps"), step_request_bytes, verify_reply_bytes)
TRAIN_FORWARD = Rpc(
    "train_forward", training.TrainForward, training.TrainForwardReply, "coordinator",
    {**{name: TensorRule(kind) for name, kind in BATCH_TENSORS.items()},
     "prompt_in": TensorRule("ids or float"), "completion_in": TensorRule("ids or float"),
     "proximal": TensorRule("float32", required=False),
     "reference": TensorRule("float32", required=False),
     "routing": TensorRule("experts", required=False),
     "selected": TensorRule("bool", required=False)},
    ("prompt_out", "completion_out", "row_surprise", "row_log_ratio"), forward_request_bytes,
    activation_pair_bytes)
TRAIN_BACKWARD = Rpc(
    "train_backward", training.TrainBackward, Empty, "coordinator",
    {"prompt_grad": TensorRule("float", required=False),
     "completion_grad": TensorRule("float", required=False)},
    ("prompt_grad", "completion_grad"), activation_pair_bytes, activation_pair_bytes)
# A forward-only pass (the proximal log-probs of a batch that takes several optimizer steps):
# the micro-batch, the stage's inputs and the routing to replay, none of the loss's inputs;
# hidden states or the last stage's log-probs back (activation_pair_bytes bounds both).
LOGPROBS_TENSORS = {name: TRAIN_FORWARD.tensors[name]
                    for name in (*BATCH_TENSORS, "prompt_in", "completion_in", "routing")}
TRAIN_LOGPROBS = Rpc(
    "train_logprobs", training.LogprobsForward, training.TrainForwardReply, "coordinator",
    LOGPROBS_TENSORS, ("prompt_out", "completion_out", "logprobs"), forward_request_bytes,
    activation_pair_bytes)
TRAIN_GRAD_NORM = Rpc("train_grad_norm", Empty, training.GradNorm, "coordinator")
TRAIN_STEP = Rpc("train_step", training.TrainStep, training.VersionReply, "coordinator")
TRAIN_DISCARD = Rpc("train_discard", Empty, training.VersionReply, "coordinator")
CHECKPOINT = Rpc("checkpoint", training.CheckpointRequest, training.CheckpointReply, "coordinator")
CHECKPOINT_SHARD = Rpc("checkpoint_shard", training.ShardRequest, training.ShardChunk,
                       "coordinator", reply_tensors=("data",),
                       max_reply_bytes=with_envelope(SHARD_CHUNK_BYTES))
TRAIN_PUBLISHED = Rpc("train_published", PublishedRequest, PublishedHash, "coordinator")
TRAIN_STATE = Rpc("train_state", training.StateRequest, training.StateChunk, "coordinator",
                  reply_tensors=("data",), max_reply_bytes=with_envelope(STATE_CHUNK_BYTES))
TRAIN_AUDIT_LOAD = Rpc("train_audit_load", training.AuditLoad, training.VersionReply, "coordinator",
                       {"data": TensorRule("float32")}, max_bytes=with_envelope(STATE_CHUNK_BYTES))
SYNC_PLAN = Rpc("sync_plan", SyncPlanRequest, SyncPlan, "same stage",
                max_reply_bytes=MAX_SYNC_PLAN_BYTES)
SYNC_CHUNK = Rpc("sync_chunk", ChunkRequest, Empty, "same stage", reply_tensors=("data",),
                 max_reply_bytes=with_envelope(SYNC_CHUNK_DATA_BYTES))
SUBMIT_ROLLOUTS = Rpc("submit_rollouts", RolloutGroup, RolloutsQueued, "any peer",
                      max_bytes=submission_bytes)
DIAL_BACK = Rpc("dial_back", DialBackRequest, DialBackReply, "any peer")

# Training micro-batches pushed down the chain, gradients back up (stage/training_push.py).
TRAIN_CHAIN = Rpc(
    "train_chain", training.TrainChain, training.TrainChainReply, "previous stage",
    TRAIN_FORWARD.tensors, ("prompt_grad", "completion_grad", "row_surprise", "row_log_ratio"),
    train_chain_request_bytes, train_chain_reply_bytes)
TRAIN_LOGPROBS_CHAIN = Rpc(
    "train_logprobs_chain", training.LogprobsChain, training.LogprobsChainReply,
    "previous stage", LOGPROBS_TENSORS, ("logprobs",), forward_request_bytes,
    logprobs_chain_reply_bytes)
TRAIN_TAPE = Rpc("train_tape", training.TapeRequest, training.TapeReply, "coordinator",
                 reply_tensors=("prompt_in", "completion_in", "prompt_out", "completion_out",
                                "row_surprise", "row_log_ratio", "prompt_grad_in",
                                "completion_grad_in", "prompt_grad", "completion_grad"),
                 max_reply_bytes=tape_reply_bytes)
# Sessions whose activations go from peer to peer (net/push_messages.py, stage/push.py).
INFERENCE_PUSH = Rpc(
    "inference_push", push.PushStep, push.PushAck, "previous stage",
    {**STEP_TENSORS, "routing": TensorRule("experts", required=False)},
    max_bytes=push_request_bytes, max_reply_bytes=ACK_REPLY_BYTES)
INFERENCE_RESULT = Rpc("inference_result", push.ResultRequest, push.StepOutcome, "coordinator",
                       reply_tensors=("tokens", "logprobs", "experts"),
                       max_reply_bytes=outcome_reply_bytes)
INFERENCE_RESUME = Rpc("inference_resume", push.ResumeRequest, push.PushAck, "coordinator",
                       max_reply_bytes=ACK_REPLY_BYTES)
REVEAL = Rpc("reveal", push.RevealRequest, push.Revealed, "coordinator",
             reply_tensors=("outputs",), max_reply_bytes=reveal_reply_bytes)
# The pushes a peer refused from one sender, as signed (net/evidence.py): proof for the owner.
EVIDENCE = Rpc("evidence", EvidenceRequest, EvidenceReply, "coordinator",
               max_reply_bytes=evidence_reply_bytes)

RPCS: dict[str, Rpc[Any, Any]] = {rpc.method: rpc for rpc in (
    INFERENCE_PUSH, INFERENCE_RESULT, INFERENCE_RESUME, REVEAL, EVIDENCE, TRAIN_CHAIN, TRAIN_TAPE,
    TRAIN_LOGPROBS_CHAIN,
    INFERENCE_STEP, CLOSE_SESSION, VERIFY_STEP, TRAIN_FORWARD, TRAIN_BACKWARD, TRAIN_GRAD_NORM,
    TRAIN_STEP, TRAIN_DISCARD, CHECKPOINT, CHECKPOINT_SHARD, TRAIN_PUBLISHED, TRAIN_STATE,
    TRAIN_AUDIT_LOAD, TRAIN_LOGPROBS,
    SYNC_PLAN, SYNC_CHUNK, SUBMIT_ROLLOUTS, DIAL_BACK)}
