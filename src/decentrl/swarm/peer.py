"""A stage peer: one process, one pipeline stage, exactly that stage's layers. It serves inference
(Petals-style sessions: the client sends the hidden states of new positions, the peer keeps the
KV cache and returns the next hidden states, or samples at the last stage), training (forward and
backward of its stage with its own optimizer), or both, and it serves its weights to replicas of
the same stage, as compressed updates (sync/).

It announces itself in the DHT (stage, role, version, throughput, free sessions) with an expiry
and renews the announcement, so the directory forgets a dead peer by itself. A training peer
publishes every version of its stage (`WeightPublisher`); an inference replica follows it
(`WeightFollower`): it fetches each update (from the other replicas as much as from the
publisher), checks it, and writes it into its model between two inference requests (the compute
thread runs one at a time), so generations in flight go on. A replica that joins mid-run catches
up before serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decentrl.config import RunConfig
from decentrl.device import compute_dtype, pick_device
from decentrl.learn.batch import TrainBatch
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.learn.trainer import LossInputs, StageTrainer, loss_config_from
from decentrl.model.lora import has_lora, lora_tensors
from decentrl.model.run_stage import load_stage
from decentrl.model.stages import StageCache, StageModule
from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.protocol import (
    CheckpointRequest,
    CloseSession,
    Empty,
    GradNorm,
    InferenceReply,
    InferenceStep,
    PeerRecord,
    Role,
    TrainBackward,
    TrainForward,
    TrainForwardReply,
    TrainStep,
    VerifyReply,
    VerifyStep,
    VersionReply,
    stage_key,
)
from decentrl.net.wire import decode_struct, encode_struct
from decentrl.rollout.chain import last_position, step_generator
from decentrl.rollout.generate import step_seed
from decentrl.rollout.sampling import (
    SamplingConfig,
    sample,
    sampling_margin,
    sampling_noise,
    transformed_logits,
)
from decentrl.swarm.worker import sampling_config
from decentrl.sync.delta import PublishedState, TensorChange
from decentrl.sync.distribute import WeightFollower, WeightPublisher
from decentrl.sync.history import UpdateHistory, VersionUnavailable
from decentrl.trust.commit import commitment_to_wire, make_commitment

log = logging.getLogger(__name__)

# Sessions idle this long are dropped (their client is gone); a live client steps far more often.
SESSION_IDLE_S = 300.0
# Re-execution scores are bounded so that they can travel (messages carry finite floats only).
SCORE_BOUND = 1e4
BATCH_FIELDS = ("prompts", "prompt_valid", "prompt_positions", "completions", "completion_valid",
                "completion_generated", "completion_positions", "prompt_of",
                "behaviour_logprobs", "advantages", "staleness")


class PeerError(ValueError):
    """A malformed request this peer refuses; the message says why. The peer keeps serving, and
    counts a strike against the sender (net/node.py)."""


class PeerBusy(RuntimeError):
    """A well-formed request this peer cannot serve in its present state (a session it no longer
    holds, no room, another version): no fault of the sender's, so no strike."""


def published_tensors(stage: StageModule) -> dict[str, torch.Tensor]:
    """What a stage's replicas receive: the adapters in LoRA mode (the rest never changes),
    else every tensor."""
    return lora_tensors(stage) if has_lora(stage) else stage.state_dict()


@dataclass
class Session:
    cache: StageCache
    batch: int
    max_length: int
    last_used: float


