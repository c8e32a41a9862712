"""Run configuration: one pydantic model per concern, loaded from TOML. Unknown fields are errors,
and every error names the field it is about."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The projections of a decoder layer that can carry LoRA adapters (model/lora.py). Kept here, not
# in model/lora.py, so reading a config does not import torch.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    """`targets` if it names at least one known projection, each once; else a ValueError."""
    if not targets:
        raise ValueError(f"LoRA needs at least one target projection; valid: {list(LORA_TARGETS)}")
    for target in targets:
        if target not in LORA_TARGETS:
            raise ValueError(f"unknown LoRA target {target!r}; valid: {list(LORA_TARGETS)}")
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    if repeated:
        raise ValueError(f"LoRA targets {repeated} are listed more than once")
    return targets


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskConfig(Section):
    name: str = "sums"
    options: dict[str, Any] = Field(default_factory=dict)


class RolloutConfig(Section):
    group_size: int = Field(8, ge=2, description="samples per prompt (G)")
    prompts_per_step: int = Field(8, ge=1, description="prompts per training batch")
    max_new_tokens: int = Field(24, ge=1, le=4096)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)


class CurriculumConfig(Section):
    """Difficulty-aware scheduling (swarm/curriculum.py): the coordinator estimates, per difficulty
    bucket of the task and per problem, how likely a group is to have reward spread, and hands
    out the seeded stream's problems with a chance that grows with it (at least `floor`)."""

    enabled: bool = Field(False, description="skip seeded problems whose groups are unlikely to "
                          "have reward spread; off, every problem of the stream is handed out "
                          "(the estimates are kept and reported either way)")
    floor: float = Field(0.1, gt=0, le=1, description="the least chance a problem is handed out "
                         "with, however sure the estimate is that its group will teach nothing: "
                         "no bucket is starved and the estimates keep following the policy")
    sharpness: float = Field(2.0, gt=0, le=16, allow_inf_nan=False, description="a problem is "
                             "handed out with chance (its chance of spread / the best bucket's) "
                             "to this power, at least `floor`: 1 follows the estimates "
                             "proportionally, higher keeps closer to the best buckets (on the "
                             "demo's base model, 1: 57% of groups without spread, 2: 49%, 4: "
                             "44%, against 74% without; bench/curriculum.py)")
    half_life_groups: float = Field(128.0, gt=0, allow_inf_nan=False, description="accepted "
                                    "groups after which an observation counts half: the "
                                    "estimates follow the policy as it improves")
    replay_share: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False, description="the share of "
                                "scheduled problems that may be problems handed out before whose "
                                "own groups say the next one will likely have reward spread "
                                "(0: none); the rest come from the seeded stream")
    max_replays: int = Field(3, ge=1, le=64, description="how many times a problem may be handed "
                             "out again after its first group")


class SupervisedConfig(Section):
    """Supervised learning on the environment's own demonstrations (envs/base.py
    `Demonstrating`: a scripted solver plays train problems and writes the ideal transcript),
    through the same training chain as RL: a supervised row's loss is the negative
    log-likelihood of its assistant tokens, the environment's tokens carry none."""

    warmup_steps: int = Field(0, ge=0, le=100_000, description="supervised steps before RL (0: "
                              "none); they are the run's first versions and count in "
                              "train.steps")
    rows_per_step: int = Field(16, ge=1, le=4096, description="demonstrations per warm-up step")
    interleave_rows: int = Field(0, ge=0, le=4096, description="demonstrations added to every "
                                 "RL step after the warm-up, trained beside the rollouts (0: "
                                 "none)")
    lr: float | None = Field(None, gt=0, lt=1, description="the learning rate of the warm-up "
                             "steps (None: train.lr); RL steps use train.lr")
    coef: float = Field(1.0, ge=0, le=100, allow_inf_nan=False, description="the weight of a "
                        "demonstration's mean token negative log-likelihood beside the policy "
                        "loss")


