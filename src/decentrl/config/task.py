"""The `task` section: what the run post-trains on."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from decentrl.config.base import Section


class TaskConfig(Section):
    """What a run trains on (and, as eval.task, what it is evaluated on)."""

    name: str = Field("sums", description="the task family or environment: sums, a "
                      "reasoning-gym task as rg:NAME (such as rg:chain_sum), dataset (problems "
                      "from local files: path, prompt_column, answer_column, checker ...), or an "
                      "environment such as agentic-calculator or agentic-countdown, or the name an "
                      "installed plug-in declares under the entry point decentrl.tasks or "
                      "decentrl.environments (docs/plugins.md; an unknown name lists the known "
                      "ones)")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's own "
                                    "settings, passed to it as they are (for sums: min_digits, "
                                    "max_digits, format_weight ...); each task refuses the ones "
                                    "it does not know")
