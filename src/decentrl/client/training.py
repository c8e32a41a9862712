"""The training client: a training peer of one stage, driven over RPC as the pipeline trainer's
`StageWorker` (learn/stage_trainer.py), so the same trainer runs a pipeline of local stages or of peers.
A training step cannot move to another peer halfway: a peer that fails raises SwarmUnavailable,
and the training loop recovers (coordinator/loop.py).

Only a training peer the run's owner admitted is driven (`admitted`), and every version it makes
(a step, a rollback, the version it connects at) goes to the lineage signer, which signs the hash
of the state its replicas are to hold (coordinator/lineage.py).

When the run audits its training peers (`trust.train_audit_fraction`), the worker records what it
sent its peer during a step and what came back (`StepTape`), keeps the state digests its peer
committed to, and after a step drawn for an audit hands them to `TrainAudit`, which has another
training peer of the stage replay the step (trust/audit.py says what is compared and why)."""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import msgspec
import torch

from decentrl.config import RunConfig, SwarmConfig
from decentrl.errors import DecentrlError
from decentrl.learn.batch import TrainBatch
from decentrl.learn.stage_loss import LOSS_TENSORS, LossInputs
from decentrl.learn.stage_trainer import Activations
from decentrl.net.directory import Directory, SwarmUnavailable, backoff
from decentrl.net.link import MessageLost
from decentrl.net.node import PeerRefused, RemoteError, SwarmNode
from decentrl.net.protocol import (
    CHECKPOINT,
    CHECKPOINT_SHARD,
    STATE_CHUNK_FLOATS,
    TRAIN_AUDIT_LOAD,
    TRAIN_BACKWARD,
    TRAIN_DISCARD,
    TRAIN_FORWARD,
    TRAIN_GRAD_NORM,
    TRAIN_LOGPROBS,
    TRAIN_STATE,
    TRAIN_STEP,
    Empty,
    Rpc,
)
from decentrl.net.training_messages import (
    AuditLoad,
    CheckpointReply,
    CheckpointRequest,
    LogprobsForward,
    ShardChunk,
    ShardRequest,
    StateRequest,
    TrainBackward,
    TrainForward,
    TrainStep,
)
from decentrl.net.wire import ActivationCodec, WireError
from decentrl.trust.audit import FlatState, check_step, gradient_error, output_error
from decentrl.trust.reputation import Reputation

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")
# The per-row statistics of the last stage are compared in nats where they are near zero.
ROW_STATS_FLOOR = 0.1
ROW_STATS = ("row_surprise", "row_log_ratio")
# The least log-prob the last stage answers for a target (rollout/sampling.py's floor for a
# token outside the sampler's kept set).
LOGPROB_FLOOR = -1e4


class VersionWitness(Protocol):
    """Who hears of every version a training peer makes: the coordinator's lineage signer
    (coordinator/lineage.py `LineageSigner`), which signs the hash of the state the stage's
    replicas are to hold. `restart`: the peer's chain of versions starts there."""

    def published(self, stage: int, peer: str, version: int, restart: bool = False) -> None: ...


