"""The training service of a stage peer: the coordinator drives its stage through the pipeline
trainer's protocol (learn/stage_trainer.py `StageWorker`) over RPC, micro-batch by micro-batch
(forward, backward, the gradient norm, the optimizer step, or a discard when the step cannot
finish), and asks it to save or load checkpoints. Every step publishes the new version of the
stage (`WeightPublisher`, sync/distribute.py) to its replicas.

A training peer that starts where a checkpoint exists resumes from it: a replacement for a peer
that died takes over at the run's last complete checkpoint.

Audits (trust/audit.py): while the coordinator asks it to commit (`TrainStep.commit`: its stage
has an auditor), the peer keeps CPU copies of its training state at its last two versions and
commits to each by its digest in the reply that made it; the coordinator may fetch them
(`TRAIN_STATE`, which also commits to the current state when none is kept). As an auditor, the same peer loads another
peer's pre-step state into a second trainer of its stage (`TRAIN_AUDIT_LOAD`) and replays the
step on it (the training RPCs with `audit` set): its own trainer, its published and served
weights do not change."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from decentrl.config import RunConfig
from decentrl.learn.batch import TrainBatch
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.learn.stage_loss import LossInputs
from decentrl.learn.stage_trainer import Activations, StageTrainer
from decentrl.model.loading import file_sha256
from decentrl.model.stages import StageModule
from decentrl.net.compute import Priority
from decentrl.net.node import Handler, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    CHECKPOINT,
    CHECKPOINT_SHARD,
    SHARD_CHUNK_BYTES,
    STATE_CHUNK_FLOATS,
    TRAIN_AUDIT_LOAD,
    TRAIN_BACKWARD,
    TRAIN_DISCARD,
    TRAIN_FORWARD,
    TRAIN_GRAD_NORM,
    TRAIN_LOGPROBS,
    TRAIN_PUBLISHED,
    TRAIN_STATE,
    TRAIN_STEP,
    Empty,
    PublishedHash,
    PublishedRequest,
    Rpc,
)
from decentrl.net.training_messages import (
    AuditLoad,
    CheckpointReply,
    CheckpointRequest,
    GradNorm,
    LogprobsForward,
    ShardChunk,
    ShardRequest,
    StateChunk,
    StateRequest,
    TrainBackward,
    TrainForward,
    TrainForwardReply,
    TrainStep,
    VersionReply,
)
from decentrl.stage.inbound import InboundChecks, PeerBusy, PeerError
from decentrl.stage.replica import ServedWeights, published_tensors
from decentrl.sync.distribute import WeightPublisher
from decentrl.trust.audit import FlatState, flat_state, load_flat_state, state_layout

log = logging.getLogger(__name__)

T = TypeVar("T")


class TrainingService:
    def __init__(self, config: RunConfig, trainer: StageTrainer, node: SwarmNode,
                 checks: InboundChecks, checkpoint_dir: Path,
                 announce: Callable[[], Awaitable[None]], name: str) -> None:
        """`announce` tells the directory this peer's new version at once (after a step or a
        rollback)."""
        self.config, self.trainer, self.node, self.checks = config, trainer, node, checks
        self.checkpoints = CheckpointLayout(checkpoint_dir)
        self.announce, self.name = announce, name
        self.stage = checks.stage
        self.device = trainer.device
        # Called (compute thread) with the trainer after its weights changed: a peer that also
        # serves inference copies them into its served model.
        self.on_new_weights: Callable[[StageTrainer], None] = lambda trainer: None
        # Audits: this peer's training state at its last two versions with their digests, and
        # the state it audits another peer's step on (made at its first audit).
        self.states: dict[int, tuple[FlatState, str]] = {}
        self.audit_trainer: StageTrainer | None = None
        self._incoming: tuple[AuditLoad, list[torch.Tensor]] | None = None
        resumed = self._resume_from_checkpoint()
        self.publisher = WeightPublisher(
            node, config.name, self.stage, config.sync, trainer.version,
            published_tensors(trainer.stage) if resumed is None else resumed,
            config.swarm.request_timeout_s,
            # Generation starts after the warm-up: from the learner's own weights.
            exact_versions=(config.supervised.steps,) if config.supervised.steps
            else ())

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def model(self) -> StageModule:
        return self.trainer.stage

    def served_copy(self, model: StageModule) -> ServedWeights:
        """`model` (a module of this stage in the serving dtype, nobody else's) made a copy of
        what the replicas serve, the published state, and kept so: every state published from
        now on is written into it by the publisher's encoding thread, with its undo history (so
        this peer can re-execute spot-checks, stage/verification.py). Call it before the peer
        serves: nothing is being published yet."""
        served = ServedWeights(model, self.config.trust.history_versions)
        served.take(self.publisher.state, None)
        self.publisher.on_published = served.take
        return served

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return [(TRAIN_FORWARD, self._train_forward), (TRAIN_BACKWARD, self._train_backward),
                (TRAIN_GRAD_NORM, self._train_grad_norm), (TRAIN_STEP, self._train_step),
                (TRAIN_DISCARD, self._train_discard), (CHECKPOINT, self._checkpoint),
                (TRAIN_PUBLISHED, self._train_published), (TRAIN_STATE, self._train_state),
                (TRAIN_AUDIT_LOAD, self._audit_load), (CHECKPOINT_SHARD, self._checkpoint_shard),
                (TRAIN_LOGPROBS, self._train_logprobs)]

    def _at_version(self, version: int, audit: bool = False) -> None:
        trainer = self._trainer(audit)
        if version != trainer.version:
            raise PeerBusy(f"stage {self.stage}{' (audit)' if audit else ''} is at version "
                           f"{trainer.version}, the request expects {version}")

    def _trainer(self, audit: bool) -> StageTrainer:
        if not audit:
            return self.trainer
        if self.audit_trainer is None:
            raise PeerBusy(f"stage {self.stage} has no audit state loaded")
        return self.audit_trainer

    def _digest(self) -> str:
        held = self.states.get(self.trainer.version)
        return "" if held is None else held[1]

    # ---- one step, micro-batch by micro-batch ---------------------------------------------

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run training work on the compute thread, ahead of spot-checks and generation: the
        training chain is the critical path of a step."""
        return await self.node.compute(fn, *args, priority=Priority.TRAINING)

    async def _train_forward(self, request: Request[TrainForward]) -> Reply:
        return await self._compute(self._forward, request.body, request.tensors)

    def _forward(self, body: TrainForward, tensors: dict[str, torch.Tensor]) -> Reply:
        self._at_version(body.version, body.audit)
        trainer = self._trainer(body.audit)
        if body.last != self.checks.is_last:
            raise PeerError(f"the coordinator thinks stage {self.stage} is "
                            f"{'' if body.last else 'not '}the last stage")
        batch = self.checks.batch(tensors)
        inputs = self.checks.activations(tensors, batch)
        loss_inputs = None
        if body.last:
            # The loss divides by the whole batch's count of sequences: one below the
            # micro-batch's own is the sender's mistake (the loss refuses it too, as no strike).
            if body.total_sequences < batch.num_policy_sequences:
                raise PeerError(f"total_sequences must be an int >= this micro-batch's "
                                f"{batch.num_policy_sequences} sequences, got "
                                f"{body.total_sequences}")
            if body.total_supervised_tokens < batch.num_supervised_tokens:
                raise PeerError(f"total_supervised_tokens {body.total_supervised_tokens} is below "
                                f"the micro-batch's {batch.num_supervised_tokens} supervised "
                                "tokens")
            selected = tensors.get("selected")
            self._check_entropy_inputs(selected, body.entropy_coef, batch)
            loss_inputs = LossInputs(tensors.get("proximal"), tensors.get("reference"),
                                     body.total_sequences, body.total_tokens,
                                     body.total_supervised_tokens, selected, body.entropy_coef)
        out, metrics = trainer.forward(body.micro, inputs, batch, loss_inputs)
        if body.last:  # per-row statistics, in full precision: the coordinator flags from them
            return Reply(TrainForwardReply(metrics=metrics),
                         {"row_surprise": out[0].cpu(), "row_log_ratio": out[1].cpu()}, "fp32")
        return Reply(TrainForwardReply(metrics=metrics),
                     {"prompt_out": out[0].cpu(), "completion_out": out[1].cpu()},
                     self.config.swarm.activation_codec)

    def _check_entropy_inputs(self, selected: torch.Tensor | None, coef: float,
                              batch: TrainBatch) -> None:
        """PeerError unless the entropy method's inputs are the run's: the selected tokens
        [B, C] exactly when train.entropy.method has some, and a bonus weight within
        [0, train.entropy.max_coef] only when train.entropy.target is set."""
        entropy = self.config.train.entropy
        if (selected is None) != (entropy.method == "none"):
            raise PeerError(f"a micro-batch {'without' if selected is None else 'with'} the "
                            f"selected tokens of entropy method {entropy.method!r}")
        if selected is not None and tuple(selected.shape) != tuple(batch.completions.shape):
            raise PeerError(f"selected tokens of shape {tuple(selected.shape)} for completions "
                            f"of shape {tuple(batch.completions.shape)}")
        limit = entropy.max_coef if entropy.target is not None else 0.0
        if not (math.isfinite(coef) and 0.0 <= coef <= limit):
            raise PeerError(f"an entropy bonus weight of {coef}, outside [0, {limit}] "
                            "(train.entropy)")

    async def _train_logprobs(self, request: Request[LogprobsForward]) -> Reply:
        out = await self._compute(self.forward_only, request.body, request.tensors)
        if isinstance(out, torch.Tensor):  # in full precision: the loss compares them with its own
            return Reply(TrainForwardReply(metrics={}), {"logprobs": out}, "fp32")
        return Reply(TrainForwardReply(metrics={}),
                     {"prompt_out": out[0], "completion_out": out[1]},
                     self.config.swarm.activation_codec)

    def forward_only(self, body: LogprobsForward, tensors: dict[str, torch.Tensor]
                     ) -> Activations | torch.Tensor:
        """A forward-only pass of one micro-batch on the learner at `body.version` (compute
        thread), checked as a training forward is: its outputs, or at the last stage the
        log-probs, on the CPU. Nothing is kept, and no weight or optimizer state changes."""
        self._at_version(body.version)
        if body.last != self.checks.is_last:
            raise PeerError(f"the coordinator thinks stage {self.stage} is "
                            f"{'' if body.last else 'not '}the last stage")
        batch = self.checks.batch(tensors)
        out = self.trainer.forward_only(body.micro, self.checks.activations(tensors, batch),
                                        batch)
        if isinstance(out, torch.Tensor):
            return out.cpu()
        return out[0].cpu(), out[1].cpu()

    async def _train_backward(self, request: Request[TrainBackward]) -> Reply:
        return await self._compute(self._backward, request.body, request.tensors)

    def _backward(self, body: TrainBackward, tensors: dict[str, torch.Tensor]) -> Reply:
        trainer = self._trainer(body.audit)
        if body.micro not in trainer.saved:
            raise PeerBusy(f"stage {self.stage} has no forward pass for micro-batch {body.micro}")
        outputs = trainer.saved[body.micro][1]
        grads = self.checks.gradients(tensors, outputs)
        if grads is not None:
            grads = (grads[0].to(self.device, outputs[0].dtype),
                     grads[1].to(self.device, outputs[1].dtype))
        back = trainer.backward(body.micro, grads)
        result = {} if back is None or back[0] is None else \
            {"prompt_grad": back[0].cpu(), "completion_grad": back[1].cpu()}
        return Reply(Empty(), result, self.config.swarm.activation_codec)

    async def _train_grad_norm(self, request: Request[Empty]) -> Reply:
        value = await self._compute(self.trainer.grad_square_norm)
        return Reply(GradNorm(square_norm=value))

    async def _train_step(self, request: Request[TrainStep]) -> Reply:
        body = request.body
        self._at_version(body.version - 1, body.audit)
        if not 0 < body.grad_scale <= 1:
            raise PeerError(f"grad_scale must be in (0, 1], got {body.grad_scale}")
        if body.audit:
            trainer = self._trainer(audit=True)
            await self._compute(trainer.step, body.grad_scale)
            return Reply(VersionReply(version=trainer.version))
        await self._compute(self._step, body.grad_scale, body.commit)
        await self.announce()
        return Reply(VersionReply(version=self.trainer.version, state_digest=self._digest()))

    def _step(self, grad_scale: float, commit: bool) -> None:
        """Step, then publish the new version (compute thread, between steps: the publisher
        takes a copy and encodes the update on its own thread)."""
        self.trainer.step(grad_scale)
        if commit:
            self._snapshot()
        else:
            self.states = {}
        self.on_new_weights(self.trainer)
        self.publisher.publish(self.trainer.version, published_tensors(self.trainer.stage))

    def _snapshot(self) -> None:
        """Keep the training state at this version, and the one before it if kept (compute
        thread)."""
        state = flat_state(self.trainer)
        self.states = {v: held for v, held in self.states.items() if v == state.version - 1}
        self.states[state.version] = (state, state.digest)

    # ---- audits --------------------------------------------------------------------------

    async def _train_state(self, request: Request[StateRequest]) -> Reply:
        body = request.body
        if not 0 <= body.count <= STATE_CHUNK_FLOATS:
            raise PeerError(f"count must be in [0, {STATE_CHUNK_FLOATS}], got {body.count}")
        if body.audit:
            trainer = self._trainer(audit=True)
            state = await self._compute(flat_state, trainer)
            digest = state.digest
        elif body.version in self.states:
            state, digest = self.states[body.version]
        elif body.version == self.trainer.version:  # a commitment to the state as it is now
            state = await self._compute(flat_state, self.trainer)
            digest = state.digest
            self.states[state.version] = (state, digest)
        else:
            raise PeerBusy(f"stage {self.stage} keeps its training state at versions "
                           f"{sorted(self.states)}, not {body.version}")
        if state.version != body.version:
            raise PeerBusy(f"the audit state is at version {state.version}, not {body.version}")
        total = state.flat.numel()
        if not 0 <= body.offset <= total:
            raise PeerError(f"offset {body.offset} is outside the state's {total} floats")
        data = state.flat[body.offset:body.offset + body.count]
        return Reply(StateChunk(version=state.version, step=state.step, total=total,
                                digest=digest, names=state.names, sizes=state.sizes),
                     {"data": data}, "fp32")

    async def _audit_load(self, request: Request[AuditLoad]) -> Reply:
        return await self._compute(self._load_audit_chunk, request.body,
                                       request.tensors["data"])

    def _load_audit_chunk(self, body: AuditLoad, data: torch.Tensor) -> Reply:
        """Take one stretch of the state to audit from; the last one loads it (compute thread).
        A stretch out of order, or a state of another shape than this stage's, is refused: what
        is held is bounded by this stage's own state."""
        names, sizes = state_layout(self.trainer)
        if (body.names, body.sizes) != (names, sizes) or body.total != 3 * sum(sizes):
            raise PeerError(f"the audit state is not of stage {self.stage}'s parameters")
        if body.offset == 0:
            self._incoming = (body, [])
        if self._incoming is None:
            raise PeerError("an audit state must be sent from offset 0")
        first, parts = self._incoming
        received = sum(part.numel() for part in parts)
        if (body.version, body.step, body.digest) != (first.version, first.step, first.digest) \
                or body.offset != received or data.dim() != 1 \
                or received + data.numel() > body.total:
            self._incoming = None
            raise PeerError(f"audit state stretch at {body.offset} does not follow the "
                            f"{received} floats received")
        parts.append(data.clone())
        if received + data.numel() < body.total:
            return Reply(VersionReply(version=body.version))
        self._incoming = None
        state = FlatState(body.version, body.step, body.names, body.sizes, torch.cat(parts))
        if state.digest != body.digest:
            raise PeerError("the audit state does not hash to its digest")
        if self.audit_trainer is None:
            self.audit_trainer = copy.deepcopy(self.trainer)
        self.audit_trainer.discard()
        load_flat_state(self.audit_trainer, state)
        return Reply(VersionReply(version=state.version, state_digest=state.digest))

    async def _train_discard(self, request: Request[Empty]) -> Reply:
        await self._compute(self.trainer.discard)
        return Reply(VersionReply(version=self.trainer.version))

    async def _train_published(self, request: Request[PublishedRequest]) -> Reply:
        """The hash of what the replicas are brought to at a version, once it is encoded: the
        coordinator signs it into the stage's lineage (coordinator/lineage.py), with how far it is
        from the learner's weights (its step metrics)."""
        version = request.body.version
        published = await asyncio.wrap_future(self.publisher.published(version))
        if published is None:
            raise PeerBusy(f"stage {self.stage} keeps no published state at version {version} "
                           f"(it publishes version {self.trainer.version})")
        state_hash, fidelity = published
        return Reply(PublishedHash(version=version, state_hash=state_hash, fidelity=fidelity))

    # ---- checkpoints ---------------------------------------------------------------------

    async def _checkpoint(self, request: Request[CheckpointRequest]) -> Reply:
        body = request.body
        if body.action == "save":
            self._at_version(body.version)
            digest, size = await self._compute(self._save, body.version, body.committed)
            return Reply(CheckpointReply(version=self.trainer.version, shard_sha256=digest,
                                         shard_bytes=size))
        published = await self._compute(self._load, body.version)
        await self._compute(self.publisher.reset, body.version, published)
        await self.announce()
        return Reply(CheckpointReply(version=self.trainer.version))

    async def _checkpoint_shard(self, request: Request[ShardRequest]) -> Reply:
        """A stretch of this stage's checkpoint shard, its weights file, at a version it saved
        (the coordinator fetches it for the release when the run folder is on another host,
        release/shards.py). The optimizer state is never served: the release does not need it."""
        body = request.body
        if not 0 < body.count <= SHARD_CHUNK_BYTES or body.offset < 0:
            raise PeerError(f"checkpoint_shard takes 1 to {SHARD_CHUNK_BYTES} bytes from an "
                             f"offset >= 0, not {body.count} from {body.offset}")
        path = self.checkpoints.stage_file(body.version, self.stage)
        if not path.is_file():
            raise PeerBusy(f"stage {self.stage} keeps no checkpoint at version {body.version}")

        def read() -> tuple[int, bytes]:
            with path.open("rb") as shard:
                shard.seek(body.offset)
                return path.stat().st_size, shard.read(body.count)
        total, data = await asyncio.get_running_loop().run_in_executor(None, read)
        return Reply(ShardChunk(version=body.version, total=total),
                     {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)})

    def _save(self, version: int, committed: int) -> tuple[str, int]:
        """Write this stage's files of checkpoint `version`; the sha256 and size of its shard,
        the weights file (hashed here, on the compute thread: a shard is a gigabyte, and the
        event loop keeps serving). The optimizer state beside it stays on this disk: only this
        stage's training resumes from it."""
        state = self.trainer.state()
        # What the replicas serve at this version goes along: it generated the rollouts and the
        # swarm's evaluations, and `decentrl export` releases it by default.
        served = self.publisher.served().result(timeout=self.config.swarm.request_timeout_s)
        if served.version == version:
            state["served"] = served.tensors
        path = self.checkpoints.write_stage(version, self.stage, state)
        self.checkpoints.prune_stage(self.stage, older_than=min(committed, version))
        return file_sha256(path), path.stat().st_size

    def _load(self, version: int) -> dict[str, torch.Tensor]:
        """Load the checkpoint of `version`; returns what to publish at it. That is what the
        replicas served at `version` where the checkpoint holds it: with sparse updates the
        learner's weights are not what they served, and publishing those under the same version
        number would put two different weights behind one version (a spot-check at that version
        would then fail every honest replica that generated on the first)."""
        try:
            state = self.checkpoints.read_stage(version, self.stage, self.device)
        except (FileNotFoundError, ValueError) as error:  # this disk's fault, not the caller's
            raise PeerBusy(str(error)) from None
        self.trainer.load_state(state)
        self.states = {}
        self.on_new_weights(self.trainer)
        learner = published_tensors(self.trainer.stage)
        served: dict[str, torch.Tensor] = state.get("served", {})
        if served.keys() != learner.keys():  # saved while the publisher was at another version
            log.warning("%s: checkpoint v%d of stage %d lacks the served weights; publishing the "
                        "learner's", self.name, version, self.stage)
            return learner
        return served

    def _resume_from_checkpoint(self) -> dict[str, torch.Tensor] | None:
        """A replacement training peer starts from the newest complete checkpoint of its stage;
        returns what to publish (None: no checkpoint, the learner's weights as they are)."""
        version = self.checkpoints.latest_version()
        if version is None:
            return None
        published = self._load(version)
        log.info("%s: stage %d resumed from checkpoint v%d", self.name, self.stage, version)
        return published

    def close(self) -> None:
        self.publisher.close()
