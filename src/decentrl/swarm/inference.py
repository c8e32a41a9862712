"""The inference service of a stage peer: Petals-style sessions (a client sends the new
positions' inputs, the peer keeps the session's KV cache and returns the next hidden states, or
samples at the last stage). A reply is its sender's commitment to what it computed: the
envelope is signed, and the coordinator keeps a secret sketch of it (trust/commit.py). The
re-execution of someone else's session at the versions it recorded (a spot-check,
`verify_step`) is swarm/verification.py's, in sessions of this table.

A session belongs to the peer that opened it: the table is keyed by (opener, session id), so
only the opener can step, replay or close it, and the same id from another sender is another
session that never touches the opener's. KV caches grow with the positions written
(model/blocks.py LayerCache); what one sender holds is bounded by a budget of sessions and of
cached tokens (batch x positions the caches have room for), refused with PeerBusy (no strike).

Every request runs on the node's compute thread, one at a time, so a weight update written
between two requests (swarm/replica.py) is never seen half-applied, and a rewound re-execution
never leaks into a session."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from decentrl.config import RunConfig
from decentrl.model.prefix_cache import PrefixCache
from decentrl.model.stages import StageCache, StageModule
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
from decentrl.rollout.chain import last_position, step_generator
from decentrl.rollout.sampling import sample
from decentrl.swarm.inbound import InboundChecks, PeerBusy, PeerError

# Sessions idle this long are dropped (their client is gone); a live client steps far more often.
SESSION_IDLE_S = 300.0


# A session's key: (the peer that opened it, the id it chose).
SessionKey = tuple[str, str]


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
    here (re-executions too, swarm/verification.py)."""

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
        # Sessions' first steps reuse the prompt prefixes earlier sessions ran (not spot-checks:
        # they run rewound weights, swarm/verification.py).
        self.prefix_cache = PrefixCache(model, config.swarm.prefix_cache_tokens)

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return [(INFERENCE_STEP, self._inference_step), (CLOSE_SESSION, self._close_session)]

    @property
    def tokens_per_s(self) -> float:
        return self.served_tokens / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def prefix_hits_tokens(self) -> int:
        """Row x positions of first steps taken from the prefix cache."""
        return self.prefix_cache.reused_tokens

    @property
    def prefill_tokens_computed(self) -> int:
        """Row x positions of first steps computed (each distinct row once)."""
        return self.prefix_cache.computed_tokens

    def free_sessions(self) -> int:
        return max(0, self.config.swarm.max_sessions_per_peer - len(self.sessions))

    def drop_idle_sessions(self) -> None:
        cutoff = time.monotonic() - SESSION_IDLE_S
        with self._sessions_lock:
            for key in [k for k, session in self.sessions.items() if session.last_used < cutoff]:
                del self.sessions[key]

    # ---- sessions ------------------------------------------------------------------------

    async def _inference_step(self, request: Request[InferenceStep]) -> Reply:
        return await self.node.compute(self.infer, request.sender, request.body, request.tensors)

    def infer(self, sender: str, body: InferenceStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """One step of `sender`'s session (compute thread)."""
        started = time.perf_counter()
        inputs, positions, key_valid = self.checks.step(body, tensors)
        session = self.session(sender, body, inputs.shape[1])
        device_inputs = inputs.to(self.device, self.dtype if inputs.is_floating_point() else None)
        with torch.inference_mode():
            forward = self.prefix_cache.prefill if body.start == 0 else self.model.body
            hidden = forward(device_inputs, positions.to(self.device), key_valid.to(self.device),
                             session.cache)
            if self.model.is_last:
                assert body.sampling is not None  # checked
                out = self.model.head(hidden[last_position(inputs)])
                tokens, logprobs = sample(out, body.sampling, step_generator(body.seed))
                result = {"tokens": tokens.cpu(), "logprobs": logprobs.float().cpu()}
            else:
                result = {"hidden": hidden.cpu()}
        self.served_tokens += inputs.shape[0] * inputs.shape[1]
        self.busy_s += time.perf_counter() - started
        reply = InferenceReply(version=self.model.version, length=session.cache.length)
        # Log-probs are [B] floats the trainer's importance ratios use: never compressed.
        codec = "fp32" if self.model.is_last else self.config.swarm.activation_codec
        return Reply(reply, result, codec)

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
        """Refuse a step that would grow `sender`'s caches past its budget of cached tokens
        (under the table's lock)."""
        budget = self.config.swarm.max_cached_tokens_per_sender
        others = sum(other.cached_tokens for other_key, other in self.sessions.items()
                     if other_key[0] == sender and other_key != key)
        held = others + session.batch * session.cache.capacity_for(length)
        if held > budget:
            raise PeerBusy(f"sender {sender[-8:]} would hold {held} cached tokens (batch x "
                           f"positions) here, over swarm.max_cached_tokens_per_sender ({budget})")

    async def _close_session(self, request: Request[CloseSession]) -> Reply:
        with self._sessions_lock:
            self.sessions.pop((request.sender, request.body.session), None)
        return Reply(Empty())
