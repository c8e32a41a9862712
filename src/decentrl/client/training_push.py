"""Training micro-batches pushed down the chain of training peers (`swarm.data_plane =
"peer_to_peer"`): the coordinator's side (the peers' is stage/training_push.py).

`PushedTraining` is the pipeline trainer's MicroBatchChain (learn/trainer.py): for each step it
signs the route (the admitted training peer of every stage, at the learner's version), sends
each micro-batch's fields and token ids to stage 0 (`train_chain`), and gets back the last
stage's row statistics and metrics with every stage's signed commitment, checked as one chain
(the tokens it sent; each stage's inputs its predecessor's outputs, each stage's received
gradients its successor's sent ones). The micro-batches of a minibatch are in flight together,
as many as there are stages, so the stages pipeline them. Gradient norms, steps and discards go
to each stage as before (client/training.py RemoteStageWorker): they are small. A batch that
takes several optimizer steps first goes down the same chain forward only (`logprobs`,
`train_logprobs_chain`): the last stage's log-probs come back with every stage's signed
`ForwardCommit`, checked as one chain from the token ids sent to the log-probs received.

An audited step's tape (what the audited peer received and sent, which the relayed path records
as it relays) is revealed by the peer after the step (`train_tape`) and checked against the
commitments, whose neighbours signed the same digests for what passed between them; a reveal
that does not match is proof against the peer."""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from decentrl.client.training import RemoteStageWorker, StepTape, checked_logprobs
from decentrl.config import SwarmConfig
from decentrl.learn.batch import TrainBatch
from decentrl.learn.stage_loss import LOSS_TENSORS, LossInputs, RowStats
from decentrl.net.directory import SwarmUnavailable, backoff
from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import TRAIN_CHAIN, TRAIN_LOGPROBS_CHAIN, TRAIN_TAPE, Rpc
from decentrl.net.push_messages import (
    TrainCommit,
    TrainingRoute,
    open_forward_commit,
    open_train_commit,
    pair_digest,
    sign_training_route,
    tensor_digest,
)
from decentrl.net.training_messages import (
    LogprobsChain,
    LogprobsForward,
    TapeRequest,
    TrainBackward,
    TrainChain,
    TrainForward,
)
from decentrl.net.wire import WireError

ROW_STATS = ("row_surprise", "row_log_ratio")
Answer = TypeVar("Answer")
Rep = TypeVar("Rep")


@dataclass(frozen=True)
class PushedMicro:
    """One micro-batch of a step, as each stage was asked to run it (what an audit replays)."""

    forward: TrainForward
    exact: dict[str, torch.Tensor]  # the batch fields (and routing, proximal, reference) sent
    commits: list[TrainCommit]  # every stage's, in stage order


