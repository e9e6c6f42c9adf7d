"""The base of every config section (unknown keys refused, numbers finite) and the error of a config that cannot be used."""

from __future__ import annotations

from typing import Annotated, Any, Union
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Discriminator, Tag

from rl_engine.errors import UserError


class _Model(BaseModel):
    # allow_inf_nan=False: a NaN passes every bound (each comparison is false), an inf every lower one;
    # no field of a run means anything by them, so they are refused as not finite.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False)


class ConfigError(UserError, ValueError):
    """A config that cannot be used; `str()` is the full user-facing message, one problem per line."""


_SECRET_KEYS = {
    "key",
    "secret",
    "token",
    "password",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "session_token",
    "fsspec_s3_key",
}
_SECRET_SUFFIXES = ("_secret", "_token", "_password", "_api_key", "_secret_access_key", "_credentials")


def is_secret_name(key: Any) -> bool:
    """Whether a key names a credential (`secret`, `AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, ...)."""
    name = str(key).lower()
    return name in _SECRET_KEYS or name.endswith(_SECRET_SUFFIXES)


def redact(value: Any, key: Any = None) -> Any:
    """`value` with every value under a credential's key replaced by '<redacted>', and the user
    and password of a URL (`http://user:pw@host`) too (for messages: an error about a secret must
    not print it)."""
    if key is not None and is_secret_name(key):
        return "<redacted>"
    if isinstance(value, str) and "://" in value and "@" in value:
        parts = urlsplit(value)
        if parts.username is not None or parts.password is not None:
            return urlunsplit(parts._replace(netloc="<redacted>@" + parts.netloc.rsplit("@", 1)[1]))
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def find_secret(options: Any, prefix: str = "") -> str | None:
    """Dotted path of the first key in a nested dict that names a credential (`key`, `secret`,
    `AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, `WANDB_API_KEY`, ...), or None. Config sections that are
    saved with a run (storage options, job variables) refuse such keys."""
    if isinstance(options, dict):
        for k, v in options.items():
            if is_secret_name(k):
                return f"{prefix}{k}"
            found = find_secret(v, f"{prefix}{k}.")
            if found:
                return found
    return None


def variants(*models: type[_Model], registered: type[_Model]) -> Any:
    """A union on `type` of `models` (the built-ins and `type: python`, each by its `type` literal)
    and `registered`, which takes every other name (a plugin's, checked against its registry)."""
    tags = {m.model_fields["type"].annotation.__args__[0]: m for m in models}

    def tag(v: Any) -> str:
        t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return t if t in tags else "registered"

    members = tuple(Annotated[m, Tag(t)] for t, m in tags.items()) + (Annotated[registered, Tag("registered")],)
    return Annotated[Union[members], Discriminator(tag)]  # noqa: UP007 - a Union of a tuple built at runtime


def check_registered(registry: Any, name: str) -> str:
    """`name` when a plugin registered it in `registry`; else the error listing what is registered."""
    if name not in registry:
        raise ValueError(registry.unknown(name))
    return name
