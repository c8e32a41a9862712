"""What every config section shares: unknown fields are errors, values are frozen, and a config
that cannot run raises ConfigError, whose message names every bad field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from decentrl.errors import DecentrlError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(DecentrlError, ValueError):
    """A configuration that cannot run; the message names every bad field."""
