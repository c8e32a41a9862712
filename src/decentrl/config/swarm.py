"""The `swarm` section: how the coordinator drives peers over the network, and what a peer
accepts (decentrl coordinate / join / demo)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section
from decentrl.config.rules import SWARM_RULES, apply_rules


class SwarmConfig(Section):
    """How the coordinator drives peers over the network (decentrl coordinate / join / demo),
    and what a peer accepts from a sender."""

    activation_codec: Literal["fp32", "bf16", "int8"] = Field(
        "bf16", description="how hidden states cross from one stage to the next: fp32 as they "
        "are, bf16 (half the bytes), or int8 (a quarter, quantized)")
    data_plane: Literal["coordinator", "peer_to_peer"] = Field(
        "peer_to_peer", description="how a generation session's activations travel: through the "
        "coordinator, which relays every hop (client/sessions.py), or pushed from stage to "
        "stage along a route the coordinator signs, with each stage's signed commitment to "
        "what it sent, revealed on a spot-check (client/push_sessions.py, stage/push.py)")
    kept_activations_mb: float = Field(1024.0, gt=0, description="peer_to_peer: MiB of the "
                                       "activations a stage peer sent on that it keeps, for a "
                                       "failover's replay and for spot-checks' reveals; a new "
                                       "session is refused while it holds more")
    sessions_in_flight: int | None = Field(None, ge=1, description="generation sessions open "
                                           "at once; None: sized from the measured round trip "
                                           "and throughput (coordinator/inflight.py)")
    groups_per_session: int | None = Field(None, ge=1, description="problems (a group of "
                                           "rollout.group_size rows each) one generation "
                                           "session carries; None: the fewest that fit a "
                                           "step's rows into the sessions a peer has room for")
    request_timeout_s: float = Field(60.0, gt=0, description="longest wait for one peer's answer")
    retries: int = Field(4, ge=0, description="attempts after a failed call before giving up")
    avoid_failed_peer_s: float = Field(30.0, ge=0, description="how long a peer whose call "
                                       "failed (no answer, an error) is avoided by the routing "
                                       "before it is tried again; not a ban (trust.ban_s)")
    announce_every_s: float = Field(2.0, gt=0, description="peers re-announce themselves this "
                                    "often; entries expire after 5x this")
    max_sessions_per_peer: int = Field(32, ge=1, description="sessions a peer serves at once, "
                                       "from every sender together; it refuses more")
    max_session_tokens: int = Field(65536, ge=1, description="batch x max_length a peer accepts "
                                    "for one session (bounds its KV cache)")
    max_sessions_per_sender: int = Field(16, ge=1, description="sessions one sender may hold "
                                         "open on a peer (inference and spot-check sessions "
                                         "together)")
    max_cached_tokens_per_sender: int = Field(262144, ge=1, description="batch x positions the KV "
                                              "caches of one sender's sessions on a peer may "
                                              "hold; caches grow with the positions written, so "
                                              "this bounds the memory one sender takes")
    stage_wait_s: float = Field(1800.0, gt=0, description="how long generation and evaluation "
                                "wait for a stage that has lost every inference replica before "
                                "the run fails")
    batching: bool = Field(True, description="a stage peer runs the waiting decoding steps of "
                           "all its sessions as one forward per tick (off: one request at a time)")
    batch_max_rows: int = Field(512, ge=1, description="rows one batched forward takes at most; "
                                "the steps left over wait for the next tick")
    batch_wait_s: float = Field(0.01, ge=0, le=1, description="longest a tick waits for the "
                                "steps of sessions it answered before that are due back by then "
                                "(their measured turnaround); none other is waited for")
    kv_pool_tokens: int = Field(524288, ge=1, description="batch x positions the KV caches of all "
                                "sessions on a peer may hold together (its KV pool); a session "
                                "that would pass it is refused and moves to another replica")
    prefix_cache_tokens: int = Field(8192, ge=0, description="positions of shared prompt prefixes "
                                     "a peer keeps (keys, values and outputs at the current "
                                     "weights) so sessions that start with them skip computing "
                                     "them; 0: off")
    inference_replicas: int = Field(2, ge=1, description="per stage, for the local launcher")
    training_peers_per_stage: int = Field(1, ge=1, description="per stage, for the local "
                                          "launcher: the first trains, the others audit it "
                                          "(trust.train_audit_fraction)")
    snapshot_every_s: float = Field(10.0, gt=0, description="how often the coordinator records "
                                    "every peer's state in metrics.jsonl (for the report)")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> SwarmConfig:
        return apply_rules(self, SWARM_RULES)
