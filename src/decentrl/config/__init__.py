"""Run configuration: one pydantic model per section (a file each), their cross-field rules in
rules.py, loaded from TOML (a file may extend another) with `--set SECTION.FIELD=VALUE` changes.
Unknown fields and former names are errors, and every error names the field it is about. The
`host` section is each machine's own, outside the run's identity (RunConfig.run_json)."""

from decentrl.config.base import ConfigError, Section
from decentrl.config.curriculum import CurriculumConfig
from decentrl.config.eval import EvalConfig
from decentrl.config.host import HostConfig, LinkConfig
from decentrl.config.loading import (
    describe_validation_error,
    load_config,
    parse_config,
    parse_host,
    read_toml,
)
from decentrl.config.overrides import parse_value
from decentrl.config.rollout import RolloutConfig
from decentrl.config.rules import SWARM_SUPPORT_RULES, apply_rules
from decentrl.config.run import RUN_FOLDER_MARKERS, RUN_MODEL_DIR, RunConfig, is_run_folder
from decentrl.config.supervised import SupervisedConfig
from decentrl.config.swarm import SwarmConfig
from decentrl.config.sync import SyncConfig
from decentrl.config.task import TaskConfig
from decentrl.config.train import (
    FUSED_LORA_TARGETS,
    LORA_TARGET_NAMES,
    LORA_TARGETS,
    TrainConfig,
    check_lora_targets,
)
from decentrl.config.trust import TrustConfig

__all__ = [
    "FUSED_LORA_TARGETS", "LORA_TARGET_NAMES", "LORA_TARGETS", "RUN_FOLDER_MARKERS",
    "RUN_MODEL_DIR", "SWARM_SUPPORT_RULES", "ConfigError",
    "CurriculumConfig", "EvalConfig", "HostConfig", "LinkConfig", "RolloutConfig", "RunConfig",
    "Section", "SupervisedConfig", "SwarmConfig", "SyncConfig", "TaskConfig", "TrainConfig",
    "TrustConfig", "apply_rules", "check_lora_targets", "describe_validation_error",
    "is_run_folder", "load_config", "parse_config", "parse_host", "parse_value", "read_toml",
]