class StagePeer:
    def __init__(self, config: RunConfig, stage: int, role: Role, node: SwarmNode,
                 checkpoint_dir: Path | None = None, name: str = "peer") -> None:
        if not 0 <= stage < config.num_stages:
            raise ValueError(f"stage {stage} does not exist in a {config.num_stages}-stage run")
        if role in ("training", "both") and checkpoint_dir is None:
            raise ValueError("a training peer needs a checkpoint folder")
        self.config, self.index, self.role, self.node, self.name = config, stage, role, node, name
        node.strikes_to_block, node.block_s = config.trust.strikes_to_block, config.trust.block_s
        self.checkpoint_dir = checkpoint_dir
        self.device = pick_device(config.device)
        self.dtype = compute_dtype(self.device, config.dtype)
        self.serves_inference = role in ("inference", "both")
        self.trains = role in ("training", "both")
        self.trainer: StageTrainer | None = None
        self.model: StageModule | None = None
        ttl_s = 5 * config.swarm.announce_every_s
        self.publisher: WeightPublisher | None = None
        self.follower: WeightFollower | None = None
        if self.trains:
            master = load_stage(config, stage, self.device, torch.float32)
            self.trainer = StageTrainer(
                master, config.train, loss_config_from(config.train, config.rollout.max_new_tokens,
                                                   config.trust),
                sampling_config(config.rollout), self.dtype)
            self._resume_from_checkpoint()
            self.publisher = WeightPublisher(
                node, config.name, stage, config.sync, self.trainer.version,
                published_tensors(master), ttl_s, config.swarm.request_timeout_s)
        if self.serves_inference:
            # The published state (float32, on the CPU) is the exact version-0 state every peer
            # of the stage builds from the same file; the model serves a copy in the compute dtype.
            model = load_stage(config, stage, torch.device("cpu"), torch.float32)
            if self.trainer is None:
                self.follower = WeightFollower(
                    node, config.name, stage, config.sync,
                    PublishedState.of(0, published_tensors(model)), self._commit_update,
                    config.swarm.request_timeout_s, config.swarm.ban_s)
            self.model = model.to(self.device, self.dtype)
            if self.trainer is not None:
                self._copy_from_trainer()
        # A replica keeps its last updates' undo information, so it can re-execute a rollout at
        # the versions it recorded (spot-checks); a peer that trains has no replica weights.
        self.history = UpdateHistory(config.trust.history_versions) \
            if self.follower is not None else None
        module = self.model
        if module is None:
            assert self.trainer is not None  # a peer either serves or trains
            module = self.trainer.stage
        self.spec, self.plan = module.spec, module.plan
        self.layers = (module.layer_ids.start, module.layer_ids.stop)
        self.sessions: dict[str, Session] = {}
        self.served_tokens = 0
        self.busy_s = 0.0  # computing inference requests
        self.verify_busy_s = 0.0  # re-executing others' work (spot-checks)
        self.weights_follow_error: str | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def version(self) -> int:
        if self.trainer is not None:
            return self.trainer.version
        assert self.model is not None
        return self.model.version

    def parameter_names(self) -> list[str]:
        """Hugging Face names of every parameter this process holds (tests check the split)."""
        names: set[str] = set()
        for module in (self.model, self.trainer.stage if self.trainer else None):
            if module is not None:
                names.update(module.hf_names().values())
        return sorted(names)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        handlers: dict[str, Any] = {}
        if self.serves_inference:
            handlers |= {"inference_step": self._inference_step,
                         "close_session": self._close_session}
        if self.history is not None:
            handlers["verify_step"] = self._verify_step
        if self.trains:
            handlers |= {"train_forward": self._train_forward,
                         "train_backward": self._train_backward,
                         "train_grad_norm": self._train_grad_norm,
                         "train_step": self._train_step,
                         "train_discard": self._train_discard,
                         "checkpoint": self._checkpoint}
        for method, handler in handlers.items():
            self.node.serve(method, handler)

        async def start_tasks() -> None:
            self._tasks.append(asyncio.create_task(self._announce_loop()))
            if self.follower is not None:
                self._tasks.append(asyncio.create_task(self._follow_weights_loop()))
        if self.publisher is not None:
            self.publisher.announce()
        elif self.follower is not None:
            # A replica that joins mid-run takes its stage's current weights before it serves.
            try:
                self.node.run(self.follow_weights(), timeout=self.config.swarm.request_timeout_s)
            except Exception as error:  # noqa: BLE001 - the follow loop retries
                log.warning("%s: no current weights yet: %s", self.name, error)
        self.node.run(start_tasks(), timeout=30)
        self.node.run(self.announce(), timeout=60)

    def stop(self) -> None:
        async def cancel() -> None:
            for task in self._tasks:
                task.cancel()
        if not self.node._closed:
            self.node.run(cancel(), timeout=10)
        for server in (self.publisher, self.follower):
            if server is not None:
                server.close()

    # ---- announcing ----------------------------------------------------------------------

    def record(self) -> PeerRecord:
        tokens_per_s = self.served_tokens / self.busy_s if self.busy_s > 0 else 0.0
        return PeerRecord(
            name=self.name, stage=self.index, layers=self.layers, role=self.role,
            version=self.version, tokens_per_s=round(tokens_per_s, 1),
            free_sessions=max(0, self.config.swarm.max_sessions_per_peer - len(self.sessions))
            if self.serves_inference else 0,
            training_ready=self.trains,
            bytes_sent=self.node.links.uplink.bytes_sent if self.node.links is not None else 0)

    async def announce(self) -> None:
        ttl = 5 * self.config.swarm.announce_every_s
        await self.node.announce(stage_key(self.config.name, self.index), self.node.peer_id,
                                 encode_struct(self.record()), ttl)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm.announce_every_s)
            try:
                self._drop_idle_sessions()
                await self.announce()
                if self.publisher is not None:
                    await asyncio.get_running_loop().run_in_executor(None,
                                                                     self.publisher.announce)
            except Exception as error:  # noqa: BLE001 - the next round retries
                log.warning("%s: announce failed: %s", self.name, error)

    def _drop_idle_sessions(self) -> None:
        cutoff = time.monotonic() - SESSION_IDLE_S
        # A snapshot: the compute thread may open a session while this (the loop thread) looks.
        for key, session in list(self.sessions.items()):
            if session.last_used < cutoff:
                self.sessions.pop(key, None)

    # ---- following the training peer's weights ------------------------------------------

    async def _follow_weights_loop(self) -> None:
        assert self.follower is not None
        while True:
            # A peer asking for a chunk of a newer update (even during this round) wakes the
            # loop before the next round.
            self.follower.wake.clear()
            try:
                await self.follow_weights()
                self.weights_follow_error = None
            except Exception as error:  # noqa: BLE001 - retried next round
                self.weights_follow_error = str(error)
                log.warning("%s: weight update failed: %s", self.name, error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.follower.wake.wait(),
                                       self.config.swarm.announce_every_s / 2)

    async def follow_weights(self) -> bool:
        """Catch up with the stage's publisher (a rolled-back training peer publishes an older
        version, and replicas follow it); True if the served weights changed."""
        assert self.follower is not None
        if not await self.follower.sync_once():
            return False
        await self.announce()  # the directory learns the new version now, not next round
        log.info("%s: stage %d weights v%d", self.name, self.index, self.version)
        return True

    def _commit_update(self, version: int, changes: dict[str, TensorChange]) -> None:
        """Write a checked update into the served model (compute thread, between requests)."""
        assert self.model is not None
        params = self.model.state_dict()
        with torch.no_grad():
            for name, change in changes.items():
                change.write(params[name], change.values)
        self.model.version = version
        assert self.history is not None
        self.history.record(version, changes)

    def _load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.model is not None
        own = self.model.state_dict()
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(tensors[name])
        self.model.version = version

    def _copy_from_trainer(self) -> None:
        assert self.trainer is not None and self.model is not None
        self._load_weights(self.trainer.version, self.trainer.stage.state_dict())

    def _publish(self) -> None:
        """Publish the trainer's new version (compute thread, between steps: it takes a copy and
        encodes the update on its own thread)."""
        assert self.trainer is not None and self.publisher is not None
        self.publisher.publish(self.trainer.version, published_tensors(self.trainer.stage))

    # ---- inference -----------------------------------------------------------------------

    async def _inference_step(self, request: Request) -> Reply:
        body = decode_struct(request.body, InferenceStep)
        return await self.node.compute(self._infer, body, request.tensors)

    def _infer(self, body: InferenceStep, tensors: dict[str, torch.Tensor]) -> Reply:
        assert self.model is not None
        started = time.perf_counter()
        inputs, positions, key_valid = self._check_inference(body, tensors)
        session = self._session(body)
        device_inputs = inputs.to(self.device, self.dtype if inputs.is_floating_point() else None)
        with torch.inference_mode():
            hidden = self.model.body(device_inputs, positions.to(self.device),
                                     key_valid.to(self.device), session.cache)
            if self.model.is_last:
                assert body.sampling is not None
                sampling = SamplingConfig(body.sampling.temperature, body.sampling.top_p,
                                          body.sampling.top_k)
                out = self.model.head(hidden[last_position(inputs)])
                tokens, logprobs = sample(out, sampling, step_generator(body.seed))
                result = {"tokens": tokens.cpu(), "logprobs": logprobs.float().cpu()}
            else:
                result = {"hidden": hidden.cpu(), **self._commitment(hidden, positions, key_valid,
                                                                     body.start)}
        self.served_tokens += inputs.shape[0] * inputs.shape[1]
        self.busy_s += time.perf_counter() - started
        reply = InferenceReply(version=self.model.version, length=session.cache.length)
        # Log-probs are [B] floats the trainer's importance ratios use: never compressed.
        codec = "fp32" if self.model.is_last else self.config.swarm.activation_codec
        return Reply(reply, result, codec)

    def _commitment(self, hidden: torch.Tensor, positions: torch.Tensor,
                    key_valid: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        """The signed activation commitment of the new positions' outputs (trust/commit.py)."""
        trust = self.config.trust
        # Only the commitment points are gathered (on the compute device), never the whole output.
        return commitment_to_wire(make_commitment(hidden, positions, key_valid[:, start:],
                                                  trust.commit_interval, trust.commit_top_k))

    def _session(self, body: InferenceStep | VerifyStep) -> Session:
        """The session a step continues (opened by its first step), checked against it."""
        assert self.model is not None
        session = self.sessions.get(body.session)
        if session is not None and body.start == 0:
            # A replay from position 0: the client gave up on this peer (a timeout) and came
            # back to it, so the session it still holds is stale; rebuild it from the replay.
            del self.sessions[body.session]
            session = None
        if session is None:
            if body.start != 0:
                raise PeerBusy(f"unknown session {body.session} (expired or never opened here); "
                                "replay it from position 0")
            if len(self.sessions) >= self.config.swarm.max_sessions_per_peer:
                raise PeerBusy(f"peer is full ({len(self.sessions)} sessions)")
            session = Session(self.model.new_cache(body.batch, body.max_length), body.batch,
                              body.max_length, time.monotonic())
            self.sessions[body.session] = session
        if (body.batch, body.max_length) != (session.batch, session.max_length):
            raise PeerError(f"session {body.session} was opened with batch {session.batch} and "
                            f"max_length {session.max_length}")
        if body.start != session.cache.length:
            raise PeerBusy(f"session {body.session} holds {session.cache.length} positions, the "
                            f"request starts at {body.start}")
        session.last_used = time.monotonic()
        return session

    # ---- spot-checks of other replicas' work ----------------------------------------------

    async def _verify_step(self, request: Request) -> Reply:
        body = decode_struct(request.body, VerifyStep)
        return await self.node.compute(self._verify, body, request.tensors)

    def _verify(self, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """Re-execute a segment of someone else's session, teacher-forced, at the version it
        recorded: rewind this replica's weights, run the stage, put the weights back (all on the
        compute thread, so no inference request sees the rewound weights)."""
        assert self.model is not None and self.history is not None
        started = time.perf_counter()
        try:
            return self._reexecute(body, tensors)
        finally:
            self.verify_busy_s += time.perf_counter() - started

    def _reexecute(self, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        assert self.model is not None and self.history is not None
        inputs, positions, key_valid = self._check_inference(body, tensors)
        targets = self._check_targets(body, tensors, inputs.shape[:2])
        session = self._session(body)
        device_inputs = inputs.to(self.device, self.dtype if inputs.is_floating_point() else None)
        try:
            rewound = self.history.rewound(self.model.state_dict(), self.model.version,
                                           body.version)
        except VersionUnavailable as error:
            raise PeerBusy(str(error)) from None
        with rewound, torch.inference_mode():
            hidden = self.model.body(device_inputs, positions.to(self.device),
                                     key_valid.to(self.device), session.cache)
            if not self.model.is_last:
                return Reply(VerifyReply(version=body.version), {"hidden": hidden.cpu()},
                             self.config.swarm.activation_codec)
            assert targets is not None and body.sampling is not None
            assert body.sampling_seed is not None
            logprobs, margins = self._score_targets(hidden, targets, body)
        return Reply(VerifyReply(version=body.version),
                     {"logprobs": logprobs, "margins": margins}, "fp32")

    def _score_targets(self, hidden: torch.Tensor, targets: torch.Tensor, body: VerifyStep
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position with a target: its log-prob under the sampling distribution, and its
        seeded sampling margin (0 when it is the token the seeded draw gives); 0 elsewhere. Both
        are bounded by SCORE_BOUND (a token outside the kept set scores -inf / +inf, which no
        message may carry). One position at a time: the head's [B, vocab] logits of a whole
        segment would not fit."""
        assert self.model is not None and body.sampling is not None
        assert body.sampling_seed is not None
        sampling = SamplingConfig(body.sampling.temperature, body.sampling.top_p,
                                  body.sampling.top_k)
        batch, length = targets.shape
        logprobs = torch.zeros((batch, length))
        margins = torch.zeros((batch, length))
        for column in range(length):
            rows = targets[:, column] >= 0
            if not bool(rows.any()):
                continue
            step = body.start + column - (body.prompt_columns - 1)
            logits = self.model.head(hidden[:, column]).float()
            wanted = targets[:, column].clamp(min=0).to(logits.device)
            noise = sampling_noise(step_generator(step_seed(body.sampling_seed, step)), batch,
                                   logits.shape[-1])
            scored = transformed_logits(logits, sampling).log_softmax(-1)
            picked = scored.gather(-1, wanted[:, None]).squeeze(-1).cpu()
            margin = sampling_margin(logits, wanted, sampling, noise).cpu()
            logprobs[rows, column] = picked[rows].clamp(min=-SCORE_BOUND)
            margins[rows, column] = margin[rows].clamp(max=SCORE_BOUND)
        return logprobs, margins

    def _check_targets(self, body: VerifyStep, tensors: dict[str, torch.Tensor],
                       shape: torch.Size) -> torch.Tensor | None:
        if self.model is None or not self.model.is_last:
            return None
        targets = tensors.get("targets")
        if targets is None or targets.dtype != torch.long or targets.shape != shape:
            raise PeerError(f"the last stage verifies against targets int64 {tuple(shape)}")
        if targets.numel() and (int(targets.min()) < -1
                                or int(targets.max()) >= self.spec.vocab_size):
            raise PeerError(f"targets must be -1 or token ids in [0, {self.spec.vocab_size})")
        if body.sampling_seed is None or not 1 <= body.prompt_columns <= body.max_length:
            raise PeerError("the last stage verifies with a sampling seed and 1 <= "
                            "prompt_columns <= max_length")
        # Position prompt_columns - 1 predicts completion token 0; earlier ones predict nothing.
        before = max(0, body.prompt_columns - 1 - body.start)
        if bool((targets[:, :before] >= 0).any()):
            raise PeerError("a target before the last prompt column has no decoding step")
        return targets

    def _check_inference(self, body: InferenceStep | VerifyStep, tensors: dict[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        missing = {"inputs", "positions", "key_valid"} - set(tensors)
        if missing:
            raise PeerError(f"inference_step needs tensors {sorted(missing)}")
        inputs, positions, key_valid = tensors["inputs"], tensors["positions"], tensors["key_valid"]
        limit = self.config.swarm.max_session_tokens
        if not 1 <= body.batch or not 1 <= body.max_length <= self.spec.max_positions \
                or body.batch * body.max_length > limit:
            raise PeerError(f"batch {body.batch} x max_length {body.max_length} out of range "
                            f"(max_length <= {self.spec.max_positions}, batch x max_length <= "
                            f"{limit})")
        if self.index == 0:
            if inputs.dtype != torch.long or inputs.dim() != 2:
                raise PeerError(f"stage 0 takes token ids [B, T] (int64), got "
                                f"{inputs.dtype} {tuple(inputs.shape)}")
            if inputs.numel() and (int(inputs.min()) < 0
                                   or int(inputs.max()) >= self.spec.vocab_size):
                raise PeerError(f"token ids must be in [0, {self.spec.vocab_size})")
        elif not inputs.is_floating_point() or inputs.dim() != 3 \
                or inputs.shape[2] != self.spec.hidden_size:
            raise PeerError(f"stage {self.index} takes hidden states [B, T, "
                            f"{self.spec.hidden_size}], got {inputs.dtype} {tuple(inputs.shape)}")
        batch, new = inputs.shape[0], inputs.shape[1]
        if batch != body.batch or new < 1 or body.start + new > body.max_length:
            raise PeerError(f"inputs {tuple(inputs.shape)} do not fit batch {body.batch}, start "
                            f"{body.start}, max_length {body.max_length}")
        if positions.dtype != torch.long or tuple(positions.shape) != (batch, new):
            raise PeerError(f"positions must be int64 [{batch}, {new}], got {positions.dtype} "
                            f"{tuple(positions.shape)}")
        if positions.numel() and (int(positions.min()) < 0
                                  or int(positions.max()) >= self.spec.max_positions):
            raise PeerError(f"positions must be in [0, {self.spec.max_positions})")
        if key_valid.dtype != torch.bool or tuple(key_valid.shape) != (batch, body.start + new):
            raise PeerError(f"key_valid must be bool [{batch}, {body.start + new}], got "
                            f"{key_valid.dtype} {tuple(key_valid.shape)}")
        if self.index == self.plan.num_stages - 1:
            if body.sampling is None:
                raise PeerError("the last stage needs sampling parameters")
            try:
                SamplingConfig(body.sampling.temperature, body.sampling.top_p, body.sampling.top_k)
            except ValueError as error:
                raise PeerError(f"bad sampling parameters: {error}") from None
            # SamplingConfig lets a NaN through; here it would fail only after the forward pass
            # has already moved the session's cache on.
            if not math.isfinite(body.sampling.temperature):
                raise PeerError(f"bad sampling parameters: temperature must be finite, got "
                                f"{body.sampling.temperature}")
        return inputs, positions, key_valid

    async def _close_session(self, request: Request) -> Reply:
        body = decode_struct(request.body, CloseSession)
        self.sessions.pop(body.session, None)
        return Reply(Empty())

    # ---- training ------------------------------------------------------------------------

    def _trainer(self, version: int | None = None) -> StageTrainer:
        if self.trainer is None:
            raise PeerBusy(f"peer {self.name} does not train")
        if version is not None and version != self.trainer.version:
            raise PeerBusy(f"stage {self.index} is at version {self.trainer.version}, the request "
                            f"expects {version}")
        return self.trainer

    async def _train_forward(self, request: Request) -> Reply:
        body = decode_struct(request.body, TrainForward)
        return await self.node.compute(self._forward, body, request.tensors)

    def _forward(self, body: TrainForward, tensors: dict[str, torch.Tensor]) -> Reply:
        trainer = self._trainer(body.version)
        if body.last != (self.index == self.plan.num_stages - 1):
            raise PeerError(f"the coordinator thinks stage {self.index} is "
                            f"{'' if body.last else 'not '}the last stage")
        batch = self._check_batch(tensors)
        inputs = (tensors.get("prompt_in"), tensors.get("completion_in"))
        if inputs[0] is None or inputs[1] is None:
            raise PeerError("train_forward needs tensors prompt_in and completion_in")
        self._check_activations(inputs, batch)
        loss_inputs = None
        if body.last:
            loss_inputs = LossInputs(tensors.get("proximal"), tensors.get("reference"),
                                     body.total_sequences, body.total_tokens)
        out, metrics = trainer.forward(body.micro, (inputs[0], inputs[1]), batch, loss_inputs)
        if body.last:  # per-row statistics, in full precision: the coordinator flags from them
            return Reply(TrainForwardReply(metrics=metrics),
                         {"row_surprise": out[0].cpu(), "row_log_ratio": out[1].cpu()}, "fp32")
        return Reply(TrainForwardReply(metrics=metrics),
                     {"prompt_out": out[0].cpu(), "completion_out": out[1].cpu()},
                     self.config.swarm.activation_codec)

    def _check_batch(self, tensors: dict[str, torch.Tensor]) -> TrainBatch:
        missing = [f for f in BATCH_FIELDS if f not in tensors]
        if missing:
            raise PeerError(f"train_forward is missing batch tensors {missing}")
        batch = TrainBatch(**{f: tensors[f] for f in BATCH_FIELDS})
        prompts, completions = batch.prompts, batch.completions
        expected = {
            "prompts": (torch.long, prompts.shape), "prompt_valid": (torch.bool, prompts.shape),
            "prompt_positions": (torch.long, prompts.shape),
            "completions": (torch.long, completions.shape),
            "completion_valid": (torch.bool, completions.shape),
            "completion_generated": (torch.bool, completions.shape),
            "completion_positions": (torch.long, completions.shape),
            "prompt_of": (torch.long, completions.shape[:1]),
            "behaviour_logprobs": (torch.float32, completions.shape),
            "advantages": (torch.float32, completions.shape[:1]),
            "staleness": (torch.long, completions.shape[:1]),
        }
        for name, (dtype, shape) in expected.items():
            tensor = getattr(batch, name)
            if tensor.dtype != dtype or tensor.shape != shape:
                raise PeerError(f"batch tensor {name} must be {dtype} {tuple(shape)}, got "
                                f"{tensor.dtype} {tuple(tensor.shape)}")
        if prompts.dim() != 2 or completions.dim() != 2:
            raise PeerError("prompts and completions must be [rows, length]")
        for name in ("prompts", "completions"):
            ids = getattr(batch, name)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
                raise PeerError(f"{name} token ids must be in [0, {self.spec.vocab_size})")
        if batch.prompt_of.numel() and (int(batch.prompt_of.min()) < 0
                                        or int(batch.prompt_of.max()) >= prompts.shape[0]):
            raise PeerError(f"prompt_of must index the {prompts.shape[0]} prompts")
        for name in ("prompt_positions", "completion_positions"):
            positions = getattr(batch, name)
            if positions.numel() and (int(positions.min()) < 0
                                      or int(positions.max()) >= self.spec.max_positions):
                raise PeerError(f"{name} must be in [0, {self.spec.max_positions})")
        if bool((batch.completion_generated & ~batch.completion_valid).any()):
            raise PeerError("completion_generated marks tokens that completion_valid does not")
        return batch

    def _check_activations(self, inputs: tuple[torch.Tensor, torch.Tensor],
                           batch: TrainBatch) -> None:
        shapes = (batch.prompts.shape, batch.completions.shape)
        for name, tensor, shape in zip(("prompt_in", "completion_in"), inputs, shapes):
            if self.index == 0:
                if tensor.dtype != torch.long or tensor.shape != shape:
                    raise PeerError(f"stage 0 takes {name} token ids {tuple(shape)}, got "
                                    f"{tensor.dtype} {tuple(tensor.shape)}")
            elif not tensor.is_floating_point() \
                    or tuple(tensor.shape) != (*shape, self.spec.hidden_size):
                raise PeerError(f"{name} must be hidden states {(*shape, self.spec.hidden_size)}, "
                                f"got {tensor.dtype} {tuple(tensor.shape)}")

    async def _train_backward(self, request: Request) -> Reply:
        body = decode_struct(request.body, TrainBackward)
        return await self.node.compute(self._backward, body, request.tensors)

    def _backward(self, body: TrainBackward, tensors: dict[str, torch.Tensor]) -> Reply:
        trainer = self._trainer()
        if body.micro not in trainer.saved:
            raise PeerBusy(f"stage {self.index} has no forward pass for micro-batch {body.micro}")
        grads = None
        if self.index != self.plan.num_stages - 1:
            if "prompt_grad" not in tensors or "completion_grad" not in tensors:
                raise PeerError("train_backward needs prompt_grad and completion_grad")
            grads = (tensors["prompt_grad"], tensors["completion_grad"])
            outputs = trainer.saved[body.micro][1]
            for name, grad, output in zip(("prompt_grad", "completion_grad"), grads, outputs):
                if grad.shape != output.shape:
                    raise PeerError(f"{name} has shape {tuple(grad.shape)}, the forward output "
                                    f"was {tuple(output.shape)}")
            grads = tuple(g.to(self.device, output.dtype) for g, output in zip(grads, outputs))
        back = trainer.backward(body.micro, grads)  # type: ignore[arg-type]
        result = {} if back is None or back[0] is None else \
            {"prompt_grad": back[0].cpu(), "completion_grad": back[1].cpu()}
        return Reply(Empty(), result, self.config.swarm.activation_codec)

    async def _train_grad_norm(self, request: Request) -> Reply:
        decode_struct(request.body, Empty)
        value = await self.node.compute(self._trainer().grad_square_norm)
        return Reply(GradNorm(square_norm=value))

    async def _train_step(self, request: Request) -> Reply:
        body = decode_struct(request.body, TrainStep)
        trainer = self._trainer(body.version - 1)
        if not (body.grad_scale > 0 and body.grad_scale <= 1):
            raise PeerError(f"grad_scale must be in (0, 1], got {body.grad_scale}")
        await self.node.compute(trainer.step, body.grad_scale)
        if self.model is not None:
            await self.node.compute(self._copy_from_trainer)
        await self.node.compute(self._publish)
        await self.announce()
        return Reply(VersionReply(version=trainer.version))

    async def _train_discard(self, request: Request) -> Reply:
        decode_struct(request.body, Empty)
        await self.node.compute(self._trainer().discard)
        return Reply(VersionReply(version=self._trainer().version))

    # ---- checkpoints ---------------------------------------------------------------------

    def checkpoint_path(self, version: int) -> Path:
        assert self.checkpoint_dir is not None
        return CheckpointLayout(self.checkpoint_dir).stage_file(version, self.index)

    async def _checkpoint(self, request: Request) -> Reply:
        body = decode_struct(request.body, CheckpointRequest)
        trainer = self._trainer()
        if body.action == "save":
            if body.version != trainer.version:
                raise PeerBusy(f"cannot save version {body.version}: stage {self.index} is at "
                                f"{trainer.version}")
            await self.node.compute(self._save, body.version)
        else:
            await self.node.compute(self._load, body.version)
            assert self.publisher is not None
            await self.node.compute(self.publisher.reset, body.version,
                                    published_tensors(trainer.stage))
            await self.announce()
        return Reply(VersionReply(version=trainer.version))

    def _save(self, version: int) -> None:
        path = self.checkpoint_path(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".tmp")
        state = self._trainer().state()
        if self.publisher is not None:
            # What the replicas serve at this version goes along: it generated the rollouts and
            # the swarm's evaluations, and `decentrl export` releases it by default.
            served = self.publisher.served().result(timeout=self.config.swarm.request_timeout_s)
            if served.version == version:
                state["served"] = served.tensors
        torch.save(state, staging)
        os.replace(staging, path)  # a crash mid-save leaves no half-written checkpoint

    def _load(self, version: int) -> None:
        path = self.checkpoint_path(version)
        if not path.is_file():
            raise PeerBusy(f"no checkpoint {path}")
        state = torch.load(path, map_location=self.device, weights_only=True)
        if state["version"] != version:
            raise PeerBusy(f"{path} holds version {state['version']}, not {version}")
        self._trainer().load_state(state)
        if self.model is not None:
            self._copy_from_trainer()

    def _resume_from_checkpoint(self) -> None:
        """A replacement training peer starts from the newest complete checkpoint of its stage."""
        assert self.checkpoint_dir is not None
        version = CheckpointLayout(self.checkpoint_dir).latest_version()
        if version is None:
            return
        self._load(version)
        log.info("%s: stage %d resumed from checkpoint v%d", self.name, self.index, version)
