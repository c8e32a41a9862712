"""Generation sessions whose activations travel from peer to peer (`swarm.data_plane =
"peer_to_peer"`): the coordinator's side (the stages' is stage/push.py, the messages net/
push_messages.py).

A session's route (one replica per stage, chosen by the directory as for a relayed session) is
signed by the run's owner. Each step the coordinator pushes the new token ids to stage 0 and, at
the same time, asks the last stage for the step's tokens (`inference_result`, answered once they
are sampled): S + 1 one-way hops a token instead of 2 S, and only token ids, log-probs and each
stage's signed commitment (a digest per row) cross the coordinator's link, whatever the hidden
width. The commitments are checked as a chain (every stage's input digest is its predecessor's
outputs', the first is the tokens sent, the last the tokens received) and kept in the provenance
for spot-checks, which ask the stages to reveal what they sent (trust/reveal.py).

Failover: the answer to the push says which stage the chain lost (by its predecessor's account).
A replacement gets the next route epoch; the stage before it resends what it kept of the session
(`inference_resume`), so the new replica rebuilds its cache from that stage's outputs, not from
the coordinator's copy (it keeps none); a lost stage 0 is rebuilt from the token ids. Only a
call the coordinator made itself (to stage 0, or the last stage's collection) can get a peer
banned: a stage's claim that the next one failed only moves the session off it, so no stage can
push an honest one out of the routing by accusing it."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from decentrl.net.calls import PeerRefused
from decentrl.net.directory import SwarmUnavailable, backoff
from decentrl.net.evidence import EvidenceRequest
from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, ReplyContentError
from decentrl.net.protocol import (
    CLOSE_SESSION,
    EVIDENCE,
    INFERENCE_PUSH,
    INFERENCE_RESULT,
    INFERENCE_RESUME,
    CloseSession,
    Rpc,
)
from decentrl.net.push_messages import (
    PushAck,
    PushStep,
    ResultRequest,
    ResumeRequest,
    SessionRoute,
    StepCommit,
    StepOutcome,
    chain_digest,
    open_commit,
    row_digests,
    sign_route,
    tensor_digest,
)
from decentrl.net.wire import WireError
from decentrl.rollout.chain import StepResult
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.inbound import InboundChecks
from decentrl.trust.evidence import proven_fault
from decentrl.trust.provenance import Commitment, Provenance
from decentrl.trust.relay import BadReply, check_experts, check_samples

if TYPE_CHECKING:
    from decentrl.client.sessions import RemoteChain

log = logging.getLogger(__name__)

CALL_ERRORS = (RemoteError, WireError, MessageLost, TimeoutError)
# The accused answers from what it keeps, at once; one that is gone must not hold up the
# failover it caused for a whole request timeout.
EVIDENCE_TIMEOUT_S = 5.0
Req = TypeVar("Req")
Rep = TypeVar("Rep")


class StageLost(Exception):
    """A step lost `stage`: `own` when the coordinator's own call to it failed (its peer is
    avoided by the routing), else by another stage's account (the session only moves)."""

    def __init__(self, stage: int, detail: str, own: bool, proof: bool = False) -> None:
        super().__init__(f"stage {stage}: {detail}")
        self.stage, self.detail, self.own, self.proof = stage, detail, own, proof


