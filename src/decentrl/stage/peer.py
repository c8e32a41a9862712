"""A stage peer: one process, one pipeline stage, exactly that stage's layers. It composes the
services its role needs (Petals' server and its backends, in our shape):

- inference (stage/inference.py): sessions with their KV caches; an inference replica's
  weights follow its stage's training peer (stage/replica.py);
- training (stage/training.py): forward, backward and step of its stage with its own optimizer,
  checkpoints, and the publishing of every new version to the replicas;
- both: a training peer that also serves its current weights;
- verification (stage/verification.py): re-execution for spot-checks, on a replica's served
  weights, or on a training peer's copy of what its replicas serve
  (trust.training_peer_verifies).

Every request is checked first against its RPC's callers rule (net/authority.py: training and
inference only from the run's owner, weight sync only from the owner and the stage's peers),
then against its declaration (net/protocol.py, by the node), then against the stage
(stage/inbound.py). The peer announces itself in the DHT (stage, role,
version, throughput, free sessions) with an expiry and renews the announcement, so the directory
forgets a dead peer by itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from decentrl.config import RunConfig
from decentrl.device import compute_dtype, pick_device
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.stage_trainer import StageTrainer
from decentrl.model.run_stage import load_stage, lora_serving_copy
from decentrl.model.stages import StageModule
from decentrl.net.authority import RunAuthority
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.evidence import EvidenceReply, EvidenceRequest
from decentrl.net.node import Handler, Reply, Request, SwarmNode
from decentrl.net.protocol import EVIDENCE, PeerRecord, Role, Rpc, stage_key
from decentrl.net.session import OwnerSession
from decentrl.net.sizes import RunSizes
from decentrl.net.wire import encode_struct
from decentrl.rollout.sampling import sampling_config
from decentrl.stage.inbound import InboundChecks
from decentrl.stage.inference import InferenceService
from decentrl.stage.push import PushService
from decentrl.stage.replica import ReplicaWeights, published_tensors
from decentrl.stage.training import TrainingService
from decentrl.stage.training_push import TrainingChainService
from decentrl.stage.verification import VerifyService
from decentrl.sync.delta import PublishedState

log = logging.getLogger(__name__)


class Service(Protocol):
    """What a peer serves: RPC handlers. A hostile peer (launch/adversary.py) wraps one."""

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]: ...


def serve_learner_weights(served: StageModule, learner: StageModule, version: int) -> None:
    """Copy a training peer's weights into the model it also serves (compute thread)."""
    weights = learner.state_dict()
    with torch.no_grad():
        for name, param in served.state_dict().items():
            if param.data_ptr() != weights[name].data_ptr():  # a shared frozen base: as it is
                param.copy_(weights[name])
    served.version = version