@dataclass
class StepTape:
    """What the coordinator sent a training peer during one step, as sent, and what came back."""

    # (request, tensors with the activation codec, exact tensors, reply tensors)
    forwards: list[tuple[TrainForward, dict[str, torch.Tensor], dict[str, torch.Tensor],
                         dict[str, torch.Tensor]]] = field(default_factory=list)
    # (request, gradient tensors, reply tensors)
    backwards: list[tuple[TrainBackward, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = \
        field(default_factory=list)

    def outputs(self) -> dict[str, torch.Tensor]:
        return outputs_of([out for *_, out in self.forwards],
                          [out for *_, out in self.backwards])


def outputs_of(forwards: list[dict[str, torch.Tensor]], backwards: list[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
    """A step's replies by unique names: forward i's and backward i's tensors."""
    named = {f"forward{i}.{name}": t for i, out in enumerate(forwards) for name, t in out.items()}
    named.update({f"backward{i}.{name}": t for i, out in enumerate(backwards)
                  for name, t in out.items()})
    return named


def call_retrying(node: SwarmNode, swarm: SwarmConfig, peer: str, rpc: Rpc[Req, Rep], body: Req,
                  tensors: dict[str, torch.Tensor] | None, codec: ActivationCodec,
                  exact: dict[str, torch.Tensor] | None) -> tuple[Rep, dict[str, torch.Tensor]]:
    """One call, sent again with the same request id (the peer answers it once) while messages
    are lost, up to `swarm.retries` times; any other failure is raised at once."""
    request_id = secrets.token_hex(8)
    for attempt in range(swarm.retries + 1):
        try:
            return node.call_sync(peer, rpc, body, tensors, codec, swarm.request_timeout_s,
                                  request_id, exact)
        except MessageLost:
            time.sleep(backoff(attempt))
    raise MessageLost(f"{swarm.retries + 1} messages to {peer[-8:]} lost in a row")


def checked_logprobs(logprobs: torch.Tensor | None, batch: TrainBatch, who: str) -> torch.Tensor:
    """`logprobs` as a last stage answers a forward-only pass of `batch`: [rows, C], in
    [LOGPROB_FLOOR, 0] at every completion target and 0 past a row's end; SwarmUnavailable if
    they are not (nothing else is checked: they are the proximal policy's, which nobody
    recomputes)."""
    valid = batch.completion_valid.cpu()
    if logprobs is None or tuple(logprobs.shape) != tuple(valid.shape):
        raise SwarmUnavailable(f"{who} answered no log-probs of shape {tuple(valid.shape)}")
    logprobs = logprobs.float()
    if not (bool(((logprobs <= 0) & (logprobs >= LOGPROB_FLOOR))[valid].all())
            and bool((logprobs[~valid] == 0).all())):
        raise SwarmUnavailable(f"{who} answered log-probs outside [{LOGPROB_FLOOR:g}, 0], or "
                               "not 0 past a row's end")
    return logprobs


class RemoteStageWorker:
    """A training peer of one stage, as the pipeline trainer's StageWorker."""

    def __init__(self, node: SwarmNode, directory: Directory, stage: int, num_stages: int,
                 swarm: SwarmConfig, admitted: Callable[[str], bool], lineage: VersionWitness,
                 audit: TrainAudit | None = None, routing_part: slice = slice(0, 0)) -> None:
        """`audit`: the run's audits of its training peers, None when it audits none.
        `routing_part`: the stage's part of a batch's routing record (model/stages.py
        routing_layers), sent to replay when a batch has one; empty for a stage without sparse
        layers (nothing sent)."""
        self.node, self.directory, self.stage = node, directory, stage
        self.routing_part = routing_part
        self.last = stage == num_stages - 1
        self.swarm, self.admitted, self.lineage = swarm, admitted, lineage
        self.audit = audit
        self.peer: str | None = None
        self.since = 0  # the version the peer was connected at (the manifest's roster says it)
        self._version = 0
        self.tape = StepTape()
        self.committed: dict[int, str] = {}  # version -> the state digest the peer committed to
        # Micro-batches pushed down the chain (client/training_push.py) pass no activation
        # through here: an audit gets the step's tape from the peer's reveal, by version.
        self.revealed: Callable[[int], StepTape] | None = None

    def connect(self) -> int:
        """Find this stage's admitted training peer (from a fresh look at the DHT: after a
        failure, the cached one may be a dead process); returns its version."""
        self.directory.refresh()
        found = self.directory.training_peer(self.stage, self.admitted)
        if found is None:
            raise SwarmUnavailable(f"no admitted training peer for stage {self.stage}")
        self.peer, record = found
        self._version = self.since = record.version
        self.lineage.published(self.stage, self.peer, record.version, restart=True)
        self.tape, self.committed = StepTape(), {}
        self.commit()
        return record.version

    def commit(self) -> None:
        """Have the peer commit to its state as it is now, if this stage has an auditor (an
        audit replays a step from the state its peer committed to before it)."""
        if self.audit is None or self.peer is None or \
                not self.audit.auditors(self.stage, self.peer):
            return
        header, _ = self._call(TRAIN_STATE, StateRequest(version=self._version, offset=0,
                                                         count=0))
        self.committed = {self._version: header.digest}

    @property
    def version(self) -> int:
        return self._version

    def _call(self, rpc: Rpc[Req, Rep], body: Req,
              tensors: dict[str, torch.Tensor] | None = None, codec: ActivationCodec = "fp32",
              exact: dict[str, torch.Tensor] | None = None) -> tuple[Rep, dict[str, torch.Tensor]]:
        """One call with retries on lost messages; any other failure is the caller's to handle
        (a training step cannot move to another peer halfway). A peer that cannot be reached is
        avoided for a while, so that `connect` finds its replacement even while the dead one's
        announcement has not expired; one that refused a request is not (it may be the stage's
        only training peer, and the caller brings it back in line)."""
        if self.peer is None:
            self.connect()
        assert self.peer is not None
        try:
            return call_retrying(self.node, self.swarm, self.peer, rpc, body, tensors, codec,
                                 exact)
        except MessageLost as lost:
            raise SwarmUnavailable(f"training stage {self.stage}: {lost}") from lost
        except (RemoteError, WireError) as error:
            if not isinstance(error, (PeerRefused, WireError)):
                self.directory.ban(self.peer, str(error))
            self.peer = None
            raise SwarmUnavailable(f"training stage {self.stage}: {error}") from error

    def forward(self, micro: int, inputs: Activations, batch: TrainBatch,
                loss_inputs: LossInputs | None = None
                ) -> tuple[Activations, dict[str, float]]:
        exact = {name: tensor.cpu() for name, tensor in batch.tensors().items()}
        if batch.routing is not None and self.routing_part.stop > self.routing_part.start:
            exact["routing"] = batch.routing[:, :, self.routing_part].cpu().contiguous()
        tensors = {"prompt_in": inputs[0].cpu(), "completion_in": inputs[1].cpu()}
        body = TrainForward(micro=micro, version=self._version, last=self.last,
                            total_sequences=loss_inputs.total_sequences if loss_inputs else 0,
                            total_tokens=loss_inputs.total_tokens if loss_inputs else 0,
                            total_supervised_tokens=(loss_inputs.total_supervised_tokens
                                                     if loss_inputs else 0),
                            entropy_coef=loss_inputs.entropy_coef if loss_inputs else 0.0)
        if loss_inputs is not None:
            for name in LOSS_TENSORS:
                value = getattr(loss_inputs, name)
                if value is not None:
                    exact[name] = value.cpu()
        reply, out = self._call(TRAIN_FORWARD, body, tensors, self.swarm.activation_codec, exact)
        if self.audit is not None:
            self.tape.forwards.append((body, tensors, exact, out))
        names = ("row_surprise", "row_log_ratio") if self.last else ("prompt_out", "completion_out")
        if any(name not in out for name in names):
            raise SwarmUnavailable(f"training stage {self.stage} replied without {names}")
        if self.last:
            rows = batch.completions.shape[0]
            if any(out[name].shape != (rows,) for name in names):
                raise SwarmUnavailable(f"training stage {self.stage} replied row statistics of "
                                       f"the wrong shape (expected [{rows}])")
            return (out[names[0]].float(), out[names[1]].float()), reply.metrics
        return (out[names[0]].float(), out[names[1]].float()), {}

    def forward_only(self, micro: int, inputs: Activations, batch: TrainBatch
                     ) -> Activations | torch.Tensor:
        """The peer's forward of micro-batch `micro` without gradient (`train_logprobs`): its
        outputs, or at the last stage the log-probs [rows, C]. Not taped: an audit replays the
        steps, and this pass changes nothing a step starts from."""
        exact = {name: tensor.cpu() for name, tensor in batch.tensors().items()}
        if batch.routing is not None and self.routing_part.stop > self.routing_part.start:
            exact["routing"] = batch.routing[:, :, self.routing_part].cpu().contiguous()
        _, out = self._call(TRAIN_LOGPROBS, LogprobsForward(micro=micro, version=self._version,
                                                            last=self.last),
                            {"prompt_in": inputs[0].cpu(), "completion_in": inputs[1].cpu()},
                            self.swarm.activation_codec, exact)
        if self.last:
            return checked_logprobs(out.get("logprobs"), batch, f"training stage {self.stage}")
        if "prompt_out" not in out or "completion_out" not in out:
            raise SwarmUnavailable(f"training stage {self.stage} replied without its outputs")
        return out["prompt_out"].float(), out["completion_out"].float()

    def backward(self, micro: int, grad_outputs: Activations | None) -> Activations | None:
        tensors = {} if grad_outputs is None else {"prompt_grad": grad_outputs[0].cpu(),
                                                   "completion_grad": grad_outputs[1].cpu()}
        body = TrainBackward(micro=micro)
        _, out = self._call(TRAIN_BACKWARD, body, tensors, self.swarm.activation_codec)
        if self.audit is not None:
            self.tape.backwards.append((body, tensors, out))
        if self.stage == 0:
            return None
        if "prompt_grad" not in out or "completion_grad" not in out:
            raise SwarmUnavailable(f"training stage {self.stage} replied without gradients")
        return out["prompt_grad"].float(), out["completion_grad"].float()

    def grad_square_norm(self) -> float:
        reply, _ = self._call(TRAIN_GRAD_NORM, Empty())
        return reply.square_norm

    def step(self, grad_scale: float) -> None:
        """Step the peer; on a step drawn for an audit, audit it (SwarmUnavailable when the step
        is to be reverted)."""
        commit = self.audit is not None and self.peer is not None and \
            bool(self.audit.auditors(self.stage, self.peer))
        reply, _ = self._call(TRAIN_STEP, TrainStep(grad_scale=grad_scale,
                                                    version=self._version + 1, commit=commit))
        self._version = reply.version
        assert self.peer is not None  # it just answered
        tape, self.tape = self.tape, StepTape()
        self.committed = {v: d for v, d in self.committed.items() if v == reply.version - 1}
        if commit:
            self.committed[reply.version] = reply.state_digest
        if self.audit is not None and self.audit.drawn():
            if self.revealed is not None:
                tape = self.revealed(reply.version - 1)
            self.audit.audit(self, tape, grad_scale)
        # Signed only once it stands: replicas never take a step an audit reverted.
        self.lineage.published(self.stage, self.peer, reply.version)

    def discard(self) -> None:
        self.tape = StepTape()
        reply, _ = self._call(TRAIN_DISCARD, Empty())
        self._version = reply.version

    def checkpoint(self, action: Literal["save", "load"], version: int,
                   committed: int = -1) -> CheckpointReply:
        """Save (the reply names the shard the peer wrote; it may drop its checkpoints older
        than `committed`) or load checkpoint `version`."""
        reply, _ = self._call(CHECKPOINT, CheckpointRequest(action=action, version=version,
                                                            committed=committed))
        self._version = reply.version
        if action == "load":  # the publisher starts over from a keyframe of the checkpoint
            assert self.peer is not None  # it just answered
            self.lineage.published(self.stage, self.peer, reply.version, restart=True)
            self.committed = {}
            self.commit()
        return reply

    def shard_chunk(self, request: ShardRequest) -> tuple[ShardChunk, dict[str, torch.Tensor]]:
        """A stretch of the peer's checkpoint shard (release/shards.py fetches it whole)."""
        return self._call(CHECKPOINT_SHARD, request)


class AuditFailed(DecentrlError, RuntimeError):
    """An auditor that could not replay a step (unreachable, refused): no opinion."""


class TrainAudit:
    """The coordinator's audits of its training peers (trust/audit.py): after a step drawn at
    random (never told to anyone beforehand), another admitted training peer of the stage replays
    it from the primary's committed pre-step state; a disagreement goes to a third. A peer proved
    or outvoted is recorded as a liar (`proved`: banned at once) and no longer driven; when the
    primary lied, its step is reverted (SwarmUnavailable: the loop rolls every stage back to the
    last checkpoint). With no third peer to settle a disagreement the step is reverted and nobody
    is blamed: one of the two lied, and the coordinator cannot tell which."""

    def __init__(self, node: SwarmNode, directory: Directory, config: RunConfig,
                 admitted: Callable[[str], bool], reputation: Reputation) -> None:
        self.node, self.directory, self.config = node, directory, config
        self.admitted, self.reputation = admitted, reputation
        self.fraction = config.trust.train_audit_fraction
        self.tolerance = config.trust.train_audit_tolerance
        # Unpredictable to peers: one that knew which steps get audited would lie on the others.
        self.random = random.Random(secrets.randbits(64))
        self.count: Counter[str] = Counter()
        self.seconds = 0.0  # spent auditing, in all

    def drawn(self) -> bool:
        return self.random.random() < self.fraction

    def auditors(self, stage: int, primary: str) -> list[str]:
        """The training peers that could audit `primary`'s steps at `stage`, in random order."""
        return self._others(stage, {primary})

    def audit(self, worker: RemoteStageWorker, tape: StepTape, grad_scale: float) -> None:
        started = time.perf_counter()
        try:
            self._audit(worker, tape, grad_scale)
        finally:
            self.seconds += time.perf_counter() - started

    def _others(self, stage: int, exclude: set[str]) -> list[str]:
        peers = [peer for peer, _ in self.directory.training_peers(stage, self.admitted)
                 if peer not in exclude]
        self.random.shuffle(peers)
        return peers

    def _audit(self, worker: RemoteStageWorker, tape: StepTape, grad_scale: float) -> None:
        primary, stage, version = worker.peer, worker.stage, worker.version
        assert primary is not None
        others = self.auditors(stage, primary)
        if not others or {version - 1, version} - set(worker.committed):
            self.count["train_audit_skipped"] += 1
            return
        self.count["train_audits"] += 1
        pre = self._committed_state(primary, stage, version - 1, worker.committed)
        post = self._committed_state(primary, stage, version, worker.committed)
        broken = check_step(pre, post, self.config.train)
        if broken is not None:
            self._liar(primary, stage, f"its step to v{version} is not an AdamW step: {broken}",
                       reverted=True)
        claims = (post, tape.outputs())
        opinions: list[tuple[str, FlatState, dict[str, torch.Tensor]]] = []
        verdicts: list[str | None] = []  # each opinion's disagreement with the primary
        for auditor in others:
            try:
                state, outputs = self._replay(auditor, pre, worker.committed[version - 1], tape,
                                              grad_scale)
            except AuditFailed as error:
                log.warning("stage %d: auditor %s could not replay v%d: %s", stage, auditor[-8:],
                            version, error)
                continue
            opinions.append((auditor, state, outputs))
            verdicts.append(self._disagreement(pre, claims, (state, outputs)))
            if verdicts[0] is None:  # the first opinion agrees with the primary
                for peer in (primary, auditor):
                    self.reputation.record(peer, "passed", stage=stage)
                return
            if len(opinions) == 2:
                self._settle(primary, stage, version, pre, opinions, verdicts)
                return
        if not opinions:
            self.count["train_audit_skipped"] += 1
            return
        self.count["train_audit_unsettled"] += 1
        raise SwarmUnavailable(f"training stage {stage}: the step to v{version} is reverted: an "
                               f"auditor disagrees ({verdicts[0]}) and no third training peer can "
                               "settle it")

    def _settle(self, primary: str, stage: int, version: int, pre: FlatState,
                opinions: list[tuple[str, FlatState, dict[str, torch.Tensor]]],
                verdicts: list[str | None]) -> None:
        """Two auditors replayed the step, the first disagreeing with the primary; returns if
        the step stands."""
        (first, first_state, first_out), (third, third_state, third_out) = opinions
        self.count["train_audit_disagreements"] += 1
        if verdicts[1] is None:  # the third agrees with the primary: the first auditor lied
            self._liar(first, stage, f"its replay of stage {stage}'s step to v{version} "
                                     f"disagrees with two peers: {verdicts[0]}", reverted=False)
            for peer in (primary, third):
                self.reputation.record(peer, "passed", stage=stage)
            return
        if self._disagreement(pre, (first_state, first_out), (third_state, third_out)) is None:
            for peer in (first, third):
                self.reputation.record(peer, "passed", stage=stage)
            self._liar(primary, stage, f"two peers' replays of its step to v{version} disagree "
                                       f"with it: {verdicts[0]}", reverted=True)
        self.count["train_audit_unsettled"] += 1
        raise SwarmUnavailable(f"training stage {stage}: the step to v{version} is reverted: "
                               "three training peers disagree")

    def _liar(self, peer: str, stage: int, detail: str, reverted: bool) -> None:
        """Record `peer` as a liar (banned: it is not driven again); if it trained the step,
        revert it."""
        self.count["train_audit_liars"] += 1
        self.reputation.record(peer, "proved", detail, stage)
        self.directory.ban(peer, detail)
        if reverted:
            raise SwarmUnavailable(f"training stage {stage}: peer {peer[-8:]} lied: {detail}")

    def _disagreement(self, pre: FlatState,
                      ours: tuple[FlatState, dict[str, torch.Tensor]],
                      theirs: tuple[FlatState, dict[str, torch.Tensor]]) -> str | None:
        """Why two replays of the same step from `pre` disagree, or None."""
        error, where = gradient_error(pre, ours[0], theirs[0], self.config.train.betas[0])
        if error > self.tolerance:
            return f"gradient of {where} off by {error:.3g} (relative)"
        stats = {name for name in ours[1] if name.rsplit(".", 1)[-1] in ROW_STATS}
        for names, floor in ((stats, ROW_STATS_FLOOR), (set(ours[1]) - stats, 0.0)):
            error = output_error({n: ours[1][n] for n in names},
                                 {n: theirs[1][n] for n in names if n in theirs[1]}, floor)
            if error > self.tolerance:
                what = "row statistics (the trainer's flags)" if names is stats else "outputs"
                return f"{what} off by {error:.3g} (relative)"
        return None

    # ---- calls ---------------------------------------------------------------------------

    def _call(self, peer: str, rpc: Rpc[Req, Rep], body: Req,
              tensors: dict[str, torch.Tensor] | None = None, codec: ActivationCodec = "fp32",
              exact: dict[str, torch.Tensor] | None = None) -> tuple[Rep, dict[str, torch.Tensor]]:
        return call_retrying(self.node, self.config.swarm, peer, rpc, body, tensors, codec,
                             exact)

    def _fetch(self, peer: str, version: int, audit: bool) -> tuple[FlatState, str]:
        """A peer's flat training state at `version` and the digest it claims for it."""
        header, _ = self._call(peer, TRAIN_STATE, StateRequest(version=version, offset=0,
                                                               count=0, audit=audit))
        if header.version != version or header.total != 3 * sum(header.sizes) \
                or len(header.names) != len(header.sizes):
            raise WireError(f"peer {peer[-8:]} describes an inconsistent state")
        parts: list[torch.Tensor] = []
        offset = 0
        while offset < header.total:
            chunk, tensors = self._call(peer, TRAIN_STATE, StateRequest(
                version=version, offset=offset, count=STATE_CHUNK_FLOATS, audit=audit))
            data = tensors.get("data")
            expected = min(STATE_CHUNK_FLOATS, header.total - offset)
            if chunk != header or data is None or data.shape != (expected,):
                raise WireError(f"peer {peer[-8:]} sent a stretch of its state at {offset} that "
                                "does not fit its header")
            parts.append(data.float())
            offset += expected
        state = FlatState(version, header.step, header.names, header.sizes,
                          torch.cat(parts) if parts else torch.zeros(0))
        return state, header.digest

    def _committed_state(self, primary: str, stage: int, version: int,
                         committed: dict[int, str]) -> FlatState:
        """The primary's state at `version`, which must hash to what it committed to. A primary
        that refuses it or sends another is a liar; one that cannot be reached fails the step."""
        try:
            state, digest = self._fetch(primary, version, audit=False)
        except (PeerRefused, WireError) as error:
            self._liar(primary, stage, f"it does not show its state at v{version}: {error}",
                       reverted=True)
            raise  # _liar raised
        except (RemoteError, MessageLost) as error:
            raise SwarmUnavailable(f"training stage {stage}: {error}") from error
        if digest != committed[version] or state.digest != digest:
            self._liar(primary, stage, f"its state at v{version} is not the one it committed to",
                       reverted=True)
        return state

    def _replay(self, auditor: str, pre: FlatState, digest: str, tape: StepTape,
                grad_scale: float) -> tuple[FlatState, dict[str, torch.Tensor]]:
        """`auditor`'s replay of the taped step from `pre`: its post-step state and outputs."""
        codec = self.config.swarm.activation_codec
        try:
            total = pre.flat.numel()
            for offset in range(0, max(total, 1), STATE_CHUNK_FLOATS):
                self._call(auditor, TRAIN_AUDIT_LOAD, AuditLoad(
                    version=pre.version, step=pre.step, offset=offset, total=total, digest=digest,
                    names=pre.names, sizes=pre.sizes),
                    exact={"data": pre.flat[offset:offset + STATE_CHUNK_FLOATS]})
            forwards = [self._call(auditor, TRAIN_FORWARD,
                                   msgspec.structs.replace(body, audit=True), tensors, codec,
                                   exact)[1]
                        for body, tensors, exact, _ in tape.forwards]
            backwards = [self._call(auditor, TRAIN_BACKWARD,
                                    msgspec.structs.replace(body, audit=True), tensors, codec)[1]
                         for body, tensors, _ in tape.backwards]
            self._call(auditor, TRAIN_STEP, TrainStep(grad_scale=grad_scale,
                                                      version=pre.version + 1, audit=True))
            state, _ = self._fetch(auditor, pre.version + 1, audit=True)
        except (RemoteError, WireError, MessageLost) as error:
            raise AuditFailed(str(error)) from error
        return state, outputs_of(forwards, backwards)
