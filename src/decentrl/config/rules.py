"""Every rule of the config that ties one field to another, named, in one place. A rule takes
the section (or the whole run config) it reads and raises ValueError saying which fields
disagree and why; the sections run theirs when they are built, the coordinator runs
SWARM_SUPPORT_RULES on a config it is about to run over the network (coordinator/swarm_backend.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the sections import this module to run their rules
    from decentrl.config.host import LinkConfig
    from decentrl.config.run import RunConfig
    from decentrl.config.swarm import SwarmConfig
    from decentrl.config.trust import TrustConfig

Checked = TypeVar("Checked")


def apply_rules(value: Checked, rules: Sequence[Callable[[Any], None]]) -> Checked:
    """`value` once every rule has passed it (the first that fails raises)."""
    for rule in rules:
        rule(value)
    return value


# ---- host.link ---------------------------------------------------------------------------------

def rtt_range_is_ordered(link: LinkConfig) -> None:
    low, high = link.rtt_ms
    if not 0 <= low <= high:
        raise ValueError("host.link.rtt_ms must be [low, high] with 0 <= low <= high")


# ---- swarm -------------------------------------------------------------------------------------

def sender_budget_holds_a_session(swarm: SwarmConfig) -> None:
    if swarm.max_cached_tokens_per_sender < swarm.max_session_tokens:
        raise ValueError(f"swarm.max_cached_tokens_per_sender "
                         f"({swarm.max_cached_tokens_per_sender}) must be at least "
                         f"swarm.max_session_tokens ({swarm.max_session_tokens}): a session "
                         "a peer accepts must fit in its sender's budget")


def kv_pool_holds_a_session(swarm: SwarmConfig) -> None:
    if swarm.kv_pool_tokens < swarm.max_session_tokens:
        raise ValueError(f"swarm.kv_pool_tokens ({swarm.kv_pool_tokens}) must be at least "
                         f"swarm.max_session_tokens ({swarm.max_session_tokens}): a session a "
                         "peer accepts must fit in its KV pool")


# ---- trust -------------------------------------------------------------------------------------

def someone_established_judges(trust: TrustConfig) -> None:
    if trust.probation_checks > 0 and not trust.training_peer_verifies \
            and not trust.admit_replicas:
        raise ValueError("trust.training_peer_verifies = false leaves a swarm of new replicas "
                         "no established verifier, and a newcomer's opinion decides nothing "
                         "(trust/tribunal.py): no replica could earn its record. Keep training "
                         "peers verifying, admit replicas (trust.admit_replicas), or set "
                         "trust.probation_checks = 0")


# ---- across sections ---------------------------------------------------------------------------

def mis_bounds_are_ordered(config: RunConfig) -> None:
    train = config.train
    if train.mis_low is not None and train.mis_high is not None \
            and train.mis_low >= train.mis_high:
        raise ValueError("train.mis_low must be below train.mis_high")


def mis_bounds_need_decoupled(config: RunConfig) -> None:
    train = config.train
    if not train.decoupled and (train.mis_low is not None or train.mis_high is not None):
        raise ValueError("train.mis_low and train.mis_high need train.decoupled: coupled PPO "
                         "has no separate behaviour weight to bound")


def dynamic_sampling_drops_flat_groups(config: RunConfig) -> None:
    if config.train.dynamic_sampling and config.train.zero_variance_groups == "keep":
        raise ValueError("train.dynamic_sampling skips groups without reward spread, which "
                         "train.zero_variance_groups = \"keep\" asks to train on: choose one")


def corrections_need_behaviour_logprobs(config: RunConfig) -> None:
    uncorrected = [name for name in ("mis_low", "mis_high", "m2_threshold")
                   if getattr(config.train, name) is not None]
    if not config.train.off_policy_correction and uncorrected:
        raise ValueError(f"train.{uncorrected[0]} needs train.off_policy_correction: without "
                         "it the loss never looks at the behaviour log-probs it acts on")


def replicas_rewind_past_the_staleness_bound(config: RunConfig) -> None:
    trust, train = config.trust, config.train
    if trust.verify_fraction > 0 and trust.history_versions < train.max_staleness:
        raise ValueError(f"trust.history_versions ({trust.history_versions}) must be at "
                         f"least train.max_staleness ({train.max_staleness}): replicas "
                         "must rewind to any version a trainable rollout may carry")


def supervised_steps_leave_rl_steps(config: RunConfig) -> None:
    if config.supervised.steps >= config.train.steps:
        raise ValueError(f"supervised.steps ({config.supervised.steps}) must be fewer than "
                         f"train.steps ({config.train.steps}), which counts them: no RL step "
                         "would be left")


def session_groups_fit_a_session(config: RunConfig) -> None:
    groups, rollout, swarm = config.swarm.groups_per_session, config.rollout, config.swarm
    if groups is not None and groups * rollout.group_size \
            * (rollout.max_new_tokens + 1) > swarm.max_session_tokens:
        raise ValueError(f"swarm.groups_per_session ({groups}) x rollout.group_size "
                         f"({rollout.group_size}) rows of at least rollout.max_new_tokens + 1 "
                         f"({rollout.max_new_tokens + 1}) positions exceed "
                         f"swarm.max_session_tokens ({swarm.max_session_tokens}): no peer would "
                         "accept the session")


# ---- what the swarm runs (swarm/coordinate.py checks them before it announces a run) -----------

def swarm_has_no_reference_model(config: RunConfig) -> None:
    if config.train.kl_coef > 0:
        raise ValueError("train.kl_coef > 0 is not supported in the swarm yet (the reference "
                         "model would have to live on the training peers)")


def swarm_trains_async(config: RunConfig) -> None:
    if config.train.mode != "async":
        raise ValueError("the swarm coordinator runs train.mode = 'async' only")


def int8_base_needs_lora(config: RunConfig) -> None:
    if config.train.lora_base == "int8" and config.train.lora_rank == 0:
        raise ValueError("train.lora_base = \"int8\" quantizes a LoRA run's frozen base: set "
                         "train.lora_rank > 0, or keep lora_base = \"compute\"")


def stage_layers_name_every_stage(config: RunConfig) -> None:
    layers = config.stage_layers
    if layers and (len(layers) != config.num_stages or min(layers) < 1):
        raise ValueError(f"stage_layers {list(layers)} must give each of the num_stages "
                         f"({config.num_stages}) stages at least one layer")


def kl_cov_needs_several_updates(config: RunConfig) -> None:
    # KL-Cov's penalty |log pi - log pi_prox| and its gradient are zero while the learner is the
    # proximal policy: in a batch's only optimizer step it would do nothing.
    if config.train.entropy.method == "kl_cov" and config.train.optimizer_steps_per_batch == 1:
        raise ValueError("train.entropy.method = \"kl_cov\" acts from a batch's second "
                         "optimizer step on: set train.minibatches_per_batch or "
                         "train.epochs_per_batch above 1, or use clip_cov")


LINK_RULES = (rtt_range_is_ordered,)
SWARM_RULES = (sender_budget_holds_a_session, kv_pool_holds_a_session)
TRUST_RULES = (someone_established_judges,)
RUN_RULES = (stage_layers_name_every_stage, int8_base_needs_lora, mis_bounds_are_ordered,
             mis_bounds_need_decoupled, dynamic_sampling_drops_flat_groups,
             corrections_need_behaviour_logprobs, replicas_rewind_past_the_staleness_bound,
             supervised_steps_leave_rl_steps, session_groups_fit_a_session,
             kl_cov_needs_several_updates)
SWARM_SUPPORT_RULES = (swarm_has_no_reference_model, swarm_trains_async)
