"""The `trust` section: how the coordinator checks peers it cannot trust (trust/)."""

from __future__ import annotations

from pydantic import Field, model_validator

from decentrl.config.base import Section
from decentrl.config.rules import TRUST_RULES, apply_rules


class TrustConfig(Section):
    """How the coordinator checks peers it cannot trust (trust/): activation sketches,
    spot-check re-execution, flags from the trainer's own log-probs, reputation and bans."""

    sketch_dims: int = Field(32, ge=4, le=1024, description="dims of the coordinator's secret "
                             "random sketch of every hidden state a stage delivers, at every "
                             "position (what spot-checks compare)")
    verify_fraction: float = Field(0.1, ge=0, le=1, description="fraction of rollout groups "
                                   "re-executed (teacher-forced) by other replicas")
    second_opinion_fraction: float = Field(0.1, ge=0, le=1, description="fraction of passed "
                                           "checks repeated by a second verifier (a failed check "
                                           "always is): catches a verifier that covers a liar")
    probation_checks: int = Field(3, ge=0, description="checks a new identity must pass before its "
                                  "opinion as a verifier counts (trust/tribunal.py); until then "
                                  "one confirmed lie bans it")
    probation_verify_fraction: float = Field(1.0, ge=0, le=1, description="fraction of the "
                                             "groups of a peer on probation that are checked")
    probation_share: float = Field(0.25, ge=0, le=1, description="share of a stage's new "
                                   "sessions that all its replicas on probation together may get "
                                   "while an established replica has room: each session goes to "
                                   "them with this chance, from a budget per stage that every "
                                   "session of the stage refills by this much (net/probation.py)")
    probation_burst: float = Field(2.0, ge=1, le=64, description="sessions a stage's probation "
                                   "budget saves up while nobody on probation uses it (what a "
                                   "burst of new identities gets before the share holds)")
    probation_ban_memory_s: float = Field(3600.0, ge=0, le=7 * 86400, description="for how long "
                                          "a replica banned on probation halves its stage's "
                                          "probation refill (and empties the budget): a liar "
                                          "renewing its key at each ban waits twice as long for "
                                          "each next session")
    probation_per_address: int = Field(0, ge=0, le=1024, description="replicas on probation "
                                       "that get sessions per host, as this coordinator observed "
                                       "their connection (never a claimed address; a relayed peer "
                                       "counts at its relay); the first seen keep their place. "
                                       "0: no limit (a swarm on one machine, or behind one NAT)")
    admit_replicas: bool = Field(False, description="only inference replicas listed in "
                                 "RUN/admitted_replicas.txt (one peer id a line, like "
                                 "admitted.txt for training peers) get sessions or verify; "
                                 "listed ones start with a record (no probation), as admitted "
                                 "training peers do")
    reveal_window_s: float = Field(900.0, gt=0, description="peer_to_peer data plane: how long "
                                   "after its session closes a stage peer must still reveal "
                                   "what it sent (a spot-check asks); a peer that cannot "
                                   "within it is blamed, and a check later than that is "
                                   "skipped")
    history_versions: int = Field(4, ge=0, description="updates a replica can rewind, so it can "
                                  "re-execute at the versions a rollout recorded")
    training_peer_verifies: bool = Field(True, description="a training peer keeps a copy of the "
                                         "weights its replicas serve (one more copy of its stage "
                                         "in the serving dtype) and re-executes spot-checks of "
                                         "its stage, so a stage with one replica is judged too")
    logprob_tolerance: float = Field(0.5, gt=0, description="a re-executed token's log-prob may "
                                     "differ from the claimed one by this much (nats)")
    sampling_tolerance: float = Field(0.5, gt=0, description="how far (nats) a claimed token's "
                                      "seeded sampling score may fall below the seeded draw's")
    routing_tolerance: float = Field(0.5, gt=0, description="a mixture of experts: how far "
                                     "(nats of the router's softmax) the weakest expert a "
                                     "replica claimed for a token may fall below the router's "
                                     "k-th best in the re-execution (near ties pass)")
    max_mismatch_fraction: float = Field(0.05, ge=0, lt=1, description="share of re-executed "
                                         "tokens allowed outside the tolerances")
    mismatched_tokens_allowed: int = Field(1, ge=0, description="tokens of a checked group "
                                           "allowed outside the tolerances whatever its size: "
                                           "an honest replica's rare numeric miss (1 token in "
                                           "2560 between fp32 and bf16 peers, bench "
                                           "mixed-precision) fails no small group")
    flag_log_ratio: float | None = Field(1.0, gt=0, description="a rollout whose mean per-token "
                                         "|log pi - log mu| under the trainer exceeds this is "
                                         "flagged and left out of the loss")
    flag_surprise: float | None = Field(3.0, gt=0, description="a rollout whose tokens are on "
                                        "average this many nats less likely than typical under "
                                        "the trainer (mean of log pi + entropy of pi) is flagged "
                                        "and left out of the loss")
    train_audit_fraction: float = Field(0.1, ge=0, le=1, description="fraction of training "
                                        "steps a stage's second training peer recomputes, when it "
                                        "has one (trust/audit.py); a disagreement goes to a third")
    train_audit_tolerance: float = Field(0.5, gt=0, description="relative L2 distance allowed "
                                         "between two training peers' gradients and outputs of "
                                         "the same step: honest bf16 and fp32 peers reach 0.4 on "
                                         "the default model, gradient ascent 2 "
                                         "(bench/train_audit.py)")
    ban_score: float = Field(0.5, gt=0, lt=1, description="a peer whose score falls below this "
                             "is banned")
    ban_s: float = Field(600.0, ge=0, description="how long a peer whose score fell below "
                         "ban_score is banned the first time; each later ban doubles (a failed "
                         "call only makes the routing avoid a peer: swarm.avoid_failed_peer_s)")
    strikes_to_block: int = Field(20, ge=1, description="malformed requests within a minute "
                                  "before a peer refuses the sender")
    block_s: float = Field(300.0, ge=0, description="how long a peer refuses such a sender")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> TrustConfig:
        return apply_rules(self, TRUST_RULES)
