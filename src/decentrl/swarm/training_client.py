"""The training client: a training peer of one stage, driven over RPC as the pipeline trainer's
`StageWorker` (learn/trainer.py), so the same trainer runs a pipeline of local stages or of peers.
A training step cannot move to another peer halfway: a peer that fails raises SwarmUnavailable,
and the training loop recovers (swarm/loop.py).

Only a training peer the run's owner admitted is driven (`admitted`), and every version it makes
(a step, a rollback, the version it connects at) goes to the lineage signer, which signs the hash
of the state its replicas are to hold (swarm/lineage.py)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Literal, TypeVar

import torch

from decentrl.config import SwarmConfig
from decentrl.learn.batch import TrainBatch
from decentrl.learn.trainer import Activations, LossInputs
from decentrl.net.directory import Directory, SwarmUnavailable, backoff
from decentrl.net.link import MessageLost
from decentrl.net.node import PeerRefused, RemoteError, SwarmNode
from decentrl.net.protocol import (
    BATCH_TENSORS,
    CHECKPOINT,
    TRAIN_BACKWARD,
    TRAIN_DISCARD,
    TRAIN_FORWARD,
    TRAIN_GRAD_NORM,
    TRAIN_STEP,
    CheckpointRequest,
    Empty,
    Rpc,
    TrainBackward,
    TrainForward,
    TrainStep,
)
from decentrl.net.wire import ActivationCodec, WireError
from decentrl.swarm.lineage import LineageSigner

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class RemoteStageWorker:
    """A training peer of one stage, as the pipeline trainer's StageWorker."""

    def __init__(self, node: SwarmNode, directory: Directory, stage: int, num_stages: int,
                 swarm: SwarmConfig, admitted: Callable[[str], bool],
                 lineage: LineageSigner) -> None:
        self.node, self.directory, self.stage = node, directory, stage
        self.last = stage == num_stages - 1
        self.swarm, self.admitted, self.lineage = swarm, admitted, lineage
        self.peer: str | None = None
        self.since = 0  # the version the peer was connected at (the manifest's roster says it)
        self._version = 0

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
        return record.version

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
        request_id = secrets.token_hex(8)
        for attempt in range(self.swarm.retries + 1):
            try:
                return self.node.call_sync(self.peer, rpc, body, tensors, codec,
                                           self.swarm.request_timeout_s, request_id, exact)
            except MessageLost:
                time.sleep(backoff(attempt))
            except (RemoteError, WireError) as error:
                if not isinstance(error, (PeerRefused, WireError)):
                    self.directory.ban(self.peer, str(error))
                self.peer = None
                raise SwarmUnavailable(f"training stage {self.stage}: {error}") from error
        raise SwarmUnavailable(f"training stage {self.stage}: {self.swarm.retries + 1} messages "
                               "lost in a row")

    def forward(self, micro: int, inputs: Activations, batch: TrainBatch,
                loss_inputs: LossInputs | None = None
                ) -> tuple[Activations, dict[str, float]]:
        exact = {name: getattr(batch, name).cpu() for name in BATCH_TENSORS}
        tensors = {"prompt_in": inputs[0].cpu(), "completion_in": inputs[1].cpu()}
        body = TrainForward(micro=micro, version=self._version, last=self.last,
                            total_sequences=loss_inputs.total_sequences if loss_inputs else 0,
                            total_tokens=loss_inputs.total_tokens if loss_inputs else 0)
        if loss_inputs is not None:
            for name in ("proximal", "reference"):
                value = getattr(loss_inputs, name)
                if value is not None:
                    exact[name] = value.cpu()
        reply, out = self._call(TRAIN_FORWARD, body, tensors, self.swarm.activation_codec, exact)
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

    def backward(self, micro: int, grad_outputs: Activations | None) -> Activations | None:
        tensors = {} if grad_outputs is None else {"prompt_grad": grad_outputs[0].cpu(),
                                                   "completion_grad": grad_outputs[1].cpu()}
        _, out = self._call(TRAIN_BACKWARD, TrainBackward(micro=micro), tensors,
                            self.swarm.activation_codec)
        if self.stage == 0:
            return None
        if "prompt_grad" not in out or "completion_grad" not in out:
            raise SwarmUnavailable(f"training stage {self.stage} replied without gradients")
        return out["prompt_grad"].float(), out["completion_grad"].float()

    def grad_square_norm(self) -> float:
        reply, _ = self._call(TRAIN_GRAD_NORM, Empty())
        return reply.square_norm

    def step(self, grad_scale: float) -> None:
        reply, _ = self._call(TRAIN_STEP, TrainStep(grad_scale=grad_scale,
                                                    version=self._version + 1))
        self._version = reply.version
        assert self.peer is not None  # it just answered
        self.lineage.published(self.stage, self.peer, reply.version)

    def discard(self) -> None:
        reply, _ = self._call(TRAIN_DISCARD, Empty())
        self._version = reply.version

    def checkpoint(self, action: Literal["save", "load"], version: int) -> int:
        reply, _ = self._call(CHECKPOINT, CheckpointRequest(action=action, version=version))
        self._version = reply.version
        if action == "load":  # the publisher starts over from a keyframe of the checkpoint
            assert self.peer is not None  # it just answered
            self.lineage.published(self.stage, self.peer, reply.version, restart=True)
        return self._version
