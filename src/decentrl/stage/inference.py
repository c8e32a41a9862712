"""The inference service of a stage peer: Petals-style sessions (a client sends the new
positions' inputs, the peer keeps the session's KV cache and returns the next hidden states, or
samples at the last stage). A reply is its sender's commitment to what it computed: the
envelope is signed, and the coordinator keeps a secret sketch of it (trust/commit.py). The
re-execution of someone else's session at the versions it recorded (a spot-check,
`verify_step`) is stage/verification.py's, in sessions of this table.

A session belongs to the peer that opened it: the table is keyed by (opener, session id), so
only the opener can step, replay or close it, and the same id from another sender is another
session that never touches the opener's. KV caches grow with the positions written
(model/blocks.py LayerCache); what one sender holds is bounded by a budget of sessions and of
cached tokens (batch x positions the caches have room for), refused with PeerBusy (no strike).

Every request runs on the node's compute thread, one at a time, so a weight update written
between two requests (stage/replica.py) is never seen half-applied, and a rewound re-execution
never leaks into a session."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from decentrl.config import RunConfig
from decentrl.model.prefix_cache import PrefixCache
from decentrl.model.stages import Routed, SessionStep, StageCache, StageModule
from decentrl.net.node import Handler, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    CloseSession,
    Empty,
    InferenceReply,
    InferenceStep,
    Rpc,
    VerifyStep,
)
from decentrl.rollout.chain import step_generator
from decentrl.rollout.sampling import sample
from decentrl.stage.batching import Outcome, SessionKey, StepBatcher, StepRequest
from decentrl.stage.inbound import InboundChecks, PeerBusy, PeerError

log = logging.getLogger(__name__)

# Sessions idle this long are dropped (their client is gone); a live client steps far more often.
SESSION_IDLE_S = 300.0



@dataclass
class PreparedStep:
    """A step of a tick, checked, on the compute device."""

    index: int  # its place in the tick
    body: InferenceStep
    session: Session
    inputs: torch.Tensor
    positions: torch.Tensor
    key_valid: torch.Tensor

    @property
    def first(self) -> bool:
        """Whether it starts its session (or replays it from position 0)."""
        return self.body.start == 0


@dataclass
class Session:
    cache: StageCache
    batch: int
    max_length: int
    last_used: float

    @property
    def cached_tokens(self) -> int:
        """Batch x positions its cache has room for: what the sender's budget counts."""
        return self.batch * self.cache.capacity


