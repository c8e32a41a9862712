"""Training micro-batches pushed down the chain of training peers, gradients back up
(`swarm.data_plane = "peer_to_peer"`; the coordinator's side is client/training_push.py).

The coordinator sends stage 0 a micro-batch (its fields and token ids) with the step's route,
the training peer of every stage, signed by the run's owner. Each stage runs its forward as a
relayed `train_forward` would (stage/training.py), pushes its outputs and the micro-batch's
fields to the next stage and waits: the next stage's answer carries the gradients of those
outputs, and this stage runs its backward with them and answers its own input gradients. The
last stage computes the loss and starts the backward. Every answer also carries the last
stage's row statistics and metrics, and each stage's signed `TrainCommit` (digests of its
inputs, outputs, and the gradients it received and sent), which each stage checks against what
passed between it and the next, and the coordinator as one chain. The coordinator's link carries
the micro-batch and the row statistics, never an activation; its micro-batches are in flight
together, so the stages pipeline them.

A batch that takes several optimizer steps first has its proximal log-probs computed the same
way, forward only (`train_logprobs_chain`): each stage runs its learner without gradient and
pushes its outputs on; the last stage answers the log-probs, and every stage signs a
`ForwardCommit` (its inputs' and outputs' digests, under a domain of its own), checked as one
chain by each stage and the coordinator. Such a pass keeps nothing and changes no weight or
optimizer state.

What a stage takes: a micro-batch only under a route its owner signed for this run and this
learner version, naming this peer at this stage, from the peer named before it (stage 0: the
owner); else a strike. What it keeps (where audits are on): what it received and sent for each
micro-batch of its last two versions' steps, which an audit reveals (`train_tape`) and checks
against the commitments, then replays on another training peer as for a relayed step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from decentrl.config import RunConfig
from decentrl.learn.stage_loss import LOSS_TENSORS
from decentrl.model.stages import StagePlan, routing_layers
from decentrl.net.link import MessageLost
from decentrl.net.node import Handler, RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import TRAIN_CHAIN, TRAIN_LOGPROBS_CHAIN, TRAIN_TAPE, Rpc
from decentrl.net.push_messages import (
    ForwardCommit,
    TrainCommit,
    open_forward_commit,
    open_train_commit,
    open_training_route,
    pair_digest,
    sign_forward_commit,
    sign_train_commit,
    tensor_digest,
    wire_form,
)
from decentrl.net.session import OwnerSession
from decentrl.net.training_messages import (
    LogprobsChain,
    LogprobsChainReply,
    TapeReply,
    TapeRequest,
    TrainBackward,
    TrainChain,
    TrainChainReply,
)
from decentrl.net.wire import ActivationCodec, WireError
from decentrl.stage.inbound import PeerBusy, PeerError
from decentrl.stage.push import check_route, exact_codec
from decentrl.stage.training import TrainingService

log = logging.getLogger(__name__)

# Versions whose tapes a training peer keeps: the step an audit may still ask about (an audit
# follows its step) and the one under way.
TAPE_VERSIONS = 2

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Tape:
    """One micro-batch as a training stage saw it, each tensor in its wire form."""

    inputs: Pair
    sent: dict[str, torch.Tensor]  # prompt_out / completion_out, or the last stage's row stats
    grads_in: Pair | None  # received from the next stage (none at the last)
    grads_out: Pair | None  # sent back (none at stage 0)
    metrics: dict[str, float]


class TrainingChainService:
    """A training peer's side of micro-batches pushed down the chain."""

    def __init__(self, config: RunConfig, training: TrainingService, node: SwarmNode,
                 owner: str, run_session: OwnerSession) -> None:
        self.config, self.training, self.node, self.owner = config, training, node, owner
        self.run_session = run_session
        self.stage = training.stage
        self.last = self.stage == config.num_stages - 1
        self.codec: ActivationCodec = config.swarm.activation_codec
        spec = training.checks.spec
        plan = StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
        self.routing_part = routing_layers(spec, plan.layers(self.stage))
        self.keeps_tapes = config.trust.train_audit_fraction > 0
        self.tapes: dict[int, dict[int, Tape]] = {}  # version -> micro -> what it saw

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return [(TRAIN_CHAIN, self._chain), (TRAIN_TAPE, self._tape),
                (TRAIN_LOGPROBS_CHAIN, self._logprobs_chain)]

    async def _chain(self, request: Request[TrainChain]) -> Reply:
        body, tensors = request.body, request.tensors
        peers = await self._route(body, request.sender)
        forward = msgspec.structs.replace(body.forward, last=self.last, audit=False)
        own = {name: tensor for name, tensor in tensors.items()
               if name != "routing" and (self.last or name not in LOSS_TENSORS)}
        routing = self._own_routing(tensors.get("routing"))
        if routing is not None:
            own["routing"] = routing
        reply = await self.training._compute(self.training._forward, forward, own)
        inputs = (tensors["prompt_in"], tensors["completion_in"])
        out = dict(reply.tensors or {})
        if self.last:
            sent, grads_in, later = out, None, []
            metrics: dict[str, float] = reply.body.metrics
            stats = out
        else:
            sent = {name: wire_form(out[name], self.codec)
                    for name in ("prompt_out", "completion_out")}
            grads_in, stats, metrics, later = await self._down(
                body, tensors, out, (sent["prompt_out"], sent["completion_out"]), peers)
        back = await self.training._compute(
            self.training._backward, TrainBackward(micro=forward.micro),
            {} if grads_in is None else {"prompt_grad": grads_in[0],
                                         "completion_grad": grads_in[1]})
        grads_out = None if not back.tensors else \
            tuple(wire_form(back.tensors[name], self.codec)
                  for name in ("prompt_grad", "completion_grad"))
        commit = TrainCommit(forward.version, forward.micro, self.stage, pair_digest(inputs),
                             b"" if self.last else pair_digest((sent["prompt_out"],
                                                                sent["completion_out"])),
                             pair_digest(grads_in), pair_digest(grads_out))  # type: ignore[arg-type]
        if self.keeps_tapes:
            self._keep(forward.version, forward.micro, Tape(
                inputs, sent, grads_in, grads_out, metrics))  # type: ignore[arg-type]
        replied = {} if back.tensors is None else dict(back.tensors)
        return Reply(TrainChainReply(metrics=metrics,
                                     commits=[sign_train_commit(self.node.identity, commit),
                                              *later]),
                     replied, self.codec,
                     exact={name: stats[name].float() for name in ("row_surprise",
                                                                    "row_log_ratio")})

    async def _logprobs_chain(self, request: Request[LogprobsChain]) -> Reply:
        """A forward-only micro-batch (the proximal log-probs): under the same route and sender
        checks as a training micro-batch, this stage's forward without gradient, pushed on; the
        last stage's log-probs back with every stage's signed ForwardCommit. Nothing is kept
        (no activations, no tape) and no weight or optimizer state changes."""
        body, tensors = request.body, request.tensors
        peers = await self._route(body, request.sender)
        forward = msgspec.structs.replace(body.forward, last=self.last)
        own = {name: tensor for name, tensor in tensors.items() if name != "routing"}
        routing = self._own_routing(tensors.get("routing"))
        if routing is not None:
            own["routing"] = routing
        out = await self.training._compute(self.training.forward_only, forward, own)
        inputs = (tensors["prompt_in"], tensors["completion_in"])
        later: list[bytes] = []
        if isinstance(out, torch.Tensor):  # the last stage (forward_only checked `last`)
            logprobs = out
            outputs = tensor_digest(logprobs.float())
        else:
            sent = (wire_form(out[0], self.codec), wire_form(out[1], self.codec))
            logprobs, later = await self._down_forward_only(body, tensors, out, sent, peers)
            outputs = pair_digest(sent)
        commit = ForwardCommit(forward.version, forward.micro, self.stage, pair_digest(inputs),
                               outputs)
        return Reply(LogprobsChainReply(commits=[sign_forward_commit(self.node.identity, commit),
                                                 *later]),
                     exact={"logprobs": logprobs.float()})

    async def _down_forward_only(self, body: LogprobsChain, tensors: dict[str, torch.Tensor],
                                 out: Pair, sent: Pair, peers: list[str]
                                 ) -> tuple[torch.Tensor, list[bytes]]:
        """Push this stage's forward-only outputs to the next stage; its answer: the log-probs
        and the later stages' commitments, checked as one chain from what this stage sent and
        ending at those log-probs."""
        batch = {name: tensor for name, tensor in tensors.items()
                 if name not in ("prompt_in", "completion_in")}
        timeout = self.config.swarm.request_timeout_s \
            * (self.config.num_stages - 1 - self.stage)
        try:
            reply, back = await self.node.call(
                peers[self.stage + 1], TRAIN_LOGPROBS_CHAIN, body,
                {"prompt_in": out[0], "completion_in": out[1]}, self.codec, timeout, exact=batch)
        except (RemoteError, WireError, MessageLost, TimeoutError) as failure:
            raise PeerBusy(f"training stage {self.stage + 1} failed: {failure}"[:500]) from None
        logprobs = back.get("logprobs")
        rows, width = tensors["completion_in"].shape[:2]
        if logprobs is None or tuple(logprobs.shape) != (rows, width):
            raise PeerBusy(f"training stage {self.stage + 1} answered no log-probs "
                           f"[{rows}, {width}]")
        later = list(range(self.stage + 1, len(peers)))
        try:
            opened = [open_forward_commit(raw, peers[stage])
                      for stage, raw in zip(later, reply.commits, strict=True)]
        except (ValueError, WireError) as bad:
            raise PeerBusy(f"training stage {self.stage + 1} answered commitments that are not "
                           f"the later stages': {bad}") from None
        previous = pair_digest(sent)
        for stage, commit in zip(later, opened, strict=True):
            if (commit.version, commit.micro, commit.stage, commit.inputs) \
                    != (body.forward.version, body.forward.micro, stage, previous):
                raise PeerBusy(f"training stage {stage}'s commitment does not chain with what "
                               f"stage {stage - 1} sent")
            previous = commit.outputs
        if previous != tensor_digest(logprobs.float()):
            raise PeerBusy(f"the last training stage's commitment is not to the log-probs "
                           f"stage {self.stage + 1} answered")
        return logprobs, reply.commits

    def _own_routing(self, routing: torch.Tensor | None) -> torch.Tensor | None:
        """This stage's part of a micro-batch's whole routing record (None: nothing to replay)."""
        if routing is None:
            return None
        if routing.dim() != 4 or routing.shape[2] < self.routing_part.stop:
            raise PeerError(f"routing must be [rows, completion, every sparse layer, top_k], "
                            f"got {tuple(routing.shape)}")
        if self.routing_part.stop > self.routing_part.start:
            return routing[:, :, self.routing_part].contiguous()
        return None

    async def _down(self, body: TrainChain, tensors: dict[str, torch.Tensor],
                    out: dict[str, torch.Tensor], sent: Pair, peers: list[str]
                    ) -> tuple[Pair, dict[str, torch.Tensor], dict[str, float], list[bytes]]:
        """Push this stage's outputs to the next and wait for its answer: the gradients of
        them (checked against its commitment), the row statistics, the metrics, and the later
        stages' commitments (checked as a chain)."""
        batch = {name: tensor for name, tensor in tensors.items()
                 if name not in ("prompt_in", "completion_in")}
        timeout = self.config.swarm.request_timeout_s \
            * (self.config.num_stages - 1 - self.stage)
        try:
            reply, back = await self.node.call(
                peers[self.stage + 1], TRAIN_CHAIN, body,
                {"prompt_in": out["prompt_out"], "completion_in": out["completion_out"]},
                self.codec, timeout, exact=batch)
        except (RemoteError, WireError, MessageLost, TimeoutError) as failure:
            raise PeerBusy(f"training stage {self.stage + 1} failed: {failure}"[:500]) from None
        grads = (back.get("prompt_grad"), back.get("completion_grad"))
        stats = {name: back.get(name) for name in ("row_surprise", "row_log_ratio")}
        if grads[0] is None or grads[1] is None or any(v is None for v in stats.values()) \
                or grads[0].shape != sent[0].shape or grads[1].shape != sent[1].shape:
            raise PeerBusy(f"training stage {self.stage + 1} answered without the gradients "
                           f"{tuple(sent[0].shape)}, {tuple(sent[1].shape)} and row statistics")
        received: Pair = (grads[0], grads[1])
        self._check_later(body, reply.commits, peers, sent, received)
        return received, stats, reply.metrics, reply.commits  # type: ignore[return-value]

    def _check_later(self, body: TrainChain, commits: list[bytes], peers: list[str],
                     sent: Pair, received: Pair) -> None:
        """PeerBusy unless the later stages' commitments are theirs, of this micro-batch, and
        one chain starting from what this stage sent and received."""
        later = list(range(self.stage + 1, len(peers)))
        try:
            opened = [open_train_commit(raw, peers[stage]) for stage, raw in
                      zip(later, commits, strict=True)]
        except (ValueError, WireError) as bad:
            raise PeerBusy(f"training stage {self.stage + 1} answered commitments that are not "
                           f"the later stages': {bad}") from None
        expected = (body.forward.version, body.forward.micro)
        previous_out, previous_grads = pair_digest(sent), pair_digest(received)
        for stage, commit in zip(later, opened, strict=True):
            if (commit.version, commit.micro, commit.stage) != (*expected, stage) \
                    or commit.inputs != previous_out or commit.grads_out != previous_grads:
                raise PeerBusy(f"training stage {stage}'s commitment does not chain with what "
                               f"stage {stage - 1} sent and received")
            previous_out, previous_grads = commit.outputs, commit.grads_in

    async def _route(self, body: TrainChain | LogprobsChain, sender: str) -> list[str]:
        """The route's peers, once the owner signed it for this run, naming this peer here and
        the sender before it."""
        route = open_training_route(body.route, self.owner)
        check_route("training route", route.run, route.session, route.peers, self.config,
                    await self.run_session.against(route.session), self.stage,
                    self.node.peer_id)
        if route.version != body.forward.version:
            raise PeerError(f"a training route of version {route.version} for a micro-batch of "
                            f"version {body.forward.version}")
        expected = self.owner if self.stage == 0 else route.peers[self.stage - 1]
        if sender != expected:
            raise PeerError(f"a micro-batch from {sender[-8:]}: the route names "
                            f"{expected[-8:]} before stage {self.stage}")
        return route.peers

    def _keep(self, version: int, micro: int, tape: Tape) -> None:
        self.tapes.setdefault(version, {})[micro] = tape
        for old in sorted(self.tapes)[:-TAPE_VERSIONS]:
            del self.tapes[old]

    async def _tape(self, request: Request[TapeRequest]) -> Reply:
        """An audit's reveal of one micro-batch's tape."""
        tape = self.tapes.get(request.body.version, {}).get(request.body.micro)
        if tape is None:
            raise PeerBusy(f"no tape of micro-batch {request.body.micro} of version "
                           f"{request.body.version} is kept here")
        tensors = {"prompt_in": tape.inputs[0], "completion_in": tape.inputs[1], **tape.sent}
        if tape.grads_in is not None:
            tensors.update(prompt_grad_in=tape.grads_in[0], completion_grad_in=tape.grads_in[1])
        if tape.grads_out is not None:
            tensors.update(prompt_grad=tape.grads_out[0], completion_grad=tape.grads_out[1])
        activations = {n: t for n, t in tensors.items() if t.is_floating_point()
                       and n not in ("row_surprise", "row_log_ratio")}
        exact = {n: t for n, t in tensors.items() if n not in activations}
        codec = exact_codec(next(iter(activations.values()))) if activations else "fp32"
        return Reply(TapeReply(metrics=tape.metrics), activations, codec, exact)
