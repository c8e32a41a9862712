"""The inference service of a stage peer: Petals-style sessions (a client sends the new
positions' inputs, the peer keeps the session's KV cache and returns the next hidden states, or
samples at the last stage), with a commitment to every output, and the re-execution of someone
else's session at the versions it recorded (a spot-check, `verify_step`).

Every request runs on the node's compute thread, one at a time, so a weight update written
between two requests (swarm/replica.py) is never seen half-applied, and a rewound re-execution
never leaks into a session."""

from __future__ import annotations

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
from decentrl.trust.commit import commitment_to_wire, make_commitment

# Sessions idle this long are dropped (their client is gone); a live client steps far more often.
SESSION_IDLE_S = 300.0
# Re-execution scores are bounded so that they can travel (messages carry finite floats only).
SCORE_BOUND = 1e4


@dataclass
class Session:
    cache: StageCache
    batch: int
    max_length: int
    last_used: float


class InferenceService:
    """Serves one stage's model. `history` (a replica's undo information of its last updates)
    makes it a verifier too: it can rewind its weights to a version a rollout recorded."""

    def __init__(self, config: RunConfig, model: StageModule, node: SwarmNode,
                 checks: InboundChecks, history: UpdateHistory | None) -> None:
        self.config, self.model, self.node, self.checks = config, model, node, checks
        self.history = history
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.sessions: dict[str, Session] = {}
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
        # A snapshot: the compute thread may open a session while this (the loop thread) looks.
        for key, session in list(self.sessions.items()):
            if session.last_used < cutoff:
                self.sessions.pop(key, None)

    # ---- sessions ------------------------------------------------------------------------

    async def _inference_step(self, request: Request[InferenceStep]) -> Reply:
        return await self.node.compute(self.infer, request.body, request.tensors)

    def infer(self, body: InferenceStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """One step of a session (compute thread)."""
        started = time.perf_counter()
        inputs, positions, key_valid = self.checks.step(body, tensors)
        session = self._session(body)
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
                result = {"hidden": hidden.cpu(),
                          **self.commitment(hidden, positions, key_valid, body.start)}
        self.served_tokens += inputs.shape[0] * inputs.shape[1]
        self.busy_s += time.perf_counter() - started
        reply = InferenceReply(version=self.model.version, length=session.cache.length)
        # Log-probs are [B] floats the trainer's importance ratios use: never compressed.
        codec = "fp32" if self.model.is_last else self.config.swarm.activation_codec
        return Reply(reply, result, codec)

    def commitment(self, hidden: torch.Tensor, positions: torch.Tensor,
                   key_valid: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        """The signed activation commitment of the new positions' outputs (trust/commit.py)."""
        trust = self.config.trust
        # Only the commitment points are gathered (on the compute device), never the whole output.
        return commitment_to_wire(make_commitment(hidden, positions, key_valid[:, start:],
                                                  trust.commit_interval, trust.commit_top_k))

    def _session(self, body: InferenceStep | VerifyStep) -> Session:
        """The session a step continues (opened by its first step), checked against it."""
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

    async def _close_session(self, request: Request[CloseSession]) -> Reply:
        self.sessions.pop(request.body.session, None)
        return Reply(Empty())

    # ---- spot-checks of other replicas' work ---------------------------------------------

    async def _verify_step(self, request: Request[VerifyStep]) -> Reply:
        return await self.node.compute(self._verify, request.body, request.tensors)

    def _verify(self, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """Re-execute a segment of someone else's session, teacher-forced, at the version it
        recorded: rewind this replica's weights, run the stage, put the weights back (all on the
        compute thread, so no inference request sees the rewound weights)."""
        started = time.perf_counter()
        try:
            return self._reexecute(body, tensors)
        finally:
            self.verify_busy_s += time.perf_counter() - started

    def _reexecute(self, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        assert self.history is not None  # served only with a history
        inputs, positions, key_valid = self.checks.step(body, tensors)
        targets = self.checks.targets(body, tensors, inputs.shape[:2])
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
