"""Inference sessions over the swarm, with failover: a `RemoteChain` generates through inference
peers, one replica per stage chosen by the directory (net/directory.py), one hop per stage.

A session that loses a peer mid-generation moves to another replica of the same stage: the client
keeps every input it sent to each stage, replays them to the new replica in one call (rebuilding
its KV cache), and carries on; the rollout completes. A stage's signed reply is its commitment to
the activations it returns: the session keeps a secret random sketch of them at every position
(trust/commit.py), with who computed which columns (`provenance`), for spot-checks (trust/).

Every reply is checked whole before it is used or relayed to the next stage (trust/relay.py: shape
with the model's hidden width, dtype, finite values, a magnitude bound; tokens and log-probs at the
last stage; the experts of a stage with mixture-of-experts layers, which the session joins in layer
order into `StepResult.routing`). A reply that fails, or whose signed content does not decode, is
proof against the replica that produced it: its reputation records it, the directory bans it, and
the session moves to another replica. The next stage never receives it, so it never strikes the
coordinator for what another peer produced."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decentrl.client.push_sessions import PushSession
from decentrl.config import SwarmConfig, TrustConfig
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StagePlan, routing_layers
from decentrl.net.directory import Directory, SwarmUnavailable, backoff
from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, ReplyContentError, SwarmNode
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    CloseSession,
    InferenceReply,
    InferenceStep,
)
from decentrl.net.wire import WireError
from decentrl.rollout.chain import StepResult
from decentrl.rollout.sampling import SamplingConfig
from decentrl.trust.commit import take_sketches
from decentrl.trust.provenance import Provenance
from decentrl.trust.relay import BadReply, check_experts, check_hidden_states, check_samples
from decentrl.trust.reputation import Reputation

CPU = torch.device("cpu")


@dataclass
class StageHistory:
    """Everything sent to one stage of a session, for replay on another replica."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)