class PushedTraining:
    """Micro-batches pushed down the chain of `workers`' training peers."""

    def __init__(self, node: SwarmNode, workers: Sequence[RemoteStageWorker],
                 swarm: SwarmConfig, run: str, run_session: str) -> None:
        self.node, self.workers, self.swarm = node, list(workers), swarm
        self.run_name, self.run_session = run, run_session
        self.pushed: dict[int, dict[int, PushedMicro]] = {}  # version -> micro -> what was sent
        for worker in self.workers:
            worker.revealed = functools.partial(self._tape, worker)

    def run(self, micro_batches: Sequence[tuple[int, TrainBatch, LossInputs]]
            ) -> list[tuple[dict[str, float], RowStats]]:
        route, peers, version = self._route()
        for old in [v for v in self.pushed if v < version - 1]:
            del self.pushed[old]
        deadline = self.swarm.request_timeout_s * (len(peers) + 1) * len(micro_batches)
        return self.node.run(self._all(peers, [  # type: ignore[arg-type]
            functools.partial(self._one, route, peers, version, *micro)
            for micro in micro_batches]), timeout=deadline)

    def logprobs(self, micro_batches: Sequence[tuple[int, TrainBatch]]) -> list[torch.Tensor]:
        """The forward-only pass (learn/trainer.py `MicroBatchChain.logprobs`): each
        micro-batch down the chain under the route of the learner's version, the last stage's
        log-probs back with every stage's ForwardCommit, checked as one chain."""
        route, peers, version = self._route()
        deadline = self.swarm.request_timeout_s * (len(peers) + 1) * len(micro_batches)
        return self.node.run(self._all(peers, [  # type: ignore[arg-type]
            functools.partial(self._forward_only, route, peers, version, *micro)
            for micro in micro_batches]), timeout=deadline)

    def _route(self) -> tuple[bytes, list[str], int]:
        """The owner's signed route of this step: every stage's training peer, all at one
        version (else SwarmUnavailable: the loop brings them back to one)."""
        for worker in self.workers:
            if worker.peer is None:
                worker.connect()
        version = self.workers[0].version
        if any(worker.version != version for worker in self.workers):
            raise SwarmUnavailable(f"the training stages are at versions "
                                   f"{[w.version for w in self.workers]}")
        peers = [worker.peer for worker in self.workers]
        assert all(peer is not None for peer in peers)
        route = sign_training_route(self.node.identity, TrainingRoute(
            self.run_name, self.run_session, version, peers))  # type: ignore[arg-type]
        return route, peers, version  # type: ignore[return-value]

    async def _all(self, peers: list[str],
                   calls: Sequence[Callable[[], Awaitable[Answer]]]) -> list[Answer]:
        """Every micro-batch's call, as many in flight as there are stages."""
        room = asyncio.Semaphore(len(peers))

        async def one(call: Callable[[], Awaitable[Answer]]) -> Answer:
            async with room:
                return await call()
        return list(await asyncio.gather(*(one(call) for call in calls)))

    async def _forward_only(self, route: bytes, peers: list[str], version: int, micro_id: int,
                            micro: TrainBatch) -> torch.Tensor:
        exact = {name: tensor.cpu() for name, tensor in micro.tensors().items()}
        if micro.routing is not None:
            exact["routing"] = micro.routing.cpu().contiguous()
        inputs = (micro.prompts.cpu(), micro.completions.cpu())
        reply, out = await self._call_stage_0(
            peers, TRAIN_LOGPROBS_CHAIN, LogprobsChain(route=route, forward=LogprobsForward(
                micro=micro_id, version=version, last=False)), inputs, exact, micro_id)
        logprobs = checked_logprobs(out.get("logprobs"), micro, "the training chain")
        try:
            commits = [open_forward_commit(c, peer)
                       for c, peer in zip(reply.commits, peers, strict=True)]
        except (ValueError, WireError) as bad:
            raise SwarmUnavailable(f"training stage 0 answered commitments that are not the "
                                   f"stages': {bad}") from None
        previous = pair_digest(inputs)
        for stage, commit in enumerate(commits):
            if (commit.version, commit.micro, commit.stage, commit.inputs) \
                    != (version, micro_id, stage, previous):
                raise SwarmUnavailable(f"training stage 0 answered forward-only micro-batch "
                                       f"{micro_id}'s commitments that do not chain")
            previous = commit.outputs
        if previous != tensor_digest(out["logprobs"].float()):
            raise SwarmUnavailable(f"the last training stage's commitment of forward-only "
                                   f"micro-batch {micro_id} is not to the log-probs answered")
        return logprobs

    async def _call_stage_0(self, peers: list[str], rpc: Rpc[Any, Rep], body: Any,
                            inputs: tuple[torch.Tensor, torch.Tensor],
                            exact: dict[str, torch.Tensor], micro_id: int
                            ) -> tuple[Rep, dict[str, torch.Tensor]]:
        """A micro-batch to the chain's stage 0, sent again with the same request id (the peer
        answers it once) while messages are lost; SwarmUnavailable on any other failure."""
        request_id = secrets.token_hex(8)
        for attempt in range(self.swarm.retries + 1):
            try:
                return await self.node.call(
                    peers[0], rpc, body, {"prompt_in": inputs[0], "completion_in": inputs[1]},
                    self.swarm.activation_codec,
                    self.swarm.request_timeout_s * (len(peers) + 1), request_id, exact)
            except MessageLost:
                await asyncio.sleep(backoff(attempt))
            except (RemoteError, WireError, TimeoutError) as failure:
                raise SwarmUnavailable(f"the training chain failed micro-batch {micro_id}: "
                                       f"{failure}") from failure
        raise SwarmUnavailable(f"micro-batch {micro_id}: {self.swarm.retries + 1} messages "
                               "to training stage 0 lost in a row")

    async def _one(self, route: bytes, peers: list[str], version: int, micro_id: int,
                   micro: TrainBatch, loss_inputs: LossInputs
                   ) -> tuple[dict[str, float], RowStats]:
        exact = {name: tensor.cpu() for name, tensor in micro.tensors().items()}
        if micro.routing is not None:
            exact["routing"] = micro.routing.cpu().contiguous()
        for name in LOSS_TENSORS:
            value = getattr(loss_inputs, name)
            if value is not None:
                exact[name] = value.cpu()
        forward = TrainForward(micro=micro_id, version=version, last=False,
                               total_sequences=loss_inputs.total_sequences,
                               total_tokens=loss_inputs.total_tokens,
                               total_supervised_tokens=loss_inputs.total_supervised_tokens,
                               entropy_coef=loss_inputs.entropy_coef)
        inputs = (micro.prompts.cpu(), micro.completions.cpu())
        reply, out = await self._call_stage_0(peers, TRAIN_CHAIN,
                                              TrainChain(route=route, forward=forward), inputs,
                                              exact, micro_id)
        rows = micro.completions.shape[0]
        stats = tuple(out.get(name) for name in ROW_STATS)
        if any(s is None or tuple(s.shape) != (rows,) for s in stats):
            raise SwarmUnavailable(f"the training chain answered micro-batch {micro_id} without "
                                   f"row statistics [{rows}]")
        commits = self._check(reply.commits, peers, version, micro_id, inputs)
        self.pushed.setdefault(version, {})[micro_id] = PushedMicro(forward, exact, commits)
        return reply.metrics, (stats[0].float(), stats[1].float())  # type: ignore[union-attr]

    @staticmethod
    def _check(raw: list[bytes], peers: list[str], version: int, micro: int,
               inputs: tuple[torch.Tensor, torch.Tensor]) -> list[TrainCommit]:
        """Every stage's commitment, once they make one chain from the token ids sent; stage 0
        vouches for the list (each stage checked the later ones), so a break is its doing."""
        try:
            commits = [open_train_commit(c, peer) for c, peer in zip(raw, peers, strict=True)]
        except (ValueError, WireError) as bad:
            raise SwarmUnavailable(f"training stage 0 answered commitments that are not the "
                                   f"stages': {bad}") from None
        last = len(peers) - 1
        chained = commits[0].inputs == pair_digest(inputs) and commits[0].grads_out == b"" \
            and commits[last].outputs == b"" and commits[last].grads_in == b""
        for stage, commit in enumerate(commits):
            chained &= (commit.version, commit.micro, commit.stage) == (version, micro, stage)
            if stage < last:
                after = commits[stage + 1]
                chained &= after.inputs == commit.outputs and after.grads_out == commit.grads_in
        if not chained:
            raise SwarmUnavailable(f"training stage 0 answered micro-batch {micro}'s "
                                   "commitments that do not chain")
        return commits

    def _tape(self, worker: RemoteStageWorker, version: int) -> StepTape:
        """What `worker`'s peer received and sent in the step from `version`, revealed by it and
        checked against its commitments (SwarmUnavailable, after recording the proof, where it
        does not match: the step is reverted)."""
        tape = StepTape()
        stage = worker.stage
        for micro, pushed in sorted(self.pushed.get(version, {}).items()):
            commit = pushed.commits[stage]
            _, out = worker._call(TRAIN_TAPE, TapeRequest(version=version, micro=micro))
            received = (out.get("prompt_in"), out.get("completion_in"))
            sent = ("row_surprise", "row_log_ratio") if worker.last \
                else ("prompt_out", "completion_out")
            forward_out = {name: out.get(name) for name in sent}
            grads_in = (out.get("prompt_grad_in"), out.get("completion_grad_in"))
            grads_out = (out.get("prompt_grad"), out.get("completion_grad"))
            matches = None not in received and None not in forward_out.values() \
                and pair_digest(received) == commit.inputs \
                and (worker.last or pair_digest(tuple(forward_out.values())) == commit.outputs) \
                and pair_digest(None if None in grads_in else grads_in) == commit.grads_in \
                and pair_digest(None if None in grads_out else grads_out) == commit.grads_out
            if not matches:
                assert worker.peer is not None and worker.audit is not None
                detail = (f"its tape of micro-batch {micro} of v{version} does not match what "
                          "it and its neighbours signed")
                worker.audit.reputation.record(worker.peer, "proved", detail, stage)
                worker.directory.ban(worker.peer, detail)
                raise SwarmUnavailable(f"training stage {stage}: {detail}")
            exact = {name: t for name, t in pushed.exact.items()
                     if name != "routing" and name not in LOSS_TENSORS}
            if pushed.exact.get("routing") is not None \
                    and worker.routing_part.stop > worker.routing_part.start:
                exact["routing"] = pushed.exact["routing"][:, :, worker.routing_part].contiguous()
            if worker.last:
                exact.update({n: pushed.exact[n] for n in LOSS_TENSORS if n in pushed.exact})
            forward = TrainForward(
                micro=micro, version=version, last=worker.last,
                total_sequences=pushed.forward.total_sequences if worker.last else 0,
                total_tokens=pushed.forward.total_tokens if worker.last else 0,
                total_supervised_tokens=(pushed.forward.total_supervised_tokens
                                         if worker.last else 0),
                entropy_coef=pushed.forward.entropy_coef if worker.last else 0.0)
            tape.forwards.append((forward, {"prompt_in": received[0], "completion_in":
                                            received[1]}, exact, forward_out))  # type: ignore[dict-item]
            tape.backwards.append((TrainBackward(micro=micro),
                                   {} if None in grads_in else
                                   {"prompt_grad": grads_in[0], "completion_grad": grads_in[1]},
                                   {} if None in grads_out else
                                   {"prompt_grad": grads_out[0],
                                    "completion_grad": grads_out[1]}))  # type: ignore[dict-item]
        return tape
