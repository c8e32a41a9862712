"""The `host` section: this machine's settings, outside the run's identity. Peers of one run may
differ in them (a GPU peer in bf16 beside a CPU peer in fp32): the run's hash and the manifest a
peer joins by cover every other section (RunConfig.run_json)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from decentrl.config.base import Section
from decentrl.config.rules import LINK_RULES, apply_rules

# The experiment trackers host.report_to may name (observe/trackers.py).
TrackerName = Literal["tensorboard", "wandb", "trackio"]


class LinkConfig(Section):
    """Emulated WAN on every hop between two peers (the caller's side of each RPC)."""

    rtt_ms: tuple[float, float] = Field((0.0, 0.0), description="round trip per link, drawn "
                                        "uniformly from this range once per pair of peers")
    jitter_ms: float = Field(0.0, ge=0, description="each one-way trip adds a delay drawn "
                             "uniformly from 0 to this")
    bandwidth_mbps: float | None = Field(None, gt=0, description="per link and direction; "
                                         "None: unlimited")
    uplink_mbps: float | None = Field(None, gt=0, description="a peer's whole upload, shared by "
                                      "everything it sends; None: unlimited")
    drop_probability: float = Field(0.0, ge=0, lt=1, description="probability a message is "
                                    "lost")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> LinkConfig:
        return apply_rules(self, LINK_RULES)


class HostConfig(Section):
    """This machine's settings: each peer has its own, and a run's peers may differ in them."""

    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="where this process computes: auto takes CUDA, else Apple MPS, "
        "else the CPU")
    dtype: Literal["auto", "bf16", "fp32", "fp16"] = Field(
        "auto", description="the compute dtype of served weights and of training's autocast "
        "(the learner's master weights stay fp32); auto: bf16 where the device runs it "
        "natively, else fp32")
    threads: int = Field(0, ge=0, le=4096, description="torch CPU threads of this process (0: "
                         "torch's default, every core; a joined peer without it takes 1)")
    memory_limit_mb: int = Field(0, ge=0, description="the most memory, in MiB, each peer "
                                 "process that this process launches (decentrl demo, the "
                                 "benches' swarms) may hold: a memory cgroup it cannot exceed "
                                 "(Linux, as root); 0: no cap")
    run_dir: Path = Field(Path("runs"), description="the folder under which the run's own "
                          "folder (RUN_DIR/NAME: config, store, checkpoints, metrics, logs, the "
                          "exported model/) is written")
    checkpoint_dir: Path | None = Field(None, description="where a joined training peer saves "
                                        "its stage's checkpoints and resumes from them "
                                        "(decentrl join --checkpoint-dir overrides it; None: "
                                        "the peer needs that option)")
    dashboard_port: int | None = Field(0, ge=0, le=65535, description="the coordinator's web "
                                       "dashboard on 127.0.0.1 (0: any free port; None: off)")
    report_to: tuple[TrackerName, ...] = Field(
        (), description="experiment trackers the coordinator also logs every training step, "
        "supervised step and evaluation to, as metrics.jsonl records them (any of tensorboard, "
        "wandb, trackio; none by default; `pip install 'decentrl[trackers]'`): TensorBoard in "
        "RUN/tensorboard; W&B offline in RUN/wandb (`wandb sync` uploads it) unless WANDB_MODE "
        "or WANDB_API_KEY is set; trackio in RUN/trackio unless TRACKIO_DIR is set "
        "(`TRACKIO_DIR=RUN/trackio trackio show`). Peers ignore it")
    link: LinkConfig = Field(LinkConfig(), description="emulated WAN on every hop this process "
                             "calls, a table of the fields below (none by default; leave it out "
                             "on a real network)")

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name_alone(cls, names: object) -> object:
        # `report_to = "wandb"`, as TRL takes it, and `--set host.report_to=wandb`.
        return (names,) if isinstance(names, str) else names

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, names: tuple[TrackerName, ...]) -> tuple[TrackerName, ...]:
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once")
        return names
