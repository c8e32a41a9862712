"""Spot-check re-execution on a stage peer (`verify_step`; trust/verify.py drives it): a segment of
someone else's session, teacher-forced, at the version it recorded, on the weights the stage's
replicas serve (`ServedWeights`, stage/replica.py) rewound to that version, then put back.

Two kinds of peer serve it, with the same code:
- an inference replica, on the model it serves (its sessions share the inference service's
  table and its budgets per sender);
- a training peer (trust.training_peer_verifies), on the copy it keeps of what its replicas
  serve: the exact weights a replica served at version v are the publisher's published state at
  v, so a stage with a single replica is still judged by someone else. The cost is one more copy
  of the stage in the serving dtype: 2 bytes a parameter in bf16 against the 20 the learner
  already holds (float32 weights, gradients, two optimizer moments, the published state), or
  about half again in LoRA mode (frozen float32 base weights, small adapters); and the
  re-executions' compute, which waits its turn behind the training requests.

Every request runs on the node's compute thread and holds the served weights' lock while they
are rewound, so no inference request and no published update sees them at another version."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from decentrl.model.router_probe import RouterProbe
from decentrl.model.stages import StageModule
from decentrl.net.compute import Priority
from decentrl.net.node import Handler, Reply, Request
from decentrl.net.protocol import CLOSE_SESSION, VERIFY_STEP, Rpc, VerifyReply, VerifyStep
from decentrl.rollout.chain import step_generator
from decentrl.rollout.generate import step_seed
from decentrl.rollout.sampling import sampling_margin, sampling_noise, transformed_logits
from decentrl.stage.inbound import PeerBusy
from decentrl.stage.inference import InferenceService
from decentrl.stage.replica import ServedWeights
from decentrl.sync.history import VersionUnavailable

# Re-execution scores are bounded so that they can travel (messages carry finite floats only).
SCORE_BOUND = 1e4


class VerifyService:
    """Serves `verify_step` on `weights`, in sessions of another service's table."""

    def __init__(self, sessions: InferenceService, weights: ServedWeights,
                 closes_sessions: bool) -> None:
        """`sessions`: the table that holds the re-executions' sessions (and counts them against
        each sender's budget). `closes_sessions`: serve `close_session` for that table too, on a
        peer whose inference service is not served."""
        self.sessions, self.weights, self.closes_sessions = sessions, weights, closes_sessions
        self.config, self.node, self.checks = sessions.config, sessions.node, sessions.checks
        self.busy_s = 0.0  # re-executing others' work

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        served: list[tuple[Rpc[Any, Any], Handler[Any]]] = [(VERIFY_STEP, self._verify_step)]
        if self.closes_sessions:
            served += [(rpc, handler) for rpc, handler in self.sessions.handlers()
                       if rpc is CLOSE_SESSION]
        return served

    async def _verify_step(self, request: Request[VerifyStep]) -> Reply:
        return await self.node.compute(self.verify, request.sender, request.body,
                                       request.tensors, priority=Priority.VERIFICATION)

    def verify(self, sender: str, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        """One segment of `sender`'s re-execution (compute thread)."""
        started = time.perf_counter()
        try:
            return self._reexecute(sender, body, tensors)
        finally:
            self.busy_s += time.perf_counter() - started

    def _reexecute(self, sender: str, body: VerifyStep, tensors: dict[str, torch.Tensor]
                   ) -> Reply:
        inputs, positions, key_valid = self.checks.step(body, tensors)
        targets = self.checks.targets(body, tensors, inputs.shape[:2])
        claimed = self.checks.claimed_experts(tensors, inputs.shape[:2])
        session = self.sessions.session(sender, body, inputs.shape[1])
        param = next(self.weights.model.parameters())
        device_inputs = inputs.to(param.device, param.dtype if inputs.is_floating_point()
                                  else None)
        scores: dict[str, torch.Tensor] = {}
        try:  # only entering the context raises it, before any weight is written
            with self.weights.rewound(body.version) as model, torch.inference_mode(), \
                    contextlib.ExitStack() as watching:
                # The routers are watched only when there are claimed experts to score.
                probe = (watching.enter_context(RouterProbe(model)) if claimed is not None
                         else None)
                device_positions = positions.to(param.device)
                device_valid = key_valid.to(param.device)
                hidden = model.body(device_inputs, device_positions, device_valid,
                                    session.cache)
                if probe is not None and claimed is not None:  # on the inputs the stage saw
                    scores["routing_gaps"] = probe.gaps(
                        claimed, device_inputs, device_positions, device_valid
                    ).clamp(max=SCORE_BOUND)
                if not model.is_last:
                    return Reply(VerifyReply(version=body.version),
                                 {"hidden": hidden.cpu()}, self.config.swarm.activation_codec,
                                 exact=scores)
                assert targets is not None  # the last stage's, checked
                scores["logprobs"], scores["margins"] = self._score_targets(model, hidden,
                                                                            targets, body)
        except VersionUnavailable as error:
            raise PeerBusy(str(error)) from None
        return Reply(VerifyReply(version=body.version), scores, "fp32")

    def _score_targets(self, model: StageModule, hidden: torch.Tensor, targets: torch.Tensor,
                       body: VerifyStep) -> tuple[torch.Tensor, torch.Tensor]:
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
            logits = model.head(hidden[:, column]).float()
            wanted = targets[:, column].clamp(min=0).to(logits.device)
            # The session's rows before these drew first: CPU noise is one serial stream.
            noise = sampling_noise(step_generator(step_seed(seed, step)),
                                   body.first_row + batch, logits.shape[-1])[body.first_row:]
            scored = transformed_logits(logits, sampling).log_softmax(-1)
            picked = scored.gather(-1, wanted[:, None]).squeeze(-1).cpu()
            margin = sampling_margin(logits, wanted, sampling, noise).cpu()
            logprobs[rows, column] = picked[rows].clamp(min=-SCORE_BOUND)
            margins[rows, column] = margin[rows].clamp(max=SCORE_BOUND)
        return logprobs, margins
