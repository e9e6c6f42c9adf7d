"""Loading: YAML files and `--set` overrides into a validated `RFTConfig`, errors that name file, field, value and fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from rl_engine.config.algorithm import PRESETS, AlgorithmConfig
from rl_engine.config.base import ConfigError, redact
from rl_engine.config.migrate import migrate
from rl_engine.config.model import _REWARD_TAGS
from rl_engine.config.placement import DeploymentsPlacement, LocalPlacement
from rl_engine.config.root import RFTConfig
from rl_engine.config.synchronizer import (
    DECOUPLED_MODES,
    RENDEZVOUS_MODES,
    SYNC_TAGS,
    UNKNOWN_MODE,
    DecoupledSync,
    RendezvousSync,
    misplaced,
)
from rl_engine.registry import ESTIMATORS, LOSSES


def _format_errors(source: str, err: ValidationError, data: Any) -> str:
    lines = [f"{source}: invalid configuration ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    mode = _given_mode(data)
    return "\n".join(lines + [f"  {_problem(e, mode)}" for e in err.errors()])


def _given_mode(data: Any) -> Any:
    """The synchronizer mode a raw config gives (synchronous when it gives none)."""
    sync = data.get("synchronizer") if isinstance(data, dict) else None
    return sync.get("mode", "synchronous") if isinstance(sync, dict) else "synchronous"


def _problem(e: Any, mode: Any) -> str:
    """One line of a validation error: the field's dotted path as in the YAML, its value, the rule and the fix."""
    # Drop the union tags pydantic inserts after `reward` and `synchronizer` so the path reads like the YAML.
    parts = e["loc"]
    loc = ".".join(str(p) for i, p in enumerate(parts) if not (i and (parts[i - 1], p) in _UNION_TAGS))
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == UNKNOWN_MODE:
        given = e["input"].get("mode") if isinstance(e["input"], dict) else e["input"]
        return (
            f"{loc}.mode = {given!r}: unknown mode; {msg}"
            if isinstance(e["input"], dict)
            else f"{loc} = {given!r}: must be a section with a mode; {msg}"
        )
    if e["type"] == "missing":
        return f"{loc}: required field missing"
    if e["type"] == "extra_forbidden":
        wrong_variant = (
            misplaced(loc.removeprefix("synchronizer."), e.get("input"), mode)
            if loc.startswith("synchronizer.")
            else None
        )
        if wrong_variant:
            return wrong_variant
        msg = "unknown key; remove it or check its spelling against `rft validate --schema`"
    if e["type"] == "finite_number":
        msg = "must be a finite number (not NaN or infinity); give a number within the field's bounds (`rft validate --schema`)"
    if not loc or msg.startswith((f"{loc}.", f"{loc} ")):
        return msg  # a section's own check names its fields (and the section's whole input says nothing more)
    return (
        f"{loc} = {redact(e.get('input'), parts[-1] if parts else None)!r}: {msg}"  # a refused credential is not echoed
    )


