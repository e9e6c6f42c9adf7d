"""The base of every config section: unknown keys refused, numbers finite."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    # allow_inf_nan=False: a NaN passes every bound (each comparison is false), an inf every lower one;
    # no field of a run means anything by them, so they are refused as not finite.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False)
