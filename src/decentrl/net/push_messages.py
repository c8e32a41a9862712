"""The messages of generation sessions whose activations travel from peer to peer (issue #36,
`swarm.data_plane = "peer_to_peer"`): the coordinator's signed route, each stage's signed
commitment to what it received and sent, and the bodies of the RPCs that push, collect, resume
and reveal (declared in net/protocol.py, served by stage/push.py).

A session's route names one peer per stage; the run's owner signs it, so a stage takes a push
only from the peer the route names before it, and only for a session the owner opened. Each
stage that computes a step signs a `StepCommit`: the digest of what it received and one digest
per row of what it sent on (its output in the form the next stage decodes, `wire_form`). The
commitments travel with the step to the last stage and from there to the coordinator, which
checks that every stage's input digest is its predecessor's outputs: two adjacent stages that
disagree have each signed their side, so the disagreement is provable. A spot-check later asks
a stage to reveal what it sent; a revealed row that does not hash to the digest its sender
signed is proof against it (trust/reveal.py)."""

from __future__ import annotations

import hashlib

import msgspec
import torch

from decentrl.net.identity import Identity, verify
from decentrl.net.wire import (
    ActivationCodec,
    Body,
    WireError,
    decode_struct,
    decode_tensor,
    encode_struct,
    encode_tensor,
)
from decentrl.rollout.sampling import SamplingConfig

ROUTE_DOMAIN = b"decentrl/route/1"
COMMIT_DOMAIN = b"decentrl/commit/1"


class SessionRoute(Body):
    """Who computes each stage of session `id` from route `epoch` on (a failover signs the next
    epoch), bound to the run and its session nonce (net/session.py)."""

    run: str
    session: str
    id: str
    epoch: int
    peers: list[str]
    batch: int
    max_length: int

    def stage_of(self, peer: str) -> int | None:
        """The first stage `peer` computes in this route (None: none)."""
        return self.peers.index(peer) if peer in self.peers else None


class Signed(Body):
    """A body and its signer's Ed25519 signature of (domain, body)."""

    body: bytes
    signer: str
    signature: bytes


def sign_route(identity: Identity, route: SessionRoute) -> bytes:
    return _sign(identity, ROUTE_DOMAIN, encode_struct(route))


def open_route(data: bytes, owner: str) -> SessionRoute:
    """The route in `data` if `owner` signed it; WireError (a strike) otherwise."""
    return _open(data, ROUTE_DOMAIN, SessionRoute, owner)


class StepCommit(Body):
    """What stage `stage` computed for positions [start, start + new) of session `id` under
    route `epoch`, at weight `version`: the digest of its inputs (the previous stage's
    `outputs`; stage 0: of the token ids the coordinator sent) and of its outputs: the
    `chain_digest` of one `row_digests` entry per row (hidden states in their wire form, or at
    the last stage the sampled token and its log-prob), so that one row can be revealed alone.
    `experts`: the digest of the experts its sparse layers chose ("" for a dense stage).
    `replayed`: the step rebuilt the stage's cache from position 0 (a failover), so its inputs
    are every position's, not only the new ones."""

    id: str
    epoch: int
    stage: int
    start: int
    new: int
    version: int
    inputs: bytes
    outputs: bytes
    experts: bytes = b""
    replayed: bool = False


def sign_commit(identity: Identity, commit: StepCommit) -> bytes:
    return _sign(identity, COMMIT_DOMAIN, encode_struct(commit))


def open_commit(data: bytes, signer: str) -> StepCommit:
    """The commitment in `data` if `signer` signed it; WireError otherwise."""
    return _open(data, COMMIT_DOMAIN, StepCommit, signer)


TRAINING_ROUTE_DOMAIN = b"decentrl/training-route/1"
TRAIN_COMMIT_DOMAIN = b"decentrl/train-commit/1"


class TrainingRoute(Body):
    """The training peer of each stage for the step from learner `version` on, bound to the run
    and its session nonce: a stage takes a pushed micro-batch only from the peer named before
    it (stage 0: the owner)."""

    run: str
    session: str
    version: int
    peers: list[str]


