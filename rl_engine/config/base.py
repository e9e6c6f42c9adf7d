"""The base of every config section (unknown keys refused, numbers finite) and the error of a config that cannot be used."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Union
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Tag

from rl_engine.errors import UserError


class _Model(BaseModel):
    # allow_inf_nan=False: a NaN passes every bound (each comparison is false), an inf every lower one;
    # no field of a run means anything by them, so they are refused as not finite.
    # hide_input_in_errors: a ValidationError's text (Prefect's state message of a flow whose
    # parameter failed, a traceback) never shows a value, which may be a credential; the errors'
    # `input` stays for loading's messages, which redact it.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False, hide_input_in_errors=True
    )


class ConfigError(UserError, ValueError):
    """A config that cannot be used; `str()` is the full user-facing message, one problem per line."""


_SECRET_KEYS = {
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "passphrase",
    "api_key",
    "apikey",
    "private_key",
    "credentials",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "session_token",
    "fsspec_s3_key",
}
_SECRET_SUFFIXES = ("_secret", "_token", "_password", "_api_key", "_secret_access_key", "_credentials")
# A tokenizer's special tokens end in `_token` too (a reward's or workflow's `eos_token` kwarg).
_TOKENIZER_TOKENS = {f"{t}_token" for t in ("eos", "bos", "pad", "unk", "sep", "cls", "mask", "stop", "end", "start")}


def is_secret_name(key: Any) -> bool:
    """Whether a key names a credential (`secret`, `AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, ...)."""
    name = str(key).lower()
    return name in _SECRET_KEYS or (name.endswith(_SECRET_SUFFIXES) and name not in _TOKENIZER_TOKENS)


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


# ---- the one redaction of what a config's values reach: messages, logs, state messages, terminals.
# `redact` hides the credentials of a value by its structure; `secrets_in` lists the strings it
# hides, so that `scrub` takes them out of any text made from that value (a message that quotes a
# `set` list, a dict's repr, a YAML error's excerpt); `hiding_secrets` applies it to the errors a
# block raises. Every place that formats a config value or a `set` list into output goes through
# these (rl_engine/config/loading.py, flows/common.py, cli/run.py).

REDACTED = "<redacted>"
# Shorter strings are not searched for in text (they would garble it); `redact` still hides them by place.
_MIN_SCRUBBED = 4


def secrets_in(value: Any, key: Any = None) -> set[str]:
    """The strings `redact(value, key)` hides: every leaf under a credential's key (`secret`,
    `AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, ...), the user and password of a URL."""
    if key is not None and is_secret_name(key):
        return {str(v) for v in _leaves(value) if v is not None and not isinstance(v, bool)}
    if isinstance(value, str) and "://" in value and "@" in value:
        parts = urlsplit(value)
        return {p for p in (parts.username, parts.password) if p}
    if isinstance(value, dict):
        return set().union(*(secrets_in(v, k) for k, v in value.items()))
    if isinstance(value, list):
        return set().union(*(secrets_in(v) for v in value))
    return set()


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def secrets_in_override(text: Any) -> set[str]:
    """The credentials a `set` override (`KEY=VALUE`, VALUE in YAML) gives: all of VALUE when a
    component of KEY names one (`buffer.storage.options.secret=...`), else what `secrets_in` finds
    in VALUE (`placement.job_variables={trainer: {env: {HF_TOKEN: ...}}}`, a URL's password). A
    VALUE that is not YAML is all secret when a word in it names a credential."""
    if not isinstance(text, str):
        return set()
    key, sep, raw = text.partition("=")
    if not sep:  # not an override (`HF_TOKEN: hf_...`): all of it, when a word in it names a credential
        return {text.strip()} if any(is_secret_name(w) for w in _WORD.findall(text)) else set()
    secret_key = next((part for part in key.strip().split(".") if is_secret_name(part)), None)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return {raw.strip()} if secret_key or any(is_secret_name(w) for w in _WORD.findall(raw)) else set()
    found = secrets_in(value, secret_key)
    return found | {raw.strip()} if secret_key and raw.strip() else found


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret (as given, and as `repr` would escape it) replaced by <redacted>."""
    forms = {f for s in secrets if len(s) >= _MIN_SCRUBBED for f in (s, repr(s)[1:-1], repr(s))}
    for form in sorted(forms, key=len, reverse=True):  # the longest first: a secret inside another's form
        text = text.replace(form, REDACTED)
    return text


def redact_override(text: str) -> str:
    """A `set` override as it may be shown: `KEY=<redacted>` for a credential's key, a credential inside VALUE replaced."""
    key, sep, raw = str(text).partition("=")
    return key + sep + scrub(raw, secrets_in_override(text)) if sep else scrub(str(text), secrets_in_override(text))


def redact_overrides(overrides: Iterable[str] | None) -> list[str]:
    """A `set` list as it may be shown (`redact_override` of each)."""
    return [redact_override(t) for t in overrides or []]


def secrets_of(data: Any = None, overrides: Iterable[str] | None = None) -> set[str]:
    """Every credential of a raw config (`secrets_in`) and of a `set` list (`secrets_in_override`)."""
    return secrets_in(data) | set().union(*(secrets_in_override(t) for t in overrides or []))


@contextmanager
def hiding_secrets(data: Any = None, overrides: Iterable[str] | None = None) -> Iterator[None]:
    """A UserError (ConfigError, ...) raised in the block names none of the credentials of `data`
    (a raw config) and `overrides` (a `set` list): its message is scrubbed of them, whatever
    formatted it. Its type and traceback stay; what it was raised from is dropped (it may quote them).
    The credentials are read on entry (the block may change `data`)."""
    secrets = secrets_of(data, overrides)
    try:
        yield
    except UserError as e:
        if secrets:
            e.args = tuple(scrub(a, secrets) if isinstance(a, str) else a for a in e.args)
            e.__cause__, e.__suppress_context__ = None, True
        raise


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


def _no_credentials(kwargs: dict[str, Any]) -> dict[str, Any]:
    found = find_secret(kwargs)
    if found:
        raise ValueError(
            f"kwargs.{found} names a credential, and the config is saved with the run (config.yaml) and shown as the flow run's "
            "parameters in the Prefect UI. Read it in your code from the environment instead (os.environ[...]), set where the "
            "code runs (the shell of `rft run`, or every worker's environment under placement deployments)"
        )
    return kwargs


# The keyword arguments a config passes to user or plugin code (rewards, workflows, estimators,
# losses, task makers): any JSON value, but no credential, which would be stored with the run.
Kwargs = Annotated[dict[str, Any], AfterValidator(_no_credentials)]


def variants(*models: type[_Model], registered: type[_Model]) -> Any:
    """A union on `type` of `models` (the built-ins and `type: python`, each by its `type` literal)
    and `registered`, which takes every other name (a plugin's, checked against its registry)."""
    tags = {m.model_fields["type"].annotation.__args__[0]: m for m in models}

    def tag(v: Any) -> str:
        t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return t if t in tags else "registered"

    members = tuple(Annotated[m, Tag(t)] for t, m in tags.items()) + (
        Annotated[registered, Tag("registered"), _NoneOf(tuple(tags))],
    )
    return Annotated[Union[members], Discriminator(tag)]  # noqa: UP007 - a Union of a tuple built at runtime


class _NoneOf:
    """The JSON schema of a union's `registered` member: its `type` is none of the built-in names.
    The union's schema is a `oneOf`, and a JSON-schema validator (Prefect's server checks a
    deployment's parameters against it) found `{type: arithmetic}` valid under both the
    arithmetic variant and the registered one's `type: string`, which `oneOf` refuses: `prefect
    deploy` failed with a 422 on every mode deployment."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> Any:
        schema = handler(core_schema)
        handler.resolve_ref_schema(schema)["properties"]["type"]["not"] = {"enum": list(self.names)}
        return schema


def check_registered(registry: Any, name: str) -> str:
    """`name` when a plugin registered it in `registry`; else the error listing what is registered."""
    if name not in registry:
        raise ValueError(registry.unknown(name))
    return name