class TrainConfig(Section):
    mode: Literal["async", "sync"] = "async"
    steps: int = Field(100, ge=1)
    # The warm-up's steps count; the evaluations before training, after the warm-up and after
    # training do not (evaluations every `eval.every` steps do).
    time_budget_s: float | None = Field(None, gt=0, description="stop training after this long")
    loss: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "grpo"
    lr: float = Field(1e-5, gt=0, lt=1)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float | None = Field(1.0, gt=0)
    micro_batch_size: int = Field(16, ge=1)
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps per batch (PPO epochs)")
    scale_advantages_by_std: bool = True
    zero_variance_groups: Literal["drop", "keep"] = "drop"
    dynamic_sampling: bool = Field(False, description="fill every batch with "
                                   "rollout.prompts_per_step groups whose rewards vary (DAPO's "
                                   "dynamic sampling): groups without spread are recorded and "
                                   "skipped, at most 4 x prompts_per_step groups a step")
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    tis_cap: float | None = Field(2.0, gt=0)
    mis_low: float | None = Field(None, gt=0)
    mis_high: float | None = Field(None, gt=0)
    decoupled: bool = True
    m2_threshold: float | None = Field(None, gt=0, description="M2PO (learn/losses.py): the "
                                       "tokens with the largest (log learner / behaviour "
                                       "probability)^2 leave the loss until the mean over the "
                                       "rest is at most this (the paper's 0.04); None: off")
    off_policy_correction: bool = Field(True, description="False: the loss ignores the behaviour "
                                        "log-probs, stale tokens count as the learner's own (the "
                                        "staleness bench's baseline)")
    max_staleness: int = Field(2, ge=0, description="drop rollouts more versions behind than this")
    checkpoint_every: int = Field(25, ge=1)
    lora_rank: int = Field(0, ge=0, description="0: full fine-tuning; >0: train only rank-r "
                           "adapters (model/lora.py)")
    lora_alpha: float = Field(16.0, gt=0, description="adapter scale is lora_alpha / lora_rank")
    lora_targets: tuple[str, ...] = Field(LORA_TARGETS, description="projections of every layer "
                                          "that get adapters")

    @field_validator("lora_targets")
    @classmethod
    def _check_lora_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        return check_lora_targets(targets)


class EvalConfig(Section):
    task: TaskConfig = TaskConfig(name="sums", options={"min_digits": 2, "max_digits": 2})
    problems: int = Field(200, ge=1)
    pass_k: int = Field(4, ge=1, description="samples per problem for pass@k (1 disables)")
    every: int = Field(0, ge=0, description="evaluate every N steps during training (0: only "
                                              "before and after)")
    max_new_tokens: int = Field(24, ge=1, le=4096)
    batch_size: int = Field(64, ge=1)
    greedy: bool = Field(True, description="a run's own evaluation adds greedy pass@1 beside the "
                         "sampled one: one greedy generation per problem, about 1/group_size "
                         "more generation; its sessions (temperature 0) tell the peers they are "
                         "evaluation, so they are spot-checked like the rest")


class LinkConfig(Section):
    """Emulated WAN on every hop between two peers (the caller's side of each RPC)."""

    rtt_ms: tuple[float, float] = Field((0.0, 0.0), description="round trip per link, drawn "
                                        "uniformly from this range once per pair of peers")
    jitter_ms: float = Field(0.0, ge=0)
    bandwidth_mbps: float | None = Field(None, gt=0, description="per link and direction; "
                                         "None: unlimited")
    uplink_mbps: float | None = Field(None, gt=0, description="a peer's whole upload, shared by "
                                      "everything it sends; None: unlimited")
    loss: float = Field(0.0, ge=0, lt=1, description="probability a message is lost")

    @model_validator(mode="after")
    def _check_range(self) -> LinkConfig:
        low, high = self.rtt_ms
        if not 0 <= low <= high:
            raise ValueError("swarm.link.rtt_ms must be [low, high] with 0 <= low <= high")
        return self


