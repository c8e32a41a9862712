"""The inference service of a stage peer: Petals-style sessions (a client sends the new
positions' inputs, the peer keeps the session's KV cache and returns the next hidden states, or
samples at the last stage), and the re-execution of someone else's session at the versions it
recorded (a spot-check, `verify_step`). A reply is its sender's commitment to what it computed:
the envelope is signed, and the coordinator keeps a secret sketch of it (trust/commit.py).

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
from decentrl.model.stages import StageCache, StageModule
from decentrl.net.node import Handler, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    VERIFY_STEP,
    CloseSession,
    Empty,
    InferenceReply,
    InferenceStep,
    Rpc,
    VerifyReply,
    VerifyStep,
)
from decentrl.rollout.chain import last_position, step_generator
from decentrl.rollout.generate import step_seed
from decentrl.rollout.sampling import sample, sampling_margin, sampling_noise, transformed_logits
from decentrl.swarm.inbound import InboundChecks, PeerBusy, PeerError
from decentrl.sync.history import UpdateHistory, VersionUnavailable

# Sessions idle this long are dropped (their client is gone); a live client steps far more often.
SESSION_IDLE_S = 300.0
# Re-execution scores are bounded so that they can travel (messages carry finite floats only).
SCORE_BOUND = 1e4


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
    """Serves one stage's model. `history` (a replica's undo information of its last updates)
    makes it a verifier too: it can rewind its weights to a version a rollout recorded."""

    def __init__(self, config: RunConfig, model: StageModule, node: SwarmNode,
                 checks: InboundChecks, history: UpdateHistory | None) -> None:
        self.config, self.model, self.node, self.checks = config, model, node, checks
        self.history = history
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.sessions: dict[SessionKey, Session] = {}
        # The table is written on the compute thread (steps) and the loop thread (closes, idle
        # drops); the per-sender sums read it whole.
        self._sessions_lock = threading.Lock()
        self.served_tokens = 0
        self.busy_s = 0.0  # computing inference requests
        self.verify_busy_s = 0.0  # re-executing others' work (spot-checks)

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        served: list[tuple[Rpc[Any, Any], Handler[Any]]] = [
            (INFERENCE_STEP, self._inference_step), (CLOSE_SESSION, self._close_session)]
        if self.history is not None:
            served.append((VERIFY_STEP, self._verify_step))
        return served

    @property
    def tokens_per_s(self) -> float:
        return self.served_tokens / self.busy_s if self.busy_s > 0 else 0.0

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
        session = self._session(sender, body, inputs.shape[1])
        device_inputs = inputs.to(self.device, self.dtype if inputs.is_floating_point() else None)
        with torch.inference_mode():
            hidden = self.model.body(device_inputs, positions.to(self.device),
                                     key_valid.to(self.device), session.cache)
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

    def _session(self, sender: str, body: InferenceStep | VerifyStep, new: int) -> Session:
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

    # ---- spot-checks of other replicas' work ---------------------------------------------

    async def _verify_step(self, request: Request[VerifyStep]) -> Reply:
        return await self.node.compute(self._verify, request.sender, request.body,
                                       request.tensors)

    def _verify(self, sender: str, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """Re-execute a segment of someone else's session, teacher-forced, at the version it
        recorded: rewind this replica's weights, run the stage, put the weights back (all on the
        compute thread, so no inference request sees the rewound weights)."""
        started = time.perf_counter()
        try:
            return self._reexecute(sender, body, tensors)
        finally:
            self.verify_busy_s += time.perf_counter() - started

    def _reexecute(self, sender: str, body: VerifyStep, tensors: dict[str, torch.Tensor]
                   ) -> Reply:
        assert self.history is not None  # served only with a history
        inputs, positions, key_valid = self.checks.step(body, tensors)
        targets = self.checks.targets(body, tensors, inputs.shape[:2])
        session = self._session(sender, body, inputs.shape[1])
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
            assert targets is not None  # the last stage's, checked
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
        sampling, seed = body.sampling, body.sampling_seed
        assert sampling is not None and seed is not None  # checked with the targets
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
            noise = sampling_noise(step_generator(step_seed(seed, step)), batch,
                                   logits.shape[-1])
            scored = transformed_logits(logits, sampling).log_softmax(-1)
            picked = scored.gather(-1, wanted[:, None]).squeeze(-1).cpu()
            margin = sampling_margin(logits, wanted, sampling, noise).cpu()
            logprobs[rows, column] = picked[rows].clamp(min=-SCORE_BOUND)
            margins[rows, column] = margin[rows].clamp(max=SCORE_BOUND)
        return logprobs, margins
