"""Generation sessions whose activations travel from stage to stage (`swarm.data_plane =
"peer_to_peer"`; the coordinator's side is client/push_sessions.py, the messages net/
push_messages.py).

The coordinator signs a session's route (one peer per stage) and pushes each step's token ids to
stage 0. A stage computes the step in its inference service's batches (stage/inference.py: the
same sessions, KV caches and budgets as a relayed session, keyed by the run's owner), signs its
`StepCommit` and pushes its output to the next stage of the route, with the earlier stages'
commitments; the last stage samples and keeps the step's tokens and every commitment until the
coordinator collects them (`inference_result`). A push is answered once the rest of the chain
answered (`PushAck`: which later stage failed, if one did); the coordinator does not wait for
that answer when the step's tokens come first.

What a stage takes: a push only for a route its owner signed that names this peer at this stage,
only from the peer named before it (stage 0: the owner), whose tensors hash to the digests that
peer signed; else a strike (PeerError). A start-0 push into a session it holds under the same
route epoch (a rebuild nobody asked for) is struck too. What it keeps: the session's mask and
positions, and every output it sent on (`Segment`), for a failover's replay (`inference_resume`:
the coordinator replaced the next stage, which is rebuilt from what this stage kept) and for a
spot-check's reveal; kept while the session lives and `trust.reveal_window_s` after it closed,
within `swarm.kept_activations_mb`, past which new sessions are refused (PeerBusy), never
forgotten early: a peer that cannot reveal what it signed is blamed."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from decentrl.config import RunConfig
from decentrl.model.stages import StagePlan
from decentrl.net.directory import backoff
from decentrl.net.link import MessageLost
from decentrl.net.node import Handler, RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    INFERENCE_PUSH,
    INFERENCE_RESULT,
    INFERENCE_RESUME,
    REVEAL,
    InferenceStep,
    Rpc,
)
from decentrl.net.push_messages import (
    MAX_REVEALED_STEPS,
    PushAck,
    PushStep,
    ResultRequest,
    ResumeRequest,
    Revealed,
    RevealRequest,
    SessionRoute,
    StepCommit,
    StepOutcome,
    chain_digest,
    open_commit,
    open_route,
    row_digests,
    sign_commit,
    tensor_digest,
    wire_form,
)
from decentrl.net.session import OwnerSession
from decentrl.net.wire import ActivationCodec, WireError
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.inbound import PeerBusy, PeerError
from decentrl.stage.inference import SESSION_IDLE_S, InferenceService
from decentrl.trust.relay import BadReply, check_experts

log = logging.getLogger(__name__)

# Steps the coordinator may wait for at once per session (the step it waits for and a retry).
RESULTS_PER_SESSION = 2


@dataclass
class Segment:
    """Outputs of columns [start, start + new) of a session, in their wire form; `sent`: pushed on
    to the next stage (what a reveal shows), else computed and kept for a replay only."""

    epoch: int
    start: int
    output: torch.Tensor  # [B, new, hidden]
    sent: bool

    @property
    def new(self) -> int:
        return self.output.shape[1]


@dataclass
class PushedSession:
    """What a stage keeps of one session it computes in a route."""

    route: SessionRoute
    key_valid: torch.Tensor  # [B, L] the session's key mask so far
    positions: torch.Tensor  # [B, L]
    signed_route: bytes = b""  # the route as its owner signed it (passed on to the next stage)
    routed_to: tuple[str, int] | None = None  # the next peer that holds the route, and its epoch
    segments: list[Segment] = field(default_factory=list)
    # What the previous stage pushed (checked against its commitments), under the epoch of its
    # commitment: a reveal of its outputs where it cannot reveal them itself (it left).
    received: list[Segment] = field(default_factory=list)
    # The last step's: its first new column, the earlier stages' commitments, this stage's
    # input digest and sampling; what a resume sends on again.
    step_start: int = 0
    commits: list[bytes] = field(default_factory=list)
    input_digest: bytes = b""
    sampling: SamplingConfig | None = None
    seed: int | None = None
    version: int = -1  # the weights that computed the last step
    routing: torch.Tensor | None = None  # the last step's experts up to this stage
    experts: bytes = b""  # the digest of this stage's own experts of the last step
    last_used: float = field(default_factory=time.monotonic)
    closed_at: float | None = None

    @property
    def length(self) -> int:
        return self.key_valid.shape[1]

    @property
    def kept_bytes(self) -> int:
        return sum(s.output.nbytes for s in (*self.segments, *self.received)) \
            + self.key_valid.nbytes + self.positions.nbytes

    def columns(self) -> torch.Tensor:
        """Every column's latest output [B, L, hidden] (a replay's rebuild overrides what came
        before it)."""
        first = self.segments[0].output
        out = torch.empty((first.shape[0], self.length, first.shape[2]), dtype=first.dtype)
        for segment in self.segments:
            out[:, segment.start:segment.start + segment.new] = segment.output
        return out


def check_route(what: str, run: str, session: str, peers: list[str], config: RunConfig,
                run_session: str | None, stage: int, peer: str) -> None:
    """PeerError unless an owner-signed route (`what`) is of this run, names one peer a stage
    and `peer` at `stage`; PeerBusy where it is of another start of the run than the owner's
    manifest says (`run_session`, when known)."""
    if run != config.name or len(peers) != config.num_stages:
        raise PeerError(f"a {what} of run {run!r} with {len(peers)} stages")
    if run_session is not None and session != run_session:
        raise PeerBusy(f"a {what} of run session {session[:8]}, not the manifest's "
                       f"{run_session[:8]}")
    if peers[stage] != peer:
        raise PeerError(f"the {what} names {peers[stage][-8:]} at stage {stage}, not this peer")


def exact_codec(tensor: torch.Tensor) -> ActivationCodec:
    """The codec that sends a tensor already in its wire form unchanged."""
    return "bf16" if tensor.dtype == torch.bfloat16 else "fp32"


class PushService:
    """A stage peer's side of peer-to-peer sessions, over its inference service."""

    def __init__(self, config: RunConfig, stage: int, inference: InferenceService,
                 node: SwarmNode, owner: str, run_session: OwnerSession) -> None:
        self.config, self.stage, self.inference, self.node = config, stage, inference, node
        self.owner, self.run_session = owner, run_session
        self.last = stage == config.num_stages - 1
        self.codec: ActivationCodec = config.swarm.activation_codec
        self.sessions: dict[str, PushedSession] = {}  # by session id (the owner's)
        # The last stage's sampled steps, by (session, first new column), until collected.
        self.results: dict[tuple[str, int], asyncio.Future[tuple[StepOutcome,
                                                                  dict[str, torch.Tensor]]]] = {}
        # The sparse layers of the stages before this one, whose experts a push carries.
        spec = inference.checks.spec
        plan = StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
        self.routed_before = spec.sparse_before(plan.layers(stage).start)
        inference.on_close.append(self.closed)

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return [(INFERENCE_PUSH, self._push), (INFERENCE_RESULT, self._result),
                (INFERENCE_RESUME, self._resume), (REVEAL, self._reveal)]

    @property
    def kept_bytes(self) -> int:
        return sum(state.kept_bytes for state in self.sessions.values())

    def closed(self, owner: str, session: str) -> None:
        """The inference service closed or dropped `session`: keep its outputs for reveals."""
        state = self.sessions.get(session)
        if owner == self.owner and state is not None and state.closed_at is None:
            state.closed_at = time.monotonic()
        for key in [k for k in self.results if k[0] == session]:
            _settle(self.results.pop(key), PeerBusy(f"session {session} was closed"))

    def expire(self, now: float | None = None) -> None:
        """Forget sessions closed longer than the reveal window ago, or idle past it."""
        now = time.monotonic() if now is None else now
        window = self.config.trust.reveal_window_s
        for session, state in list(self.sessions.items()):
            ended = state.closed_at if state.closed_at is not None \
                else state.last_used + SESSION_IDLE_S
            if now - ended > window:
                del self.sessions[session]

    # ---- a pushed step -------------------------------------------------------------------

    async def _push(self, request: Request[PushStep]) -> Reply:
        body, tensors = request.body, request.tensors
        if body.route:
            route = await self._route(body.route)
        else:
            held = self.sessions.get(body.session)
            if held is None or held.closed_at is not None:
                return Reply(PushAck(self.stage, f"session {body.session} is not held here",
                                     missing=True))
            route = held.route
        expected = self.owner if self.stage == 0 else route.peers[self.stage - 1]
        if request.sender != expected:
            raise PeerError(f"a push of session {route.id} from {request.sender[-8:]}: its "
                            f"route names {expected[-8:]} before stage {self.stage}")
        inputs, positions, new_valid = tensors["inputs"], tensors["positions"], tensors["key_valid"]
        fresh = body.fresh or inputs.shape[1]
        if not 1 <= fresh <= inputs.shape[1] or new_valid.shape != positions.shape:
            raise PeerError(f"a push of {inputs.shape[1]} columns with {fresh} new, positions "
                            f"{tuple(positions.shape)} and key_valid {tuple(new_valid.shape)}")
        self._check_inputs(route, inputs)
        input_digest, previous = self._check_commits(route, body, inputs)
        state = self.sessions.get(route.id)
        if body.start == 0:
            if state is not None and state.route.epoch == route.epoch \
                    and state.closed_at is None and inputs.shape[1] == fresh:
                raise PeerError(f"session {route.id} opened twice under route epoch "
                                f"{route.epoch}")
            if state is None:
                self._check_room()
            key_valid = new_valid
        elif state is None or state.closed_at is not None or state.length != body.start:
            # Not held here (a replica new to the session), or not as far: resend it whole.
            return Reply(PushAck(self.stage, f"holds {0 if state is None else state.length} "
                                             f"columns of session {route.id}", missing=True))
        elif route.epoch < state.route.epoch:
            raise PeerBusy(f"a push of session {route.id} under route epoch {route.epoch}, "
                           f"older than {state.route.epoch}")
        else:
            key_valid = torch.cat([state.key_valid, new_valid], 1)
        step = InferenceStep(session=route.id, start=body.start, batch=route.batch,
                             max_length=route.max_length, sampling=body.sampling,
                             seed=body.seed)
        reply = await self.inference.batcher.submit(
            self.owner, step, {"inputs": inputs, "positions": positions, "key_valid": key_valid})
        if state is None:
            state = PushedSession(route, key_valid, positions, signed_route=body.route)
            self.sessions[route.id] = state
        elif body.start == 0:  # rebuilt: what it sent before stays kept for reveals
            state.key_valid, state.positions = key_valid, positions
        else:
            state.key_valid = key_valid
            state.positions = torch.cat([state.positions, positions], 1)
        if previous is not None:
            state.received.append(Segment(previous.epoch, body.start, inputs, sent=True))
        version: int = reply.body.version
        state.route, state.last_used, state.version = route, time.monotonic(), version
        state.signed_route = body.route or state.signed_route
        state.step_start = body.start + inputs.shape[1] - fresh
        state.commits, state.input_digest = list(body.commits), input_digest
        state.sampling, state.seed = body.sampling, body.seed
        out = reply.tensors or {}
        experts = out.get("experts")
        state.routing = self._routing(tensors.get("routing"), experts, fresh, route.batch)
        state.experts = tensor_digest(None if experts is None else experts[:, -fresh:])
        rebuilt = body.start == 0 and inputs.shape[1] > fresh
        if self.last:
            return self._sampled(state, out, reply.body.length, fresh, rebuilt)
        hidden = out["hidden"]
        kept = wire_form(hidden, self.codec)
        if rebuilt:  # every column recomputed, the new ones sent on
            state.segments.append(Segment(route.epoch, 0, kept, sent=False))
        return await self._send_on(state, hidden[:, -fresh:], kept[:, -fresh:], self.codec,
                                   rebuilt)

    async def _send_on(self, state: PushedSession, send: torch.Tensor, sent: torch.Tensor,
                       codec: ActivationCodec, rebuilt: bool) -> Reply:
        """Push the last step's new columns (`send`, which the next stage decodes as `sent`) to
        the route's next stage, with this stage's signed commitment; where the next stage does
        not hold the session, the whole session. Answers with what the rest of the chain
        answered."""
        start = state.step_start
        state.segments.append(Segment(state.route.epoch, start, sent, sent=True))
        ack = await self._push_next(state, send, sent, start, codec, rebuilt)
        if ack.missing and ack.failed_stage == self.stage + 1:
            whole = state.columns()
            state.segments.append(Segment(state.route.epoch, 0, whole, sent=True))
            ack = await self._push_next(state, whole, whole, 0, exact_codec(whole), rebuilt,
                                        with_route=True)
            if ack.missing:
                ack = PushAck(self.stage + 1, "does not take the session even whole")
        if ack.failed_stage != -1 and ack.failed_stage <= self.stage:
            # A later stage blaming this one or one before it: its own account is what failed.
            ack = PushAck(self.stage + 1, f"answered nonsense: {ack.detail}"[:500])
        return Reply(ack)

    async def _push_next(self, state: PushedSession, send: torch.Tensor, sent: torch.Tensor,
                         start: int, codec: ActivationCodec, rebuilt: bool,
                         with_route: bool = False) -> PushAck:
        """One push to the next stage; the route goes along unless that peer took it already
        under this epoch."""
        end = start + send.shape[1]
        next_peer = state.route.peers[self.stage + 1]
        routed = state.routed_to == (next_peer, state.route.epoch) and not with_route
        commit = StepCommit(state.route.id, state.route.epoch, self.stage, start,
                            send.shape[1], state.version, state.input_digest,
                            chain_digest(row_digests(sent)), state.experts, replayed=rebuilt)
        push = PushStep(route=b"" if routed else state.signed_route, start=start,
                        fresh=state.length - state.step_start, session=state.route.id,
                        commits=[*state.commits, sign_commit(self.node.identity, commit)],
                        sampling=state.sampling, seed=state.seed)
        tensors = {"inputs": send, "positions": state.positions[:, start:end],
                   "key_valid": state.key_valid[:, start:end]}
        if state.routing is not None:
            tensors["routing"] = state.routing
        # Each stage waits for the rest of the chain: the deeper the call, the shorter its wait,
        # so the stage that did not answer is the one named.
        timeout = self.config.swarm.request_timeout_s \
            * (self.config.num_stages - 1 - self.stage)
        request_id = secrets.token_hex(8)
        for attempt in range(self.config.swarm.retries + 1):
            try:
                ack, _ = await self.node.call(next_peer, INFERENCE_PUSH, push, tensors, codec,
                                              timeout, request_id)
                break
            except MessageLost as lost:  # the same request again: the peer answers it once
                failure: Exception = lost
                await asyncio.sleep(backoff(attempt))
            except (RemoteError, WireError, TimeoutError) as error:
                return PushAck(self.stage + 1, f"{type(error).__name__}: {error}"[:500])
        else:
            return PushAck(self.stage + 1, f"{type(failure).__name__}: {failure}"[:500])
        if not ack.missing:
            state.routed_to = (next_peer, state.route.epoch)
        return ack

    def _sampled(self, state: PushedSession, out: dict[str, torch.Tensor], length: int,
                 fresh: int, replayed: bool) -> Reply:
        """The last stage: keep the sampled step and every commitment until collected."""
        tokens, logprobs = out["tokens"], out["logprobs"].float()
        commit = StepCommit(state.route.id, state.route.epoch, self.stage, state.step_start,
                            fresh, state.version, state.input_digest,
                            chain_digest(row_digests(tokens, logprobs)), state.experts,
                            replayed=replayed)
        outcome = StepOutcome(version=state.version, length=length, commits=[
            *state.commits, sign_commit(self.node.identity, commit)])
        found = {"tokens": tokens, "logprobs": logprobs}
        if state.routing is not None:
            found["experts"] = state.routing
        session = state.route.id
        for key in [k for k in self.results if k[0] == session and k[1] < state.step_start]:
            _settle(self.results.pop(key), PeerBusy(f"step {key[1]} of session {session} was "
                                                    "not collected before the next"))
        future = self.results.get((session, state.step_start))
        if future is None or future.done():
            future = self.node.loop.create_future()
            self.results[(session, state.step_start)] = future
        future.set_result((outcome, found))
        return Reply(PushAck())

    async def _result(self, request: Request[ResultRequest]) -> Reply:
        """The coordinator collects a sampled step (waiting for it, a while, if it is not in)."""
        if not self.last:
            raise PeerError(f"stage {self.stage} samples nothing: ask the last stage")
        # A waiter for a step not pushed yet (asked for as the step starts), bounded per session
        # and in all.
        key = (request.body.id, request.body.start)
        future = self.results.get(key)
        if future is None:
            waiting = sum(k[0] == key[0] for k in self.results)
            limit = RESULTS_PER_SESSION * self.config.swarm.max_sessions_per_peer
            if waiting >= RESULTS_PER_SESSION or len(self.results) >= limit:
                raise PeerBusy(f"too many steps awaited here ({len(self.results)})")
            future = self.node.loop.create_future()
            self.results[key] = future
        wait_s = self.config.swarm.request_timeout_s / 2
        try:
            outcome, tensors = await asyncio.wait_for(asyncio.shield(future), wait_s)
        except TimeoutError:
            raise PeerBusy(f"step {key[1]} of session {key[0]} has not reached the last stage "
                           f"within {wait_s:.0f}s") from None
        # Kept until the next step's arrives (or the session closes): an answer lost on the way
        # is asked for again.
        return Reply(outcome, exact=tensors)

    async def _resume(self, request: Request[ResumeRequest]) -> Reply:
        """The next stage was replaced: send it the whole session (it rebuilds its cache)."""
        body = request.body
        if self.last:
            raise PeerError("the last stage pushes to nobody")
        route = await self._route(body.route)
        state = self.sessions.get(route.id)
        if state is None or state.closed_at is not None or not state.segments:
            raise PeerBusy(f"session {route.id} is not held here")
        if route.epoch <= state.route.epoch or body.start != state.step_start:
            raise PeerBusy(f"a resume of session {route.id} at column {body.start} under epoch "
                            f"{route.epoch}; it holds {state.length} columns, its last step "
                            f"from {state.step_start}, epoch {state.route.epoch}")
        state.route, state.last_used = route, time.monotonic()
        state.signed_route = body.route
        last_step = state.columns()[:, state.step_start:]
        return await self._send_on(state, last_step, last_step, exact_codec(last_step),
                                   rebuilt=False)

    # ---- reveals -------------------------------------------------------------------------

    async def _reveal(self, request: Request[RevealRequest]) -> Reply:
        body = request.body
        state = self.sessions.get(body.id)
        kept = [] if state is None else state.received if body.received \
            else [s for s in state.segments if s.sent]
        by_step = {(s.epoch, s.start, s.new): s for s in kept}
        side = "received" if body.received else "sent"
        if not 1 <= len(body.steps) <= MAX_REVEALED_STEPS:
            raise PeerError(f"a reveal of {len(body.steps)} steps (1 to {MAX_REVEALED_STEPS})")
        found = []
        for step in body.steps:
            segment = by_step.get(step)
            if segment is None:
                raise PeerBusy(f"session {body.id}: no {side} step {step} is kept here")
            found.append(segment)
        batch = found[0].output.shape[0]
        columns = sum(s.new for s in found)
        if not (0 <= body.first_row and 1 <= body.rows and body.first_row + body.rows <= batch) \
                or body.rows * columns > self.config.swarm.max_session_tokens:
            raise PeerError(f"rows [{body.first_row}, {body.first_row + body.rows}) of "
                            f"{columns} columns of a session of {batch} rows")
        rows = slice(body.first_row, body.first_row + body.rows)
        outputs = torch.cat([s.output[rows] for s in found], 1)
        return Reply(Revealed([row_digests(s.output) for s in found]), {"outputs": outputs},
                     exact_codec(outputs))

    # ---- checks --------------------------------------------------------------------------

    async def _route(self, signed: bytes) -> SessionRoute:
        """The owner's route, for this run and session, naming this peer at this stage."""
        route = open_route(signed, self.owner)
        check_route("route", route.run, route.session, route.peers, self.config,
                    await self.run_session.against(route.session), self.stage,
                    self.node.peer_id)
        return route

    def _check_inputs(self, route: SessionRoute, inputs: torch.Tensor) -> None:
        """The stage's kind of inputs for the route's batch, before anything else is done with
        them (the rest is checked with the session, stage/inbound.py)."""
        self.inference.checks.pushed_inputs(inputs)
        if inputs.shape[0] != route.batch:
            raise PeerError(f"a push of {inputs.shape[0]} rows into a session of {route.batch}")

    def _check_commits(self, route: SessionRoute, body: PushStep, inputs: torch.Tensor
                       ) -> tuple[bytes, StepCommit | None]:
        """This stage's input digest and the previous stage's commitment (stage 0: none), once
        every earlier stage's commitment is its own, to this
        session and step, and one chain: each stage's inputs its predecessor's outputs, and the
        previous stage's outputs the inputs pushed. The last stage vouches for the whole list
        to the coordinator, so each stage checks all of it."""
        if len(body.commits) != self.stage:
            raise PeerError(f"a push to stage {self.stage} carries {len(body.commits)} "
                            "commitments")
        if self.stage == 0:
            return chain_digest(row_digests(inputs)), None
        commits = [open_commit(raw, route.peers[stage]) for stage, raw in enumerate(body.commits)]
        for stage, commit in enumerate(commits):
            if commit.id != route.id or commit.stage != stage or commit.epoch > route.epoch:
                raise PeerError(f"stage {stage}'s commitment is to stage {commit.stage} of "
                                f"session {commit.id} epoch {commit.epoch}")
            if stage > 0 and commit.inputs != commits[stage - 1].outputs:
                raise PeerError(f"stage {stage} committed to inputs stage {stage - 1} never "
                                "sent")
        previous = commits[-1]
        if (previous.start, previous.new) != (body.start, inputs.shape[1]):
            raise PeerError(f"stage {self.stage - 1}'s commitment is to columns "
                            f"[{previous.start}, {previous.start + previous.new}), the push to "
                            f"[{body.start}, {body.start + inputs.shape[1]})")
        if previous.outputs != chain_digest(row_digests(inputs)):
            raise PeerError(f"the pushed inputs do not hash to what stage {self.stage - 1} "
                            "signed")
        return previous.outputs, previous

    def _check_room(self) -> None:
        self.expire()
        budget = int(self.config.swarm.kept_activations_mb * 2**20)
        if self.kept_bytes >= budget:
            raise PeerBusy(f"this peer keeps {self.kept_bytes} bytes of sent activations for "
                           f"reveals, swarm.kept_activations_mb allows {budget}")

    def _routing(self, before: torch.Tensor | None, experts: torch.Tensor | None, fresh: int,
                 batch: int) -> torch.Tensor | None:
        """The experts of the step's new columns at every stage so far (a mixture of experts):
        the earlier stages', checked as the coordinator checks a relayed reply's, then this
        stage's own."""
        spec = self.inference.checks.spec
        if self.routed_before == 0 or spec.moe is None:
            if before is not None:
                raise PeerError(f"routing from stages before {self.stage}, which have no "
                                "sparse layer")
        else:
            try:
                check_experts(before, batch, fresh, self.routed_before, spec.moe)
            except BadReply as bad:
                raise PeerError(f"routing of stages before {self.stage}: {bad}") from None
        own = None if experts is None else experts[:, -fresh:]
        parts = [t for t in (before, own) if t is not None]
        return torch.cat(parts, 2) if len(parts) == 2 else (parts[0] if parts else None)


def _settle(future: asyncio.Future[Any], error: Exception) -> None:
    """End a kept step's future with `error` for whoever still waits on it (and nobody else:
    the error counts as seen)."""
    if not future.done():
        future.set_exception(error)
        future.exception()
