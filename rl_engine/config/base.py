"""The base of every config section (unknown keys refused, numbers finite) and the error of a config that cannot be used."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rl_engine.errors import UserError


class _Model(BaseModel):
    # allow_inf_nan=False: a NaN passes every bound (each comparison is false), an inf every lower one;
    # no field of a run means anything by them, so they are refused as not finite.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False)


class ConfigError(UserError, ValueError):
    """A config that cannot be used; `str()` is the full user-facing message, one problem per line."""
