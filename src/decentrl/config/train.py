"""The `train` section: the objective, the optimizer and the learner's handling of stale rollouts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from decentrl.config.base import Section
from decentrl.config.entropy import EntropyConfig

# The projections of a decoder layer that can carry LoRA adapters (model/lora.py), the default
# targets: every projection. Kept here, not in model/lora.py, so reading a config does not import
# torch.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections some families fuse into one (Phi-3), and the projections each one holds. A family
# that fuses them has the fused one instead, targeted by its own name or by naming all its parts.
FUSED_LORA_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}
LORA_TARGET_NAMES = LORA_TARGETS + tuple(FUSED_LORA_TARGETS)


def check_lora_targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    """`targets` if it names at least one known projection, each once; else a ValueError."""
    if not targets:
        raise ValueError("LoRA needs at least one target projection; valid: "
                         f"{list(LORA_TARGET_NAMES)}")
    for target in targets:
        if target not in LORA_TARGET_NAMES:
            raise ValueError(f"unknown LoRA target {target!r}; valid: {list(LORA_TARGET_NAMES)}")
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    if repeated:
        raise ValueError(f"LoRA targets {repeated} are listed more than once")
    return targets


class TrainConfig(Section):
    """The objective, the optimizer and how the learner treats rollouts sampled by older
    weights (learn/losses.py, learn/trainer.py)."""

    mode: Literal["async", "sync"] = Field("async", description="async: generation goes on "
                                           "while the learner trains, on rollouts up to "
                                           "max_staleness versions old; sync: each step trains "
                                           "on rollouts of the current weights (one process "
                                           "only: the swarm runs async)")
    steps: int = Field(100, ge=1, description="steps of the run, each one batch (of "
                       "optimizer_steps_per_batch optimizer steps), the supervised steps "
                       "included; the evaluations before training, after the supervised steps "
                       "and after training do not count (those every eval.every steps do)")
    time_budget_s: float | None = Field(None, gt=0, description="stop training after this long "
                                        "(None: only train.steps stops it)")
    loss: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = Field(
        "grpo", description="the policy-gradient objective (learn/losses.py): grpo, token means "
        "per sequence with PPO's symmetric clip; dapo, one mean over every token with "
        "clip-higher; dr_grpo, normalised by rollout.max_new_tokens; gspo, a clipped "
        "length-normalised sequence ratio; cispo, a clipped detached importance weight")
    lr: float = Field(1e-5, gt=0, lt=1, description="AdamW's learning rate for RL steps (the "
                      "supervised steps may have their own: supervised.lr)")
    lr_warmup_steps: int = Field(0, ge=0, description="the learning rate ramps linearly over "
                                 "this many first optimizer steps (versions) of the run, from "
                                 "1/N of its value (0: none)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW's (beta1, beta2): decay "
                                       "rates of its gradient and squared-gradient averages")
    max_grad_norm: float | None = Field(1.0, gt=0, description="the gradient is scaled down to "
                                        "this global L2 norm, over every stage together (None: "
                                        "never)")
    micro_batch_size: int = Field(16, ge=1, description="rows per forward and backward pass; a "
                                  "batch's gradient is the sum over its micro-batches, so this "
                                  "trades memory for passes without changing the step")
    minibatches_per_batch: int = Field(1, ge=1, description="each batch is split into this "
                                       "many minibatches of consecutive rows (sizes within one "
                                       "of each other; a batch of fewer rows into one a row), "
                                       "one optimizer step each")
    epochs_per_batch: int = Field(1, ge=1, description="passes over each batch's minibatches, in "
                                  "the same order (PPO epochs): a batch takes "
                                  "minibatches_per_batch x epochs_per_batch optimizer steps, each "
                                  "a new version, all scored against the proximal log-probs "
                                  "fixed before the first by a forward-only pass")
    scale_advantages_by_std: bool = Field(True, description="a row's advantage is its reward "
                                          "minus its group's mean, divided by the group's "
                                          "standard deviation (false: not divided, as Dr.GRPO "
                                          "does)")
    zero_variance_groups: Literal["drop", "keep"] = Field(
        "drop", description="groups whose rewards are all equal teach no policy gradient: drop "
        "them from the batch, or keep them (they count in the loss's normaliser)")
    dynamic_sampling: bool = Field(False, description="fill every batch with "
                                   "rollout.prompts_per_step groups whose rewards vary (DAPO's "
                                   "dynamic sampling): groups without spread are recorded and "
                                   "skipped, at most 4 x prompts_per_step groups a step")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO's clip range on pi / pi_prox "
                            "starts at 1 - clip_low (grpo, dr_grpo, dapo); it acts from a "
                            "batch's second optimizer step on")
    clip_high: float | None = Field(None, gt=0, description="the clip range ends at 1 + "
                                    "clip_high (grpo, dr_grpo, dapo; None: the loss's own, "
                                    "clip_low for grpo and dr_grpo, PPO's symmetric range, and "
                                    "0.28 for dapo, its clip-higher); gspo and cispo keep their "
                                    "own published ranges")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 estimate of the KL "
                           "divergence to the base model (0: none; one process only)")
    tis_cap: float | None = Field(2.0, ge=1, description="truncated importance sampling: each "
                                  "token's correction weight pi_prox / mu (learner over "
                                  "behaviour policy) is capped here (None: uncapped)")
    mis_low: float | None = Field(None, gt=0, le=1, description="sequences whose geometric-mean "
                                  "pi_prox / mu is below this leave the loss (masked importance "
                                  "sampling; None: no lower bound)")
    mis_high: float | None = Field(None, ge=1, description="sequences whose geometric-mean "
                                   "pi_prox / mu is above this leave the loss (None: no upper "
                                   "bound)")
    decoupled: bool = Field(True, description="decoupled PPO: clip pi / pi_prox and correct "
                            "for the behaviour policy with a separate weight (tis_cap); false: "
                            "classic PPO, whose ratio is pi / mu (learn/losses.py)")
    m2_threshold: float | None = Field(None, gt=0, description="M2PO (learn/losses.py): the "
                                       "tokens with the largest (log learner / behaviour "
                                       "probability)^2 leave the loss until the mean over the "
                                       "rest is at most this (the paper's 0.04); None: off")
    off_policy_correction: bool = Field(True, description="False: the loss ignores the behaviour "
                                        "log-probs, stale tokens count as the learner's own (the "
                                        "staleness bench's baseline)")
    max_staleness: int = Field(2, ge=0, description="drop rollouts more versions behind the "
                               "learner than this; a version is one optimizer step, and a batch "
                               "takes minibatches_per_batch x epochs_per_batch of them, so scale "
                               "this with them")
    routing_replay: bool = Field(False, description="rollout routing replay, for a "
                                 "mixture-of-experts model (Qwen3-MoE, Mixtral): generation "
                                 "records the experts each completion token went to, and the "
                                 "learner's forward runs those experts (weighted by its own "
                                 "routers), so an update's routing changes do not shift the "
                                 "importance ratio; a dense model refuses it (one process only)")
    checkpoint_every: int = Field(25, ge=1, description="steps between checkpoints (weights and "
                                  "optimizer state of every stage); a run resumes from the "
                                  "latest, and a failed training peer costs the steps since")
    lora_rank: int = Field(0, ge=0, description="0: full fine-tuning; >0: train only rank-r "
                           "adapters (model/lora.py)")
    lora_alpha: float = Field(16.0, gt=0, description="adapter scale is lora_alpha / lora_rank")
    lora_base: Literal["compute", "int8"] = Field("compute", description="a LoRA run's frozen "
                                                  "projections: in the compute dtype, or int8 "
                                                  "weight-only with a scale per row, the same on "
                                                  "every peer (model/quant.py): half the memory "
                                                  "of bf16; needs lora_rank > 0")
    lora_targets: tuple[str, ...] = Field(LORA_TARGETS, description="projections of every layer "
                                          "that get adapters; a family that fuses some (Phi-3's "
                                          "qkv_proj, gate_up_proj) takes the fused name or all "
                                          "of its parts")

    @property
    def optimizer_steps_per_batch(self) -> int:
        """The optimizer steps (versions) a batch of at least minibatches_per_batch rows takes."""
        return self.minibatches_per_batch * self.epochs_per_batch

    entropy: EntropyConfig = Field(EntropyConfig(), description="entropy control "
                                   "(learn/entropy.py): Clip-Cov, KL-Cov, an adaptive bonus")

    @field_validator("lora_targets")
    @classmethod
    def _check_lora_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        return check_lora_targets(targets)
