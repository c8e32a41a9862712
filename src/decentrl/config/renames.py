"""The config's former names, refused with the name that replaced them: in a TOML file, a run
folder's config.json, a run manifest and --set alike. A name moved when it meant two things
(`warmup_steps`, `ban_s`), or when the setting belongs to the host, outside the run's identity
(`device`, `swarm.link` ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Old dotted path -> the new one.
RENAMED = {
    "device": "host.device",
    "dtype": "host.dtype",
    "threads": "host.threads",
    "run_dir": "host.run_dir",
    "swarm.link": "host.link",
    "swarm.dashboard_port": "host.dashboard_port",
    "train.warmup_steps": "train.lr_warmup_steps",
    "supervised.warmup_steps": "supervised.steps",
    "swarm.ban_s": "swarm.avoid_failed_peer_s",
    "host.link.loss": "host.link.drop_probability",
    # It meant optimizer steps per batch and was read as PPO epochs: the two are separate now.
    "train.updates_per_batch": "train.minibatches_per_batch",
}


def renamed_message(old: str) -> str | None:
    """What to say of the former name `old` (a dotted path), or None if it is no former name."""
    new = RENAMED.get(old)
    if new is None:
        return None
    return f"{old} is now called {new}"


def former_names(data: Mapping[str, Any]) -> list[str]:
    """What to say of each former name `data` (a config as read, before validation) holds."""
    found = []
    for old in RENAMED:
        *sections, leaf = old.split(".")
        table: Any = data
        for section in sections:
            table = table.get(section) if isinstance(table, Mapping) else None
        if isinstance(table, Mapping) and leaf in table:
            found.append(renamed_message(old) or old)
    return found
