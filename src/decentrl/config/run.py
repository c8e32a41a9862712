"""The whole run config (`RunConfig`): the run's identity, every section, and this host's
settings, with the folder the run writes."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from decentrl.config.base import Section
from decentrl.config.curriculum import CurriculumConfig
from decentrl.config.eval import EvalConfig
from decentrl.config.host import HostConfig
from decentrl.config.rollout import RolloutConfig
from decentrl.config.rules import RUN_RULES, apply_rules
from decentrl.config.supervised import SupervisedConfig
from decentrl.config.swarm import SwarmConfig
from decentrl.config.sync import SyncConfig
from decentrl.config.task import TaskConfig
from decentrl.config.train import TrainConfig
from decentrl.config.trust import TrustConfig

# What a run writes beside its config.json, by which a run folder is recognised.
RUN_FOLDER_MARKERS = ("checkpoints", "run.sqlite", "metrics.jsonl")
# The run's exported Hugging Face model, in its folder: a local run's at its end, the swarm
# demo's and coordinator's release.
RUN_MODEL_DIR = "model"
# The section outside the run's identity (RunConfig.run_json).
HOST_SECTION = "host"


class RunConfig(Section):
    """A run: its name, seed, model and stages, every section, and this host's settings."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", description="the run's name: its "
                      "folder under host.run_dir, and the key its peers find it by")
    seed: int = Field(0, ge=0, lt=2**31, description="seeds the problem stream, the sampling and "
                      "the emulated links: the same config and seed replay the same problems")
    model: str = Field("smollm2-135m-instruct", description="the model to post-train: "
                       "smollm2-135m-instruct (converted once from its GGUF package), a local "
                       "Hugging Face folder of a supported family (README's model section), or "
                       "a .gguf file of one (converted once into a cache folder)")
    num_stages: int = Field(2, ge=1, description="pipeline stages the model's layers are cut "
                            "into; each stage is served by its own peers")
    stage_layers: tuple[int, ...] = Field((), description="layers of each stage, from the "
                                          "first (they must add up to the model's layers); "
                                          "empty: as even as the layers allow, or planned from "
                                          "the training peers' offers (`decentrl coordinate "
                                          "--plan-from-offers`). `decentrl plan` chooses them "
                                          "from given memory and speed")
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    supervised: SupervisedConfig = SupervisedConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    swarm: SwarmConfig = SwarmConfig()
    sync: SyncConfig = SyncConfig()
    trust: TrustConfig = TrustConfig()
    host: HostConfig = HostConfig()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        return apply_rules(self, RUN_RULES)

    @property
    def path(self) -> Path:
        return self.host.run_dir / self.name

    def run_json(self) -> str:
        """The run's settings as every peer shares them, this host's left out: what the run's
        hash covers, what its manifest carries and what a resumed run must bring again."""
        return self.model_dump_json(exclude={HOST_SECTION})

    def with_host(self, host: HostConfig) -> RunConfig:
        """This run on a host with settings `host`."""
        return self.model_copy(update={HOST_SECTION: host})


def is_run_folder(path: Path) -> bool:
    """A run's folder, recognised by what it holds: its config and its checkpoints, store or
    metrics."""
    return (path / "config.json").is_file() and any(
        (path / name).exists() for name in RUN_FOLDER_MARKERS)