class SwarmConfig(Section):
    """How the coordinator drives peers over the network (decentrl coordinate / join / demo)."""

    link: LinkConfig = LinkConfig()
    activation_codec: Literal["fp32", "bf16", "int8"] = "bf16"
    sessions_in_flight: int | None = Field(None, ge=1, description="generation sessions open "
                                           "at once; None: sized from the measured round trip "
                                           "and throughput (swarm/inflight.py)")
    groups_per_session: int | None = Field(None, ge=1, description="problems (a group of "
                                           "rollout.group_size rows each) one generation "
                                           "session carries; None: the fewest that fit a "
                                           "step's rows into the sessions a peer has room for")
    request_timeout_s: float = Field(60.0, gt=0, description="longest wait for one peer's answer")
    retries: int = Field(4, ge=0, description="attempts after a failed call before giving up")
    ban_s: float = Field(30.0, ge=0, description="how long a failing peer is avoided")
    announce_every_s: float = Field(2.0, gt=0, description="peers re-announce themselves this "
                                    "often; entries expire after 5x this")
    max_sessions_per_peer: int = Field(32, ge=1)
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
    dashboard_port: int | None = Field(0, ge=0, le=65535, description="the coordinator's web "
                                       "dashboard on 127.0.0.1 (0: any free port; None: off)")
    snapshot_every_s: float = Field(10.0, gt=0, description="how often the coordinator records "
                                    "every peer's state in metrics.jsonl (for the report)")

    @model_validator(mode="after")
    def _check_sender_budget(self) -> SwarmConfig:
        if self.max_cached_tokens_per_sender < self.max_session_tokens:
            raise ValueError(f"swarm.max_cached_tokens_per_sender "
                             f"({self.max_cached_tokens_per_sender}) must be at least "
                             f"swarm.max_session_tokens ({self.max_session_tokens}): a session "
                             "a peer accepts must fit in its sender's budget")
        if self.kv_pool_tokens < self.max_session_tokens:
            raise ValueError(f"swarm.kv_pool_tokens ({self.kv_pool_tokens}) must be at least "
                             f"swarm.max_session_tokens ({self.max_session_tokens}): a session a "
                             "peer accepts must fit in its KV pool")
        return self


class SyncConfig(Section):
    """How a stage's new weights reach its inference replicas (sync/)."""

    mode: Literal["sparse", "dense"] = Field("sparse", description="sparse: top-k int8 deltas "
                                             "with error feedback; dense: a keyframe every version")
    density: float = Field(0.01, gt=0, le=1, description="fraction of each tensor's entries an "
                           "update carries")
    selection: Literal["magnitude", "served_changes"] = Field(
        "served_changes", description="which entries a sparse update carries: magnitude, those "
        "that moved most; served_changes, only those whose served bf16 value differs from the "
        "learner's, those that moved most first (bench update-bytes)")
    values: Literal["int8_delta", "bf16_value"] = Field(
        "int8_delta", description="how a sparse update's entries are sent: int8_delta, the "
        "difference quantized to int8 in blocks of 256; bf16_value, the learner's bf16 value "
        "itself (2 bytes), which replicas then serve exactly")
    keyframe_every: int = Field(50, ge=1, description="versions between dense keyframes (late "
                                "joiners and recovery start from the latest)")
    chunks_per_update: int = Field(32, ge=1, description="an update is cut into about this many "
                                   "hashed chunks that replicas fetch from each other")
    peer_exchange: bool = Field(True, description="replicas fetch chunks from each other; off: "
                                "every replica downloads every update from the publisher")
    parallel_fetches: int = Field(8, ge=1, description="chunk requests a replica keeps in flight")
    chunk_wait_s: float = Field(2.0, ge=0, description="how long a replica holds a request for "
                                "a chunk it is still fetching itself")


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
    max_mismatch_fraction: float = Field(0.05, ge=0, lt=1, description="share of re-executed "
                                         "tokens allowed outside the tolerances")
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
    ban_s: float = Field(600.0, ge=0, description="first ban's length; each later ban doubles")
    strikes_to_block: int = Field(20, ge=1, description="malformed requests within a minute "
                                  "before a peer refuses the sender")
    block_s: float = Field(300.0, ge=0, description="how long a peer refuses such a sender")

    @model_validator(mode="after")
    def _someone_established_judges(self) -> TrustConfig:
        if self.probation_checks > 0 and not self.training_peer_verifies \
                and not self.admit_replicas:
            raise ValueError("trust.training_peer_verifies = false leaves a swarm of new replicas "
                             "no established verifier, and a newcomer's opinion decides nothing "
                             "(trust/tribunal.py): no replica could earn its record. Keep training "
                             "peers verifying, admit replicas (trust.admit_replicas), or set "
                             "trust.probation_checks = 0")
        return self