class StagePeer:
    def __init__(self, config: RunConfig, stage: int, role: Role, node: SwarmNode, owner: str,
                 checkpoint_dir: Path | None = None, name: str = "peer",
                 wrap_inference: Callable[[InferenceService], Service] | None = None,
                 wrap_verification: Callable[[VerifyService], Service] | None = None) -> None:
        """`owner`: the peer id of the run's owner (its coordinator), the only peer that may
        drive this one. `wrap_inference` and `wrap_verification` put the inference or the
        verification service behind a wrapper (a hostile peer's)."""
        if not 0 <= stage < config.num_stages:
            raise ValueError(f"stage {stage} does not exist in a {config.num_stages}-stage run")
        trains = role in ("training", "both")
        if trains and checkpoint_dir is None:
            raise ValueError("a training peer needs a checkpoint folder")
        self.config, self.index, self.role, self.node, self.name = config, stage, role, node, name
        self.authority = RunAuthority(node, config.name, owner, stage)
        # The session of the owner's manifest, which every route it signs must name.
        self.run_session = OwnerSession(node, config.name, owner, config.swarm.announce_every_s)
        node.strikes_to_block, node.block_s = config.trust.strikes_to_block, config.trust.block_s
        device = pick_device(config.host.device)
        dtype = compute_dtype(device, config.host.dtype)
        self.training: TrainingService | None = None
        self.inference: InferenceService | None = None
        self.replica: ReplicaWeights | None = None
        self.verification: VerifyService | None = None
        self.push: PushService | None = None
        self.training_chain: TrainingChainService | None = None
        checks: InboundChecks | None = None
        if trains:
            assert checkpoint_dir is not None
            # A LoRA run's frozen base is held once, in the compute dtype (autocast would cast
            # it to that anyway); only the adapters are fp32 master weights.
            master = load_stage(config, stage, device, torch.float32, frozen_dtype=dtype)
            checks = self._checks(master)
            trainer = StageTrainer(
                master, config.train, loss_config_from(config.train, config.rollout.max_new_tokens,
                                                       config.trust, config.supervised),
                sampling_config(config.rollout), dtype, config.supervised)
            self.training = TrainingService(config, trainer, node, checks, checkpoint_dir,
                                            self.announce, name)
            self.training_chain = TrainingChainService(config, self.training, node, owner,
                                                        self.run_session)
        if role in ("inference", "both"):
            # The published state (float32, on the CPU) is the exact version-0 state every peer
            # of the stage builds from the same file; the model serves a copy in the compute dtype.
            # (A LoRA run publishes its adapters only: its frozen base is loaded in the compute
            # dtype straight away; a peer that also trains serves from its learner's base.)
            model, published = self._served_model(device, dtype,
                                                  publish=self.training is None)
            checks = checks or self._checks(model)
            if self.training is not None:
                training = self.training
                serve_learner_weights(model, training.model, training.version)
                training.on_new_weights = lambda trainer: serve_learner_weights(
                    model, trainer.stage, trainer.version)
            else:
                assert published is not None
                self.replica = ReplicaWeights(config, stage, node, model, published,
                                              self.announce, name, owner)
            self.inference = InferenceService(config, model, node, checks)
            self.push = PushService(config, stage, self.inference, node, owner,
                                    self.run_session)
            if self.replica is not None:
                self.verification = VerifyService(self.inference, self.replica.served,
                                                  closes_sessions=False)
        if self.training is not None and config.trust.training_peer_verifies:
            assert checks is not None
            served = self.training.served_copy(self._served_model(device, dtype)[0])
            # A peer that serves no inference keeps the re-executions' sessions in a table of
            # its own, whose inference is never served.
            sessions = self.inference or InferenceService(config, served.model, node, checks)
            self.verification = VerifyService(sessions, served,
                                              closes_sessions=self.inference is None)
        assert checks is not None
        module = (self.inference.model if self.inference is not None
                  else self.training.model if self.training is not None else None)
        assert module is not None  # a peer serves or trains
        self.spec, self.layers = checks.spec, (module.layer_ids.start, module.layer_ids.stop)
        node.sizes = RunSizes.of(self.spec, config)  # bounds the requests it serves
        self.services: list[Service] = [s for s in (self.training, self.training_chain,
                                                    self.inference, self.push,
                                                    self.verification) if s is not None]
        if wrap_inference is not None:
            if self.inference is None:
                raise ValueError("only a peer that serves inference can wrap its inference")
            self.services = [wrap_inference(s) if s is self.inference else s
                             for s in self.services]
        if wrap_verification is not None:
            if self.verification is None:
                raise ValueError("this peer serves no verification to wrap")
            self.services = [wrap_verification(s) if s is self.verification else s
                             for s in self.services]
        self._tasks: list[asyncio.Task[Any]] = []

    def _served_model(self, device: torch.device, dtype: torch.dtype, publish: bool = False
                      ) -> tuple[StageModule, PublishedState | None]:
        """A model of this stage in the compute dtype to serve or re-execute, and (`publish`)
        the exact version-0 state a replica follows updates from. A training peer's copy takes
        its learner's weights instead, and in a LoRA run is its learner's base itself."""
        config = self.config
        if self.training is not None and config.train.lora_rank > 0:
            return lora_serving_copy(config, self.training.model, dtype), None
        base = load_stage(config, self.index, torch.device("cpu"), torch.float32,
                          frozen_dtype=dtype)
        published = PublishedState.of(0, published_tensors(base)) if publish else None
        return base.to(device, dtype), published  # (.to casts in place: published first)

    async def _evidence(self, request: Request[EvidenceRequest]) -> Reply:
        """The pushes this peer refused from a sender, as signed (net/evidence.py)."""
        body = request.body
        return Reply(EvidenceReply(self.node.guard.evidence.copies(body.sender, body.method)))

    def _checks(self, module: StageModule) -> InboundChecks:
        return InboundChecks(module.spec, self.index, module.plan.num_stages,
                             self.config.swarm.max_session_tokens, module.plan.stage_layers)

    @property
    def version(self) -> int:
        if self.training is not None:
            return self.training.version
        assert self.inference is not None
        return self.inference.model.version

    def parameter_names(self) -> list[str]:
        """Hugging Face names of every parameter this process holds (tests check the split)."""
        names: set[str] = set()
        for service in (self.inference, self.training):
            if service is not None:
                names.update(service.model.hf_names().values())
        return sorted(names)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self.node.dht_storage.join(RunNamespace.of(self.config, self.authority.owner))
        self.node.run(self.authority.refresh(), timeout=self.config.swarm.request_timeout_s)
        self.node.authorize = self.authority.check
        for service in self.services:
            for rpc, handler in service.handlers():
                self.node.serve(rpc, handler)
        self.node.serve(EVIDENCE, self._evidence)
        # Announced first: the stage's peers serve weight updates only to peers announced there.
        # The announcement says which version this peer serves, so until it has caught up the
        # directory prefers others.
        self.node.run(self.announce(), timeout=60)
        if self.replica is not None:
            # A replica that joins mid-run takes its stage's current weights before it serves.
            try:
                self.node.run(self.replica.follow(), timeout=self.config.swarm.request_timeout_s)
            except Exception as error:  # noqa: BLE001 - the follow loop retries
                log.warning("%s: no current weights yet: %s", self.name, error)

        async def start_tasks() -> None:
            self._tasks.append(asyncio.create_task(self._announce_forever()))
            if self.replica is not None:
                self._tasks.append(asyncio.create_task(self.replica.follow_forever()))
        self.node.run(start_tasks(), timeout=30)

    def stop(self) -> None:
        async def cancel() -> None:
            for task in self._tasks:
                task.cancel()
        if not self.node.closed:
            self.node.run(cancel(), timeout=10)
        for service in (self.training, self.replica):
            if service is not None:
                service.close()

    # ---- announcing ----------------------------------------------------------------------

    def record(self) -> PeerRecord:
        inference = self.inference
        return PeerRecord(
            name=self.name, stage=self.index, layers=self.layers, role=self.role,
            version=self.version,
            tokens_per_s=round(inference.tokens_per_s, 1) if inference is not None else 0.0,
            free_sessions=inference.free_sessions() if inference is not None else 0,
            training_ready=self.training is not None,
            verifies=self.training is not None and self.verification is not None,
            bytes_sent=self.node.links.uplink.bytes_sent if self.node.links is not None else 0,
            bytes_relayed=self.node.relayed_bytes_sent,
            compute=self.node.compute_thread.usage(),
            rows_per_tick=round(inference.batcher.rows_per_tick, 1) if inference is not None
            else 0.0)

    async def announce(self) -> None:
        ttl = 5 * self.config.swarm.announce_every_s
        await self.node.announce(stage_key(self.config.name, self.index),
                                 encode_struct(self.record()), ttl)

    async def _announce_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm.announce_every_s)
            try:
                # Every session held here (a training peer's re-executions', if it serves no
                # inference, are in a table of their own).
                sessions = self.verification.sessions if self.verification is not None \
                    else self.inference
                if sessions is not None:
                    sessions.drop_idle_sessions()
                if self.push is not None:
                    self.push.expire()
                await self.run_session.refresh()
                await self.announce()
                await self.authority.refresh()
            except Exception as error:  # noqa: BLE001 - the next round retries
                log.warning("%s: announce failed: %s", self.name, error)
