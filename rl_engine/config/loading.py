"""Loading: YAML files and `--set` overrides into a validated `RFTConfig`, errors that name file, field, value and fix."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rl_engine.config.algorithm import PRESETS, AlgorithmConfig
from rl_engine.config.base import ConfigError, hiding_secrets, redact, redact_override
from rl_engine.config.migrate import migrate
from rl_engine.config.model import _REWARD_TAGS
from rl_engine.config.root import RFTConfig, import_plugins
from rl_engine.config.synchronizer import SYNC_TAGS, UNKNOWN_MODE, misplaced
from rl_engine.config.unions import ABSENT, VariantUnion, annotation_at, union_of, variant_defaults
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
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML); raises ConfigError on bad syntax.
    The override is quoted as `redact_override` shows it: a credential's value never is."""
    shown = redact_override(text)
    if "=" not in text:
        raise ConfigError(
            f"--set {shown!r}: expected KEY=VALUE with a dotted key, e.g. --set synchronizer.sync_interval=2"
        )
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set {shown!r}: empty component in key {key!r}")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else None
    except _DuplicateKey as e:
        raise ConfigError(f"--set {shown!r}: {e}") from None
    except yaml.YAMLError as e:
        # YAML's message quotes the value it could not read: not shown when that may be a credential.
        detail = f" ({e})" if shown == text else ""
        raise ConfigError(f"--set {shown!r}: value is not valid YAML{detail}") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a raw config dict (in place) and return it. A list's item is
    named by its index (`monitor.trackers.0.type=wandb`). An override that changes the key that
    selects a section's variant (`placement.type`, `synchronizer.mode`, a loss's `type`, ...)
    switches the section to that variant (`_switch_variant`); one that changes `algorithm.preset`
    takes the new preset's knobs."""
    given: list[tuple[str, ...]] = []  # the paths the overrides before this one set
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            where = ".".join(path[: i + 1])
            if isinstance(node, list):
                index = _index(text, where, part, node)
                child = node[index]
                if child is None:
                    child = node[index] = {}
                u = union_of(annotation_at(path[: i + 1], data))
                if isinstance(child, str) and u is not None:
                    child = node[index] = {u.key: child}  # a union's item given by its name (`trackers: [mlflow]`)
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
            if not isinstance(child, dict | list):
                raise ConfigError(
                    f"--set {redact_override(text)!r}: {part!r} is a value ({redact(child, part)!r}), not a section"
                )
            node = child
        if isinstance(node, list):
            index = _index(text, ".".join(path), path[-1], node)
            old, node[index] = node[index], value
        else:
            old = node.get(path[-1], ABSENT)
            node[path[-1]] = value
            _switch_variant(tuple(path), node, old, value, data, given, text)
        given.append(tuple(path))
    return data


def _index(text: str, where: str, part: str, items: list[Any]) -> int:
    """The list index `part` of an override's path; a ConfigError when it is not one of `items`."""
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(
            f"--set {redact_override(text)!r}: {where.rpartition('.')[0]!r} is a list of {len(items)} item(s): "
            f"name an item by its index{f' (0..{len(items) - 1})' if items else ''}, or set the whole list"
        )
    return int(part)