def sign_training_route(identity: Identity, route: TrainingRoute) -> bytes:
    return _sign(identity, TRAINING_ROUTE_DOMAIN, encode_struct(route))


def open_training_route(data: bytes, owner: str) -> TrainingRoute:
    return _open(data, TRAINING_ROUTE_DOMAIN, TrainingRoute, owner)


class TrainCommit(Body):
    """What training stage `stage` received and sent for micro-batch `micro` of the step from
    `version`: digests (`chain_digest` of `row_digests`, in their wire form) of its inputs
    (stage 0: the token ids), its outputs (none at the last stage), the gradients it received
    for them (none at the last stage) and those it sent back (none at stage 0). Adjacent stages
    sign the same digests for what passed between them; an audit reveals the tensors."""

    version: int
    micro: int
    stage: int
    inputs: bytes
    outputs: bytes
    grads_in: bytes
    grads_out: bytes


def sign_train_commit(identity: Identity, commit: TrainCommit) -> bytes:
    return _sign(identity, TRAIN_COMMIT_DOMAIN, encode_struct(commit))


def open_train_commit(data: bytes, signer: str) -> TrainCommit:
    return _open(data, TRAIN_COMMIT_DOMAIN, TrainCommit, signer)


FORWARD_COMMIT_DOMAIN = b"decentrl/forward-commit/1"


class ForwardCommit(Body):
    """What training stage `stage` received and sent for micro-batch `micro` of a forward-only
    pass at learner `version` (the proximal log-probs, `train_logprobs_chain`): the digest of
    its inputs (stage 0: the token ids) and of its outputs (their wire form; the last stage:
    the `tensor_digest` of the log-probs it answered). Signed under its own domain, so that it
    can never stand for a TrainCommit of the same version and micro-batch (an audit checks a
    step's tapes against those; nothing replays a forward-only pass). Adjacent stages sign the
    same digest for what passed between them: a chain that breaks is seen at once, and each
    stage stays bound to what it sent."""

    version: int
    micro: int
    stage: int
    inputs: bytes
    outputs: bytes


def sign_forward_commit(identity: Identity, commit: ForwardCommit) -> bytes:
    return _sign(identity, FORWARD_COMMIT_DOMAIN, encode_struct(commit))


def open_forward_commit(data: bytes, signer: str) -> ForwardCommit:
    return _open(data, FORWARD_COMMIT_DOMAIN, ForwardCommit, signer)


def pair_digest(pair: tuple[torch.Tensor, torch.Tensor] | None) -> bytes:
    """The digest of a (prompt, completion) pair of activations or gradients ("" for none)."""
    return b"" if pair is None else chain_digest(row_digests(*pair))


def _sign(identity: Identity, domain: bytes, body: bytes) -> bytes:
    return encode_struct(Signed(body, identity.peer_id, identity.sign(domain + body)))


def _open(data: bytes, domain: bytes, kind: type[Body], signer: str):  # type: ignore[no-untyped-def]
    signed = decode_struct(data, Signed)
    if signed.signer != signer:
        raise WireError(f"a {kind.__name__} signed by {signed.signer[-8:]}, not by "
                        f"{signer[-8:]}")
    try:
        verify(signer, domain + signed.body, signed.signature)
    except ValueError as error:
        raise WireError(f"{kind.__name__}: {error}") from None
    return decode_struct(signed.body, kind)


# ---- digests ------------------------------------------------------------------------------

def wire_form(tensor: torch.Tensor, codec: ActivationCodec) -> torch.Tensor:
    """`tensor` as the receiver of it in `codec` decodes it (the form a digest is taken of). A
    tensor with non-finite values is kept cast to the codec's dtype: the encoder refuses to send
    it, and the receiver to take it, so only a peer that bypasses both ever pushes one."""
    try:
        parts, spec = encode_tensor(tensor, codec)  # checks finiteness in the same pass
    except WireError:
        if not tensor.dtype.is_floating_point:
            raise
        return tensor.to(torch.bfloat16 if codec == "bf16" else torch.float32)
    return decode_tensor(parts, spec)