class RemoteSession:
    def __init__(self, chain: RemoteChain, batch: int, max_length: int) -> None:
        self.chain, self.batch, self.max_length = chain, batch, max_length
        self.id = secrets.token_hex(8)
        stages = chain.num_stages
        self.peers: list[str | None] = [None] * stages
        self.histories = [StageHistory() for _ in range(stages)]
        self.cached = [0] * stages  # positions each stage's current peer holds
        self.length = 0  # columns of the session fed so far
        self.provenance = Provenance.empty(stages)
        # The secret sketch matrices (never sent anywhere); the provenance keeps their seeds.
        self.sketch_matrices = [self.provenance.stages[stage].matrix(chain.trust.sketch_dims,
                                                                     chain.hidden_size)
                                for stage in range(stages - 1)]
        self.failovers = 0
        self.closed = False

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        """One step through every stage; its versions are those the stages' replies reported,
        the weights that computed this step. A replica that takes over mid-session (replayed
        from position 0) rebuilds the KV cache of the earlier positions with its own weights, the
        step's version, but samples nothing for them: the tokens sampled before keep the versions
        of the steps that sampled them, and the provenance records the rebuild (its column), so
        that a spot-check rebuilds the same cache at the same version."""
        if self.closed:
            raise RuntimeError("session is closed")
        self.provenance.sampling = sampling  # a spot-check draws as the last stage was asked to
        started = time.monotonic()
        x = tokens.cpu()
        tokens_fed = x.shape[1]
        positions, key_valid = positions.cpu(), key_valid.cpu()
        versions, routing = [], []
        for stage in range(self.chain.num_stages - 1):
            (x,), version, experts = self._hop(stage, x, positions, key_valid, sampling, seed)
            versions.append(version)
            routing.extend([] if experts is None else [experts])
        (tokens, logprobs), version, experts = self._hop(
            self.chain.num_stages - 1, x, positions, key_valid, sampling, seed)
        routing.extend([] if experts is None else [experts])
        self.length += tokens_fed
        if self.chain.on_step is not None:
            self.chain.on_step(self.batch, tokens_fed, self.max_length,
                               time.monotonic() - started)
        return StepResult(tokens, logprobs, (*versions, version),
                          torch.cat(routing, dim=2) if routing else None)

    def _hop(self, stage: int, inputs: torch.Tensor, positions: torch.Tensor,
             key_valid: torch.Tensor, sampling: SamplingConfig, seed: int | None
             ) -> tuple[tuple[torch.Tensor, ...], int, torch.Tensor | None]:
        """((hidden states of the new positions,) or at the last stage (tokens, logprobs)), the
        weight version of the peer that computed them, and the experts of the new positions in
        the stage's sparse layers (None: a stage without any)."""
        history = self.histories[stage]
        last = stage == self.chain.num_stages - 1
        swarm = self.chain.swarm
        error: Exception | None = None
        request_id = secrets.token_hex(8)
        for attempt in range(swarm.retries + 1):
            peer = self.peers[stage]
            if peer is None:
                peer = self.chain.directory.choose_inference(stage)
                if peer is None:  # look for replicas that joined before retrying banned ones
                    self.chain.directory.refresh()
                    peer = self.chain.directory.choose_inference(stage, allow_banned=True)
                if peer is None:
                    # Keep the failure that got the last peer banned: it is the real cause.
                    cause = error.__cause__ if isinstance(error, SwarmUnavailable) else error
                    error = SwarmUnavailable(f"no inference peer serves stage {stage}"
                                             + (f" (after: {cause})" if cause else ""))
                    error.__cause__ = cause
                    time.sleep(backoff(attempt))
                    continue
                self.peers[stage], self.cached[stage] = peer, 0
                request_id = secrets.token_hex(8)
            # A new replica first gets the session's history (one call rebuilds its cache).
            replay = self.cached[stage] == 0 and bool(history.inputs)
            send_inputs = torch.cat([*history.inputs, inputs], 1) if replay else inputs
            send_positions = torch.cat([*history.positions, positions], 1) if replay else positions
            start = 0 if replay else self.cached[stage]
            body = InferenceStep(
                session=self.id, start=start, batch=self.batch, max_length=self.max_length,
                sampling=sampling if last else None, seed=seed if last else None)
            tensors = {"inputs": send_inputs, "positions": send_positions,
                       "key_valid": key_valid[:, :start + send_inputs.shape[1]]}
            started = time.monotonic()
            try:
                reply, out = self.chain.node.call_sync(
                    peer, INFERENCE_STEP, body, tensors, swarm.activation_codec,
                    swarm.request_timeout_s, request_id)
                result = self._check_reply(reply, out, last, start, send_inputs.shape[1],
                                           inputs.shape[1])
                experts = self._check_experts(stage, out, send_inputs.shape[1], inputs.shape[1])
            except MessageLost as lost:
                error = lost  # the same peer, the same request id: it answers once
                time.sleep(backoff(attempt))
                continue
            except (RemoteError, WireError, ValueError) as failure:
                error = failure
                if isinstance(failure, BadReply | ReplyContentError) \
                        and self.chain.reputation is not None:
                    self.chain.reputation.record(peer, "proved", f"stage {stage} replied "
                                                 f"{failure}", stage)
                self.chain.directory.ban(peer, str(failure))
                self.chain.directory.release(peer)
                self.peers[stage] = None
                self.failovers += 1
                time.sleep(backoff(attempt))
                continue
            self.chain.directory.observe(peer, time.monotonic() - started)
            self.provenance.stages[stage].serve(self.length, peer, rebuilt=replay)
            if not last:
                self._keep_sketches(stage, result[0], positions, key_valid)
            history.inputs.append(inputs)
            history.positions.append(positions)
            self.cached[stage] = reply.length
            return result, reply.version, experts
        raise SwarmUnavailable(f"stage {stage} failed {swarm.retries + 1} times; last error: "
                               f"{error}")

    def _check_reply(self, reply: InferenceReply, out: dict[str, torch.Tensor], last: bool,
                     start: int, sent: int, new: int) -> tuple[torch.Tensor, ...]:
        """The reply's (hidden states of the `new` positions,) of the `sent` it covers, or at
        the last stage (tokens, logprobs), checked whole (BadReply)."""
        if reply.length != start + sent:
            raise BadReply(f"a cache of {reply.length} positions after positions "
                           f"[{start}, {start + sent}) were fed")
        if last:
            return check_samples(out.get("tokens"), out.get("logprobs"), self.batch,
                                 self.chain.vocab_size)
        hidden = check_hidden_states(out.get("hidden"), self.batch, sent, self.chain.hidden_size)
        return (hidden[:, sent - new:],)

    def _check_experts(self, stage: int, out: dict[str, torch.Tensor], sent: int, new: int
                       ) -> torch.Tensor | None:
        """The experts of the `new` positions of the `sent` a reply covers, checked (BadReply):
        required from a stage with sparse layers, refused from one without."""
        layers, moe = self.chain.stage_sparse_layers[stage], self.chain.moe
        if not layers or moe is None:
            if "experts" in out:
                raise BadReply(f"stage {stage} has no mixture-of-experts layer, yet replied "
                               "experts")
            return None
        experts = check_experts(out.get("experts"), self.batch, sent, layers, moe)
        return experts[:, sent - new:]

    def _keep_sketches(self, stage: int, hidden: torch.Tensor, positions: torch.Tensor,
                       key_valid: torch.Tensor) -> None:
        """Keep the secret sketch of the hidden states `stage` delivered at the new positions
        (those of this step only: a replica that took over also computed the replayed ones,
        which the session already had from its predecessor), for spot-checks."""
        valid = key_valid[:, key_valid.shape[1] - positions.shape[1]:]
        self.provenance.stages[stage].sketches.append(
            take_sketches(hidden, positions, valid, self.sketch_matrices[stage]))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.chain.failovers += self.failovers
        for peer in self.peers:
            if peer is None:
                continue
            self.chain.directory.release(peer)
            try:
                self.chain.node.call_sync(peer, CLOSE_SESSION, CloseSession(session=self.id),
                                          timeout=5)
            except (RemoteError, WireError, MessageLost, TimeoutError):
                pass  # the peer drops idle sessions itself