_UNION_TAGS = (
    {("reward", tag) for tag in _REWARD_TAGS}
    | {("synchronizer", tag) for tag in SYNC_TAGS}
    | {(section, tag) for section, reg in (("loss", LOSSES), ("advantage", ESTIMATORS)) for tag in reg.names()}
    | {(section, tag) for section in ("loss", "advantage", "reward", "workflow") for tag in ("python", "registered")}
)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML); raises ConfigError on bad syntax."""
    if "=" not in text:
        raise ConfigError(
            f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. --set synchronizer.sync_interval=2"
        )
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set {text!r}: empty component in key {key!r}")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else None
    except _DuplicateKey as e:
        raise ConfigError(f"--set {text!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({e})") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a raw config dict (in place) and return it."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is a value ({child!r}), not a section")
            node = child
        old = node.get(path[-1], _ABSENT)
        node[path[-1]] = value
        _switch_variant(tuple(path), node, old, value)
    return data


_ABSENT = object()


def _switch_variant(path: tuple[str, ...], section: dict[str, Any], old: Any, new: Any) -> None:
    """An override changed the key that selects `section`'s variant (`placement.type`,
    `synchronizer.mode`) or its preset (`algorithm.preset`) from `old` to `new`: drop what only
    stood for the old one, so the new one's defaults apply. A validated config's dump (a
    deployment's `cfg`, a run's config.yaml) holds every field: `placement.devices: null` of the
    local variant was an unknown key of the deployments one, grpo's expanded knobs hid a new
    preset's. Dropped: the old variant's fields the new one lacks that hold the old one's default
    (a value given otherwise stays, for validation to name), and the knobs that hold the old
    preset's expansion (knobs set otherwise stay, laid over the new preset)."""
    if old is _ABSENT or old == new or not isinstance(old, str) or not isinstance(new, str):
        return
    if path == ("algorithm", "preset"):
        if old in PRESETS and new in PRESETS:
            expanded = AlgorithmConfig.model_validate({"preset": old}).model_dump(mode="json")
            for knob in {k for knobs in PRESETS.values() for k in knobs}:
                if knob in section and section[knob] == expanded.get(knob):
                    del section[knob]
        return
    variants: dict[Any, Any] = {
        ("placement", "type"): {"local": LocalPlacement, "deployments": DeploymentsPlacement},
        ("synchronizer", "mode"): {
            **dict.fromkeys(RENDEZVOUS_MODES, RendezvousSync),
            **dict.fromkeys(DECOUPLED_MODES, DecoupledSync),
        },
    }.get(path, {})
    before, after = variants.get(old), variants.get(new)
    if before is None or after is None:
        return
    for name, field in before.model_fields.items():
        stood_for_old = name in section and name not in after.model_fields and not field.is_required()
        if stood_for_old and section[name] == to_jsonable_python(field.get_default(call_default_factory=True)):
            del section[name]


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping; `str()` names it and both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (at any depth): plain YAML
    keeps the last, so a second `trainer:` section would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges; keys given beside it override, as YAML means
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base loader names it
            if first is not None:
                raise _DuplicateKey(
                    f"line {line}: key {key!r} given twice in one section (first at line {first}); "
                    "YAML would keep only the last one, so merge the two into one or delete one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: bytes | str, source: str) -> Any:
    """YAML text (a config file's bytes) -> its data; ConfigError naming `source` when it is not
    UTF-8, not YAML, or gives a key twice in one mapping."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            line = text.count(b"\n", 0, e.start) + 1
            column = e.start - (text.rfind(b"\n", 0, e.start) + 1) + 1
            raise ConfigError(
                f"{source}: not UTF-8 text (byte 0x{text[e.start]:02x} at line {line}, column {column}); save the file as UTF-8"
            ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: config file not found")
    data = parse_yaml(p.read_bytes(), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: top level must be a mapping of sections (model, taskset, ...), got {type(data).__name__}"
        )
    return data


def validate_config(data: dict[str, Any], source: str = "<config>") -> RFTConfig:
    """Validate a raw dict into an RFTConfig, after migrating an older version's shape (`migrate`);
    raises ConfigError naming source, field, value and rule."""
    try:
        current, _ = migrate(data)
        return RFTConfig.model_validate(current)
    except ValidationError as e:
        raise ConfigError(_format_errors(source, e, current)) from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> RFTConfig:
    """Load a YAML file, apply `--set` overrides, validate."""
    data = apply_overrides(read_yaml(path), overrides or [])
    return validate_config(data, str(path))


def to_yaml(cfg: BaseModel) -> str:
    """YAML text of a config, in field order (what `config.yaml` of a run holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def migrate_file(path: str | Path) -> list[str]:
    """Rewrite a config file into today's shape in place; the notes of what changed ([] and the file
    untouched when it is current). ConfigError, the file untouched, when the result would not load.
    The leading comment block is kept; comments elsewhere are not (PyYAML does not read them)."""
    p = Path(path)
    new, notes = migrate(read_yaml(p))
    validate_config(
        new, str(path)
    )  # refuse (a value with no meaning in its mode, ...), naming field and fix, before touching the file
    if notes:
        p.write_text(
            "".join(_leading_comments(p.read_text(encoding="utf-8"))) + yaml.safe_dump(new, sort_keys=False),
            encoding="utf-8",
        )
    return notes


def _leading_comments(text: str) -> list[str]:
    """The lines of a file's opening comment block (blank lines within it included)."""
    lines = text.splitlines(keepends=True)
    n = next((i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), len(lines))
    return lines[:n]