class RunConfig(Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    run_dir: Path = Path("runs")
    seed: int = Field(0, ge=0, lt=2**31)
    model: str = "smollm2-135m-instruct"
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "bf16", "fp32", "fp16"] = "auto"
    num_stages: int = Field(2, ge=1)
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: all cores)")
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    supervised: SupervisedConfig = SupervisedConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    swarm: SwarmConfig = SwarmConfig()
    sync: SyncConfig = SyncConfig()
    trust: TrustConfig = TrustConfig()

    @model_validator(mode="after")
    def _check_consistency(self) -> RunConfig:
        if self.train.mis_low is not None and self.train.mis_high is not None \
                and self.train.mis_low >= self.train.mis_high:
            raise ValueError("train.mis_low must be below train.mis_high")
        if self.train.dynamic_sampling and self.train.zero_variance_groups == "keep":
            raise ValueError("train.dynamic_sampling skips groups without reward spread, which "
                             "train.zero_variance_groups = \"keep\" asks to train on: choose one")
        uncorrected = [name for name in ("mis_low", "mis_high", "m2_threshold")
                       if getattr(self.train, name) is not None]
        if not self.train.off_policy_correction and uncorrected:
            raise ValueError(f"train.{uncorrected[0]} needs train.off_policy_correction: without "
                             "it the loss never looks at the behaviour log-probs it acts on")
        if self.trust.verify_fraction > 0 and self.trust.history_versions < self.train.max_staleness:
            raise ValueError(f"trust.history_versions ({self.trust.history_versions}) must be at "
                             f"least train.max_staleness ({self.train.max_staleness}): replicas "
                             "must rewind to any version a trainable rollout may carry")
        if self.supervised.warmup_steps >= self.train.steps:
            raise ValueError(f"supervised.warmup_steps ({self.supervised.warmup_steps}) must be "
                             f"fewer than train.steps ({self.train.steps}), which counts them: "
                             "no RL step would be left")
        groups = self.swarm.groups_per_session
        if groups is not None and groups * self.rollout.group_size \
                * (self.rollout.max_new_tokens + 1) > self.swarm.max_session_tokens:
            raise ValueError(f"swarm.groups_per_session ({groups}) x rollout.group_size "
                             f"({self.rollout.group_size}) rows of at least "
                             f"rollout.max_new_tokens + 1 ({self.rollout.max_new_tokens + 1}) "
                             f"positions exceed swarm.max_session_tokens "
                             f"({self.swarm.max_session_tokens}): no peer would accept the "
                             "session")
        return self

    @property
    def path(self) -> Path:
        return self.run_dir / self.name


class ConfigError(ValueError):
    """A configuration that cannot run; the message names every bad field."""


def describe_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "config"
        lines.append(f"{where}: {item['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any], **overrides: Any) -> RunConfig:
    try:
        return RunConfig.model_validate({**data, **overrides})
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


# What a run writes beside its config.json, by which a run folder is recognised.
RUN_FOLDER_MARKERS = ("checkpoints", "run.sqlite", "metrics.jsonl")


def is_run_folder(path: Path) -> bool:
    """A run's folder, recognised by what it holds: its config and its checkpoints, store or
    metrics."""
    return (path / "config.json").is_file() and any(
        (path / name).exists() for name in RUN_FOLDER_MARKERS)


def load_config(path: Path, **overrides: Any) -> RunConfig:
    """A TOML config, or the config.json a run folder holds."""
    if path.is_dir():
        hint = (f"; the config of the run in it is {path / 'config.json'}"
                if (path / "config.json").is_file() else "")
        raise ConfigError(f"config {path} is a folder, not a file: give a TOML file such as "
                          f"examples/sums.toml{hint}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not a text file") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from None
        return parse_config(data, **overrides)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    return parse_config(data, **overrides)