class RemoteChain:
    """An InferenceChain over the swarm: every session picks one replica per stage, and keeps
    who computed what (`provenance`) for spot-checks, with a secret sketch of the activations of
    every stage but the last (a relayed session) or their stages' signed commitments (a
    peer-to-peer session, client/push_sessions.py)."""

    def __init__(self, node: SwarmNode, directory: Directory, swarm: SwarmConfig,
                 trust: TrustConfig, spec: ModelSpec, reputation: Reputation | None = None,
                 on_step: Callable[[int, int, int, float], None] | None = None,
                 run_session: str = "", stage_layers: Sequence[int] = ()) -> None:
        """`on_step` is told of every step of its sessions: (rows, positions fed per row, the
        session's max_length, seconds through the whole chain); the rows in flight are sized
        from it. The routes of peer-to-peer sessions (`swarm.data_plane`) are bound to the
        directory's run and `run_session` (net/session.py), this start of it (a peer that knows
        the owner's manifest refuses a route of another). `stage_layers`: the run's plan
        (config `stage_layers`; empty: even)."""
        self.node, self.directory, self.swarm, self.trust = node, directory, swarm, trust
        self.run, self.run_session = directory.run, run_session
        self.num_stages = directory.num_stages
        self.spec, self.stage_layers = spec, tuple(stage_layers)
        self.vocab_size, self.hidden_size = spec.vocab_size, spec.hidden_size
        # Each stage's sparse layers, whose experts its replies carry.
        self.moe = spec.moe
        plan = StagePlan.of(spec.num_layers, self.num_stages, stage_layers)
        slices = [routing_layers(spec, plan.layers(stage)) for stage in range(self.num_stages)]
        self.stage_sparse_layers = [part.stop - part.start for part in slices]
        self.reputation = reputation
        self.on_step = on_step
        self.failovers = 0

    @property
    def device(self) -> torch.device:
        return CPU

    def versions(self) -> tuple[int, ...]:
        stages = self.directory.stage_summary()
        return tuple(max((r.version for r in records), default=-1) for records in stages)

    def open_session(self, batch: int, max_length: int) -> RemoteSession | PushSession:
        if self.swarm.data_plane == "peer_to_peer":
            return PushSession(self, batch, max_length)
        return RemoteSession(self, batch, max_length)