def _switch_variant(
    path: tuple[str, ...],
    section: dict[str, Any],
    old: Any,
    new: Any,
    data: dict[str, Any],
    given: list[tuple[str, ...]],
    text: str,
) -> None:
    """An override changed the key that selects `section`'s variant (any union of the config:
    rl_engine/config/unions.py) from `old` to `new`, or `algorithm.preset`: the section starts
    from the new variant's defaults and keeps the fields both have.

    Every field of the old variant holds either a choice or the old variant's default (a
    validated config's dump, a deployment's `cfg`, holds every field; a default of the old
    variant, or of its preset for algorithm.loss/advantage, stands for no choice). A field the new
    variant lacks that holds a choice is an error naming it (the switch would silently drop it);
    one at its default goes (`set synchronizer.max_staleness=null` before the switch clears one).
    A field both have is kept when it holds a choice or an override before this one in the same
    list set it; else it goes, so the new variant's default applies. A field neither variant has
    is left for validation to name."""
    if path == ("algorithm", "preset"):
        _switch_preset(section, old, new)
        return
    u = union_of(annotation_at(path[:-1], data))
    if u is None or path[-1] != u.key:
        return
    old = u.default if old is ABSENT else old
    before, after = u.member(old), u.member(new)
    if before is None or after is None or old == new:
        return
    if after is u.other:
        # A plugin's names are registered when it is imported; a plugin that fails is validation's to name.
        with contextlib.suppress(ValueError):
            import_plugins(data.get("plugins"))
        if not u.accepts(new):
            return  # no variant of that name: validation names it, with those that exist
    defaults = {**variant_defaults(before, u.key, old), **_preset_section(path[:-1], data, u.key, old)}
    try:  # the values as the old variant reads them (a file's `sandbox: {cpu_s: 5}` is the whole section a dump holds)
        held = before.model_validate({**section, u.key: old}).model_dump(mode="json")
    except ValidationError:
        held = section
    prefix, lost = path[:-1], []
    for name in [n for n in section if n != u.key and n in before.model_fields]:
        field = (*prefix, name)
        chosen = held.get(name, section[name]) != defaults.get(name, ABSENT)
        if name not in after.model_fields:
            if chosen:
                lost.append(name)
            else:
                del section[name]
        elif not chosen and not any(p[: len(field)] == field or field[: len(p)] == p for p in given):
            del section[name]
    if lost:
        raise ConfigError(
            "\n".join(_lost_field(text, prefix, name, section[name], u, old, new, defaults) for name in lost)
        )


def _lost_field(
    text: str,
    prefix: tuple[str, ...],
    name: str,
    value: Any,
    u: VariantUnion,
    old: Any,
    new: Any,
    defaults: dict[str, Any],
) -> str:
    """The problem line of a field given for variant `old` that variant `new` has no field for, and the fixes."""
    where = ".".join(prefix)
    model = u.member(new)
    whole = ", ".join(
        [f"{u.key}: {new}"] + [f"{n}: ..." for n, f in model.model_fields.items() if f.is_required() and n != u.key]
    )
    scalar = name in defaults and not isinstance(defaults[name], dict | list)
    clear = f" (or --set {where}.{name}={json.dumps(defaults[name])} before the switch)" if scalar else ""
    return (
        f"--set {redact_override(text)!r}: {where}.{name} = {redact(value, name)!r} was given for {u.key} {old!r}, "
        f"and {u.key} {new!r} has no {name}; remove it{clear}, or give the section whole: --set '{where}={{{whole}}}'"
    )


def _preset_section(section: tuple[str, ...], data: dict[str, Any], key: str, old: Any) -> dict[str, Any]:
    """What the config's preset gives `algorithm.loss` / `algorithm.advantage` when that section
    is of variant `old` (dapo's clip_eps_high 0.28): values that stand for no choice either."""
    algorithm = data.get("algorithm")
    if len(section) != 2 or section[0] != "algorithm" or not isinstance(algorithm, dict):
        return {}
    preset = PRESETS.get(algorithm.get("preset", "grpo"), {}).get(section[1])
    return dict(preset) if isinstance(preset, dict) and preset.get(key) == old else {}


def _switch_preset(section: dict[str, Any], old: Any, new: Any) -> None:
    """`algorithm.preset` changed: the knobs that hold the old preset's expansion go (knobs set
    otherwise stay, laid over the new preset)."""
    if old in PRESETS and new in PRESETS and old != new:
        expanded = AlgorithmConfig.model_validate({"preset": old}).model_dump(mode="json")
        for knob in {k for knobs in PRESETS.values() for k in knobs}:
            if knob in section and section[knob] == expanded.get(knob):
                del section[knob]


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
    raises ConfigError naming source, field, value and rule, and none of the credentials `data` holds."""
    with hiding_secrets(data):
        try:
            current, _ = migrate(data)
            return RFTConfig.model_validate(current)
        except ValidationError as e:
            raise ConfigError(_format_errors(source, e, current)) from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> RFTConfig:
    """Load a YAML file, apply `--set` overrides, validate; an error names none of the
    credentials of the file or the overrides."""
    with hiding_secrets(overrides=overrides):
        data = read_yaml(path)
        with hiding_secrets(data):
            return validate_config(apply_overrides(data, overrides or []), str(path))


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