class InferenceService:
    """Serves one stage's model, and holds the sessions of every request that keeps a KV cache
    here (re-executions too, stage/verification.py)."""

    def __init__(self, config: RunConfig, model: StageModule, node: SwarmNode,
                 checks: InboundChecks) -> None:
        self.config, self.model, self.node, self.checks = config, model, node, checks
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.sessions: dict[SessionKey, Session] = {}
        # The table is written on the compute thread (steps) and the loop thread (closes, idle
        # drops); the per-sender sums read it whole.
        self._sessions_lock = threading.Lock()
        self.served_tokens = 0
        self.busy_s = 0.0  # computing inference requests
        swarm = config.swarm
        self.batcher = StepBatcher(node, self.run_steps, swarm.batch_max_rows,
                                   swarm.batch_wait_s if swarm.batching else 0.0,
                                   max_steps=None if swarm.batching else 1)
        # Sessions' first steps reuse the prompt prefixes earlier sessions ran (not spot-checks:
        # they run rewound weights, stage/verification.py).
        self.prefix_cache = PrefixCache(model, config.swarm.prefix_cache_tokens)
        # Told (on the node's loop) of every session closed or dropped: (opener, session id).
        self.on_close: list[Callable[[str, str], None]] = []

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return [(INFERENCE_STEP, self._inference_step), (CLOSE_SESSION, self._close_session)]

    @property
    def tokens_per_s(self) -> float:
        return self.served_tokens / self.busy_s if self.busy_s > 0 else 0.0

    def free_sessions(self) -> int:
        return max(0, self.config.swarm.max_sessions_per_peer - len(self.sessions))

    def drop_idle_sessions(self) -> None:
        cutoff = time.monotonic() - SESSION_IDLE_S
        with self._sessions_lock:
            dropped = [k for k, session in self.sessions.items() if session.last_used < cutoff]
            for key in dropped:
                del self.sessions[key]
        for key in dropped:
            for listener in self.on_close:
                listener(*key)

    # ---- sessions ------------------------------------------------------------------------

    async def _inference_step(self, request: Request[InferenceStep]) -> Reply:
        return await self.batcher.submit(request.sender, request.body, request.tensors)

    def infer(self, sender: str, body: InferenceStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """One step of `sender`'s session on its own (compute thread)."""
        (outcome,) = self.run_steps([StepRequest(sender, body, tensors)])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def run_steps(self, requests: list[StepRequest]) -> list[Outcome]:
        """One tick (compute thread): every step's reply, or the error it fails with alone.
        Steps that continue their sessions by the same number of positions run as one batched
        forward; a session's first step (or a replay from 0) runs on its own, through the
        prefix cache (model/prefix_cache.py: what earlier sessions computed of the same prompt
        prefixes is reused, and the rows a group repeats run once). Every row gets what it would
        alone, at this tick's weights: an update is applied between ticks."""
        started = time.perf_counter()
        outcomes: list[Outcome | None] = [None] * len(requests)
        prepared: list[PreparedStep] = []
        in_tick: set[SessionKey] = set()
        for index, request in enumerate(requests):
            try:
                prepared.append(self._prepare(index, request, in_tick))
            except Exception as refusal:  # noqa: BLE001 - this step's answer, not the tick's
                outcomes[index] = refusal
        firsts = [step for step in prepared if step.first]
        continuing: dict[int, list[PreparedStep]] = {}
        for step in prepared:
            if not step.first:
                continuing.setdefault(step.inputs.shape[1], []).append(step)
        computed: list[tuple[PreparedStep, Routed]] = []
        with torch.inference_mode():
            for group in [[step] for step in firsts] + list(continuing.values()):
                try:
                    computed.extend(zip(group, self._forward(group), strict=True))
                except Exception as error:  # the answer of this group's steps
                    log.exception("a forward of %d inference steps failed", len(group))
                    for step in group:
                        outcomes[step.index] = error
            for step, reply in zip((step for step, _ in computed), self._replies(computed),
                                   strict=True):
                outcomes[step.index] = reply
        self.served_tokens += sum(step.inputs.shape[0] * step.inputs.shape[1]
                                  for step, _ in computed)
        self.busy_s += time.perf_counter() - started
        assert all(outcome is not None for outcome in outcomes)
        return cast(list[Outcome], outcomes)

    def _prepare(self, index: int, request: StepRequest, in_tick: set[SessionKey]
                 ) -> PreparedStep:
        """A step checked, with its session and room in its cache for its positions."""
        body = request.body
        inputs, positions, key_valid = self.checks.step(body, request.tensors)
        key = (request.sender, body.session)
        if key in in_tick:
            raise PeerBusy(f"session {body.session} already has a step in this tick")
        session = self.session(request.sender, body, inputs.shape[1])
        in_tick.add(key)
        device_inputs = inputs.to(self.device, self.dtype if inputs.is_floating_point() else None)
        return PreparedStep(index, body, session, device_inputs, positions.to(self.device),
                            key_valid.to(self.device))

    def _forward(self, group: list[PreparedStep]) -> list[Routed]:
        """The hidden states of the new positions of each step of `group` (one step alone, or
        steps feeding the same number of positions, batched), and their experts (a stage with
        mixture-of-experts layers). A sparse stage's first step skips the prefix cache: it keeps
        hidden states, not the experts a reply must carry (the model still runs a group's
        repeated rows once)."""
        if len(group) == 1:
            step = group[0]
            if step.first and not self.model.num_sparse:
                return [Routed(self.prefix_cache.prefill(step.inputs, step.positions,
                                                         step.key_valid, step.session.cache),
                               None)]
            return [self.model.body_routed(step.inputs, step.positions, step.key_valid,
                                           step.session.cache)]
        return self.model.body_sessions_routed([
            SessionStep(step.inputs, step.positions, step.key_valid, step.session.cache)
            for step in group])

    def _replies(self, computed: list[tuple[PreparedStep, Routed]]) -> list[Reply]:
        """The replies of the steps computed: their hidden states, or at the last stage the
        tokens sampled from every row's last position (one batch through the head, then each
        step's own sampling and seed); and their experts, from a sparse stage (int8/int16,
        never compressed)."""
        version = self.model.version
        if not self.model.is_last:
            return [Reply(InferenceReply(version=version, length=step.session.cache.length),
                          {"hidden": routed.output.cpu(), **_experts(routed)},
                          self.config.swarm.activation_codec)
                    for step, routed in computed]
        if not computed:
            return []
        logits = self.model.head(torch.cat([routed.output[:, -1] for _, routed in computed]))
        replies, row = [], 0
        for step, routed in computed:
            rows = logits[row:row + step.body.batch]
            row += step.body.batch
            assert step.body.sampling is not None  # checked
            tokens, logprobs = sample(rows, step.body.sampling, step_generator(step.body.seed))
            # Log-probs are [B] floats the trainer's importance ratios use: never compressed.
            replies.append(Reply(
                InferenceReply(version=version, length=step.session.cache.length),
                {"tokens": tokens.cpu(), "logprobs": logprobs.float().cpu(), **_experts(routed)},
                "fp32"))
        return replies

    def session(self, sender: str, body: InferenceStep | VerifyStep, new: int) -> Session:
        """`sender`'s session that a step of `new` positions continues (opened by its first
        step), checked against it, with room in its cache for those positions."""
        key = (sender, body.session)
        with self._sessions_lock:
            session = self.sessions.get(key)
            if session is not None and body.start == 0:
                # A replay from position 0: the client gave up on this peer (a timeout) and came
                # back to it, so the session it still holds is stale; rebuild it from the replay.
                del self.sessions[key]
                session = None
            if session is None:
                if body.start != 0:
                    raise PeerBusy(f"unknown session {body.session} (expired or never opened "
                                   "here); replay it from position 0")
                self._check_room(sender)
                session = Session(self.model.new_cache(body.batch, body.max_length), body.batch,
                                  body.max_length, time.monotonic())
            if (body.batch, body.max_length) != (session.batch, session.max_length):
                raise PeerError(f"session {body.session} was opened with batch {session.batch} "
                                f"and max_length {session.max_length}")
            if body.start != session.cache.length:
                raise PeerBusy(f"session {body.session} holds {session.cache.length} positions, "
                               f"the request starts at {body.start}")
            self._check_budget(sender, key, session, body.start + new)
            self.sessions[key] = session
            session.last_used = time.monotonic()
        # Grown here, within the budget just checked, rather than deep inside the forward pass.
        session.cache.reserve(body.start + new)
        return session

    def _check_room(self, sender: str) -> None:
        """Refuse a new session past the peer's cap or `sender`'s (under the table's lock)."""
        swarm = self.config.swarm
        if len(self.sessions) >= swarm.max_sessions_per_peer:
            raise PeerBusy(f"peer is full ({len(self.sessions)} sessions)")
        held = sum(owner == sender for owner, _ in self.sessions)
        if held >= swarm.max_sessions_per_sender:
            raise PeerBusy(f"sender {sender[-8:]} holds {held} sessions here, the most "
                           f"swarm.max_sessions_per_sender ({swarm.max_sessions_per_sender}) "
                           "allows")

    def _check_budget(self, sender: str, key: SessionKey, session: Session, length: int) -> None:
        """Refuse a step that would grow `sender`'s caches past its budget of cached tokens, or
        every session's past the peer's KV pool (under the table's lock)."""
        swarm = self.config.swarm
        grown = session.batch * session.cache.capacity_for(length)
        senders = pool = grown
        for other_key, other in self.sessions.items():
            if other_key != key:
                pool += other.cached_tokens
                senders += other.cached_tokens if other_key[0] == sender else 0
        if senders > swarm.max_cached_tokens_per_sender:
            raise PeerBusy(f"sender {sender[-8:]} would hold {senders} cached tokens (batch x "
                           f"positions) here, over swarm.max_cached_tokens_per_sender "
                           f"({swarm.max_cached_tokens_per_sender})")
        if pool > swarm.kv_pool_tokens:
            raise PeerBusy(f"the KV pool is full: its sessions would hold {pool} cached tokens "
                           f"(batch x positions), over swarm.kv_pool_tokens "
                           f"({swarm.kv_pool_tokens})")

    async def _close_session(self, request: Request[CloseSession]) -> Reply:
        with self._sessions_lock:
            self.sessions.pop((request.sender, request.body.session), None)
        self.batcher.forget(request.sender, request.body.session)
        for listener in self.on_close:
            listener(request.sender, request.body.session)
        return Reply(Empty())


def _experts(routed: Routed) -> dict[str, torch.Tensor]:
    """A reply's `experts` tensor (a sparse stage's routing of the positions computed); none
    from a dense stage."""
    return {} if routed.experts is None else {"experts": routed.experts.cpu()}