class PushSession:
    def __init__(self, chain: RemoteChain, batch: int, max_length: int) -> None:
        self.chain, self.batch, self.max_length = chain, batch, max_length
        self.id = secrets.token_hex(8)
        stages = chain.num_stages
        self.peers: list[str | None] = [None] * stages
        self.used: set[str] = set()  # every peer of any epoch (closed at the end)
        self.lost: frozenset[str] = frozenset()  # peers this session lost, avoided where it can
        self.claims: dict[str, int] = {}  # by peer: the next stage's replicas it said failed
        self.epoch = -1
        self.signed_route = b""
        self.routed_to: tuple[str, int] | None = None  # stage 0's peer that holds the route
        # Stage 0's inputs so far (token ids, positions, key mask), for its rebuild.
        self.inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.length = 0
        self.provenance = Provenance.empty(stages)
        self.provenance.session = self.id
        self.failovers = 0
        self.closed = False
        # Stages whose replica changed since the last step: the stage before the first of them
        # resends the session (for stage 0, the coordinator does).
        self.changed: set[int] = set()
        # Digests of the token ids pushed to stage 0 for the step under way (stage 0 commits to
        # one of them).
        self.sent_digests: list[bytes] = []

    # ---- one step ------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        if self.closed:
            raise RuntimeError("session is closed")
        self.provenance.sampling = sampling
        started = time.monotonic()
        tokens, positions = tokens.cpu(), positions.cpu()
        new_valid = key_valid.cpu()[:, -tokens.shape[1]:]
        swarm = self.chain.swarm
        error: Exception | None = None
        for attempt in range(swarm.retries + 1):
            try:
                self._route()
                result = self.chain.node.run(
                    self._attempt(tokens, positions, new_valid, sampling, seed),
                    timeout=self._deadline() + 10)
            except StageLost as lost:
                error = lost
                self._lose(lost)
                time.sleep(backoff(attempt))
                continue
            except TimeoutError as timeout:
                error = timeout
                self._lose(StageLost(0, f"no answer within {self._deadline():.0f}s", own=True))
                continue
            self.inputs.append((tokens, positions, new_valid))
            self.length += tokens.shape[1]
            self.changed.clear()
            self.sent_digests.clear()
            self.provenance.finished = time.monotonic()
            if self.chain.on_step is not None:
                self.chain.on_step(self.batch, tokens.shape[1], self.max_length,
                                   time.monotonic() - started)
            return result
        raise SwarmUnavailable(f"session {self.id} failed {swarm.retries + 1} times; last "
                               f"error: {error}")

    def _deadline(self) -> float:
        """The longest a step may take: each stage's push waits for the rest of the chain."""
        return self.chain.swarm.request_timeout_s * (self.chain.num_stages + 1)

    def _route(self) -> None:
        """Choose a replica for every stage without one and sign the next route epoch."""
        if all(peer is not None for peer in self.peers) and self.epoch >= 0:
            return
        directory = self.chain.directory
        for stage, peer in enumerate(self.peers):
            if peer is not None:
                continue
            peer = directory.choose_inference(stage, avoid=self.lost)
            if peer is None:
                directory.refresh()
                peer = directory.choose_inference(stage, allow_banned=True, avoid=self.lost)
            if peer is None:
                raise StageLost(stage, "no inference peer serves it", own=False)
            self.peers[stage] = peer
            self.used.add(peer)
            if self.length > 0:
                self.changed.add(stage)
        self.epoch += 1
        route = SessionRoute(self.chain.run, self.chain.run_session, self.id, self.epoch,
                             [p for p in self.peers if p is not None], self.batch,
                             self.max_length)
        self.signed_route = sign_route(self.chain.node.identity, route)

    def _lose(self, lost: StageLost) -> None:
        peer = self.peers[lost.stage]
        self.failovers += 1
        if peer is None:
            return
        accuser = self.peers[lost.stage - 1] if not lost.own and lost.stage > 0 else None
        if accuser is not None:
            proof = self._proof_against(accuser, peer, lost.stage)
            if proof is not None:  # the accuser pushed what no honest stage sends
                lost, peer, accuser = StageLost(lost.stage - 1, proof, own=True, proof=True), \
                    accuser, None
        if accuser is not None:
            self.claims[accuser] = self.claims.get(accuser, 0) + 1
            if self.claims[accuser] >= 2:
                # Its second replica lost by its own account: it may be the one failing them.
                self._drop(lost.stage - 1, accuser)
        self._drop(lost.stage, peer)
        if lost.own:
            if lost.proof and self.chain.reputation is not None:
                self.chain.reputation.record(peer, "proved", f"stage {lost.stage} {lost.detail}",
                                             lost.stage)
            self.chain.directory.ban(peer, lost.detail)

    def _proof_against(self, accuser: str, accused: str, stage: int) -> str | None:
        """Why a push `accuser` signed, which `accused` (at `stage`) refused and kept as
        evidence (net/evidence.py), proves the accuser at fault (trust/evidence.py), or None:
        the claim stands unproven either way."""
        chain = self.chain
        try:
            reply, _ = chain.node.call_sync(accused, EVIDENCE, EvidenceRequest(
                accuser, INFERENCE_PUSH.method),
                timeout=min(chain.swarm.request_timeout_s, EVIDENCE_TIMEOUT_S))
        except (*CALL_ERRORS, PeerRefused):
            return None
        checks = InboundChecks(chain.spec, stage, chain.num_stages,
                               chain.swarm.max_session_tokens, chain.stage_layers)
        for copy in reply.copies:
            reason = proven_fault(copy, accuser, INFERENCE_PUSH,
                                  lambda tensors: checks.pushed_inputs(tensors["inputs"]))
            if reason is not None:
                return reason
        return None

    def _drop(self, stage: int, peer: str) -> None:
        """Move the session off `peer` at `stage` (released, avoided by this session)."""
        directory = self.chain.directory
        directory.release(peer)
        self.peers[stage] = None
        self.lost |= {peer}

    async def _attempt(self, tokens: torch.Tensor, positions: torch.Tensor,
                       new_valid: torch.Tensor, sampling: SamplingConfig, seed: int | None
                       ) -> StepResult:
        """Start the step (a push to stage 0, or a resume where a later replica changed) and
        collect its tokens from the last stage; StageLost names the stage a failure is put
        down to."""
        peers = [p for p in self.peers if p is not None]
        if not self.changed or 0 in self.changed:
            starter = 0
            start_call = self._push_first(peers[0], tokens, positions, new_valid, sampling, seed)
        else:
            starter = min(self.changed) - 1
            start_call = self._call(peers[starter], INFERENCE_RESUME, ResumeRequest(
                self.signed_route, self.length, sampling, seed), timeout=self._deadline())
        ack_task: asyncio.Future[tuple[PushAck, dict[str, torch.Tensor]]] = \
            asyncio.ensure_future(start_call)
        ack_task.add_done_callback(_consume)
        return await self._collect(ack_task, starter, peers, tokens.shape[1])

    async def _collect(self, ack_task: asyncio.Future[tuple[PushAck, dict[str, torch.Tensor]]],
                       starter: int, peers: list[str], new: int) -> StepResult:
        """The step's tokens from the last stage, asked for until they are in; StageLost where
        the answer to the push (`ack_task`, sent to stage `starter`) names a lost stage first,
        or the last stage does not hand over a step the chain says it took."""
        last = len(peers) - 1
        ack: PushAck | None = None
        collect_error: Exception | None = None
        poll: asyncio.Future[tuple[StepOutcome, dict[str, torch.Tensor]]] | None = None
        try:
            while True:
                if poll is None:
                    poll = asyncio.ensure_future(self._call(
                        peers[last], INFERENCE_RESULT, ResultRequest(self.id, self.length),
                        timeout=self.chain.swarm.request_timeout_s))
                waiting = {poll} if ack is not None else {poll, ack_task}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if poll in done:
                    try:
                        outcome, out = poll.result()
                        return self._accept(outcome, out, new, peers)
                    except (RemoteError, MessageLost, TimeoutError) as failure:
                        collect_error = failure  # not in yet, or the last stage is gone
                    except WireError as failure:
                        raise StageLost(last, f"its step's answer: {failure}", own=True,
                                        proof=isinstance(failure, ReplyContentError)) from None
                    poll = None
                if ack is None and ack_task.done():
                    ack = self._chain_answer(ack_task, starter, last)
                if ack is not None and collect_error is not None and poll is None:
                    raise StageLost(last, f"does not hand over a step the chain says it took: "
                                          f"{collect_error}", own=True)
        finally:
            if poll is not None and not poll.done():
                poll.cancel()
                poll.add_done_callback(_consume)

    @staticmethod
    def _chain_answer(ack_task: asyncio.Future[tuple[PushAck, dict[str, torch.Tensor]]],
                      starter: int, last: int) -> PushAck:
        """The answer to the step's push (or resume) at stage `starter`: every stage took it,
        or StageLost for the stage the chain lost."""
        try:
            ack, _ = ack_task.result()
        except PeerRefused as refused:  # alive, but it does not hold the session
            raise StageLost(starter, f"refused: {refused}", own=starter == 0) from None
        except CALL_ERRORS as failure:
            raise StageLost(starter, f"{type(failure).__name__}: {failure}", own=True) from None
        if ack.failed_stage != -1:
            lost = min(max(ack.failed_stage, starter + 1), last)
            raise StageLost(lost, f"by stage {lost - 1}'s account: {ack.detail}", own=False)
        return ack

    async def _push_first(self, peer: str, tokens: torch.Tensor, positions: torch.Tensor,
                          new_valid: torch.Tensor, sampling: SamplingConfig, seed: int | None
                          ) -> tuple[PushAck, dict[str, torch.Tensor]]:
        """Push the step's token ids to stage 0; a replica new to the session gets all of them
        (it rebuilds its cache)."""
        for whole in (False, True):
            parts = [*self.inputs, (tokens, positions, new_valid)] if whole \
                else [(tokens, positions, new_valid)]
            inputs = torch.cat([p[0] for p in parts], 1)
            self.sent_digests.append(chain_digest(row_digests(inputs)))
            # The route goes once per peer and epoch.
            routed = self.routed_to == (peer, self.epoch) and not whole
            push = PushStep(route=b"" if routed else self.signed_route,
                            start=0 if whole else self.length, fresh=tokens.shape[1],
                            session=self.id, sampling=sampling, seed=seed)
            ack, out = await self._call(peer, INFERENCE_PUSH, push, {
                "inputs": inputs, "positions": torch.cat([p[1] for p in parts], 1),
                "key_valid": torch.cat([p[2] for p in parts], 1)}, timeout=self._deadline())
            if not (ack.missing and ack.failed_stage == 0):
                self.routed_to = (peer, self.epoch)
                return ack, out
        return PushAck(0, "does not take the session even whole"), {}

    async def _call(self, peer: str, rpc: Rpc[Req, Rep], body: Req,
                    tensors: dict[str, torch.Tensor] | None = None, timeout: float = 30.0
                    ) -> tuple[Rep, dict[str, torch.Tensor]]:
        """`node.call`, sent again with the same request id when the link lost it (the peer
        answers a request once, its reply cache answers the repeats)."""
        request_id = secrets.token_hex(8)
        for attempt in range(self.chain.swarm.retries):
            try:
                return await self.chain.node.call(peer, rpc, body, tensors, "fp32", timeout,
                                                   request_id)
            except MessageLost:
                await asyncio.sleep(backoff(attempt))
        return await self.chain.node.call(peer, rpc, body, tensors, "fp32", timeout, request_id)

    def _accept(self, outcome: StepOutcome, out: dict[str, torch.Tensor], new: int,
                peers: list[str]) -> StepResult:
        """The step's tokens, once its commitments check out as a chain (the last stage vouches
        for the whole list: it is proof against it when they do not)."""
        last = len(peers) - 1
        try:
            tokens, logprobs = check_samples(out.get("tokens"), out.get("logprobs"), self.batch,
                                             self.chain.vocab_size)
            if outcome.length != self.length + new or len(outcome.commits) != len(peers):
                raise BadReply(f"a cache of {outcome.length} positions and "
                               f"{len(outcome.commits)} commitments")
            commits = [open_commit(raw, peer) for raw, peer in zip(outcome.commits, peers)]
            routing = self._check_commits(commits, new, tokens, logprobs, out)
        except (BadReply, WireError) as bad:
            raise StageLost(last, f"its step's commitments: {bad}", own=True,
                            proof=True) from None
        for stage, (commit, peer) in enumerate(zip(commits, peers)):
            record = self.provenance.stages[stage]
            record.serve(self.length, peer, rebuilt=commit.replayed)
            if stage < last:
                record.commitments.append(Commitment(peer, commit.epoch, commit.start,
                                                     commit.new, commit.outputs,
                                                     peers[stage + 1]))
        return StepResult(tokens, logprobs, tuple(c.version for c in commits), routing)

    def _check_commits(self, commits: list[StepCommit], new: int, tokens: torch.Tensor,
                       logprobs: torch.Tensor,
                       out: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """BadReply unless the commitments are one chain from the tokens sent to those received,
        each of this session, its stage and this step's columns; the step's experts (a mixture
        of experts), each stage's part of them as it committed."""
        last = len(commits) - 1
        for stage, commit in enumerate(commits):
            sent_on = (commit.start, commit.new)
            if commit.id != self.id or commit.stage != stage or commit.epoch > self.epoch \
                    or sent_on not in ((self.length, new), (0, self.length + new)) \
                    or (stage == last and sent_on != (self.length, new)):
                raise BadReply(f"stage {stage}'s commitment is to columns [{commit.start}, "
                               f"{commit.start + commit.new}) of {commit.id} epoch "
                               f"{commit.epoch}")
            if stage > 0 and commit.inputs != commits[stage - 1].outputs:
                raise BadReply(f"stage {stage} committed to inputs stage {stage - 1} never sent")
        if commits[0].inputs not in self.sent_digests:
            raise BadReply("stage 0 committed to inputs the coordinator never sent")
        if commits[last].outputs != chain_digest(row_digests(tokens, logprobs)):
            raise BadReply("the tokens do not match the last stage's commitment")
        experts = self._check_experts(out, new)
        offset = 0
        for stage, commit in enumerate(commits):
            layers = self.chain.stage_sparse_layers[stage]
            part = None if experts is None or not layers \
                else experts[:, :, offset:offset + layers]
            offset += layers
            if commit.experts != tensor_digest(part):
                raise BadReply(f"stage {stage}'s experts do not match its commitment")
        return experts

    def _check_experts(self, out: dict[str, torch.Tensor], new: int) -> torch.Tensor | None:
        moe, layers = self.chain.moe, sum(self.chain.stage_sparse_layers)
        if moe is None or not layers:
            if "experts" in out:
                raise BadReply("a dense model's step came with experts")
            return None
        return check_experts(out.get("experts"), self.batch, new, layers, moe)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.chain.failovers += self.failovers
        for peer in self.peers:
            if peer is not None:
                self.chain.directory.release(peer)
        for peer in self.used:
            try:
                self.chain.node.call_sync(peer, CLOSE_SESSION, CloseSession(session=self.id),
                                          timeout=5)
            except CALL_ERRORS:
                pass  # the peer drops idle sessions itself


def _consume(task: asyncio.Future[Any]) -> None:
    """A call's answer nobody waits for (a push's, when its step's tokens came first; a
    collection given up): errors are logged."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a push answered after its step: %s", task.exception())