def row_digests(*tensors: torch.Tensor) -> list[bytes]:
    """One sha256 per row (dim 0) over every tensor's row, dtype and shape included: what a
    stage commits to for each row of a step, and what a revealed row is checked against."""
    rows = tensors[0].shape[0]
    digests = []
    for row in range(rows):
        digest = hashlib.sha256()
        for tensor in tensors:
            part = tensor[row].contiguous()
            if part.dtype == torch.bfloat16:
                part = part.view(torch.int16)
            digest.update(f"{part.dtype}{tuple(part.shape)}".encode())
            digest.update(part.numpy().tobytes())
        digests.append(digest.digest())
    return digests


def chain_digest(digests: list[bytes]) -> bytes:
    """The digest of a step's row digests: a stage's input digest is its predecessor's outputs'."""
    return hashlib.sha256(b"".join(digests)).digest()


def tensor_digest(tensor: torch.Tensor | None) -> bytes:
    """The digest of a whole tensor ("" for none): a stage's experts."""
    return b"" if tensor is None else chain_digest(row_digests(tensor))


# ---- RPC bodies ---------------------------------------------------------------------------

class PushStep(Body):
    """Positions [start, start + T) of a session, pushed to the stage the signed `route` names
    next (stage 0: by the coordinator), or the route it holds for `session`. Tensors: `inputs`
    (stage 0: token ids [B, T]; later stages: the previous stage's hidden states [B, T, hidden]
    in their wire form), `positions` and `key_valid` [B, T] of the new positions (each stage
    keeps the session's mask), and
    `routing` [B, T, sparse layers so far, top_k] of the earlier stages' experts (a mixture of
    experts). `commits`: the signed StepCommits of the earlier stages for this step. The last
    stage samples with `sampling` and `seed`. `fresh`: how many of the last columns are the
    step's new positions (0: all); a replay from position 0 rebuilds the earlier ones."""

    route: bytes
    start: int
    fresh: int = 0
    # With no `route` (b""): the session, whose route the sender pushed here before under the
    # same epoch (a route goes once per peer and epoch, not with every step).
    session: str = ""
    commits: list[bytes] = msgspec.field(default_factory=list)
    sampling: SamplingConfig | None = None
    seed: int | None = None


class PushAck(Body):
    """A push's answer, once the rest of the chain answered: `failed_stage` -1 when every later
    stage took the step, else the first stage that did not (by its predecessor's account) and
    why. `missing`: that stage does not hold the session as far as the push starts (a replica
    new to it): the sender resends the whole session from position 0."""

    failed_stage: int = -1
    detail: str = ""
    missing: bool = False


class ResultRequest(Body):
    """From the coordinator to a session's last stage: the step at `start`, when it is sampled."""

    id: str
    start: int


class StepOutcome(Body):
    """A sampled step: tensors `tokens` and `logprobs` [B] (and `experts` [B, T, every sparse
    layer, top_k] of a mixture of experts); every stage's signed commitment, in stage order."""

    version: int
    length: int
    commits: list[bytes]


class ResumeRequest(Body):
    """From the coordinator to the stage before the one a failover replaced: push everything
    kept of session `route.id` up to and including the step at `start` to the stage the new
    `route` names next, from position 0 (its cache is rebuilt)."""

    route: bytes
    start: int
    sampling: SamplingConfig | None = None
    seed: int | None = None


class RevealRequest(Body):
    """From the coordinator (a spot-check): rows [first_row, first_row + rows) of the `steps`
    ((epoch, start, new) each, as their sender committed to them) this stage sent on in session
    `id`, or with `received`, that it was pushed (the previous stage's outputs, which it checked
    against their sender's digests when they came). At most MAX_REVEALED_STEPS steps, of at
    most a session's positions together."""

    id: str
    first_row: int
    rows: int
    steps: list[tuple[int, int, int]]
    received: bool = False


class Revealed(Body):
    """Tensor `outputs` [rows, sum of new, hidden]: the steps' outputs side by side, in their wire
    form, in the order asked; `digests`: every row's digest of each step (all the session's
    rows: their `chain_digest` is the step's commitment)."""

    digests: list[list[bytes]]


# Steps one reveal may ask for (a request without tensors stays small).
MAX_REVEALED_STEPS = 1024
