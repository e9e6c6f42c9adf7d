"""The documentation's two generated pages: the configuration reference, read from the pydantic
models (every field reachable from `RFTConfig`, each union shown per variant), and the CLI
reference, read from the argument parsers (`rft` and the subcommands whose engine module parses
its own arguments). `make docs` writes them; tests/test_docs.py fails when the committed pages
differ from what this module generates, so they never drift from the code.

    python -m cli.docs_reference            # write docs/reference/config.md and docs/reference/cli.md
    python -m cli.docs_reference --check    # exit 1 naming each page that is out of date

No Prefect import: the config package and the parsers only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from rl_engine.config.unions import _flat, _is_model

REPO = Path(__file__).resolve().parents[1]
CONFIG_PAGE = "docs/reference/config.md"
CLI_PAGE = "docs/reference/cli.md"
# argparse wraps help to the terminal's width; a fixed one keeps the generated page the same everywhere.
HELP_COLUMNS = "100"

# ---------------------------------------------------------------- configuration reference


@dataclass(frozen=True)
class Row:
    """One field of one model at one path: a line of the configuration reference."""

    path: str
    type: str
    default: str
    allowed: str
    description: str


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models a field holds: itself, a union's members, a list's or a dict's items."""
    out = []
    for t in _flat(annotation):
        if get_origin(t) in (list, dict):
            out += _models_in(get_args(t)[-1])
        elif _is_model(t):
            out.append(t)
    return out


def _bounds(metadata: list[Any]) -> list[str]:
    """`>= 1`, `pattern ...` and the like, from a field's (or an Annotated type's) constraints."""
    out = []
    for m in metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"length >= {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            out.append(f"length <= {m.max_length}")
        if getattr(m, "pattern", None) is not None:
            out.append(f"matches `{m.pattern}`")
    return out


def _type_name(t: Any) -> str:
    """A field's type in words: `int`, `str or null`, `list of str`, `section`."""
    origin = get_origin(t)
    if t is type(None):
        return "null"
    if origin is Annotated:
        inner, *meta = get_args(t)
        bounds = _bounds([m for x in meta for m in (x.metadata if isinstance(x, FieldInfo) else [x])])
        return _type_name(inner) + (f" ({', '.join(bounds)})" if bounds else "")
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in get_args(t)]
        return " or ".join(dict.fromkeys(names))
    if origin is Literal:
        return " or ".join(dict.fromkeys(type(v).__name__ for v in get_args(t)))
    if origin is list:
        return f"list of {_type_name(get_args(t)[0])}"
    if origin is tuple:
        return f"pair of {_type_name(get_args(t)[0])}" if len(get_args(t)) == 2 else "tuple"
    if origin is dict:
        return f"mapping of str to {_type_name(get_args(t)[1])}"
    if _is_model(t):
        return "section"
    if t is Any:
        return "any"
    return getattr(t, "__name__", str(t))


def _literals(t: Any) -> list[Any]:
    """Every Literal value a type allows (inside unions, lists and Annotated too)."""
    origin = get_origin(t)
    if origin is Literal:
        return list(get_args(t))
    if origin in (Annotated, Union, types.UnionType, list):
        return [v for a in get_args(t)[: 1 if origin is Annotated else None] for v in _literals(a)]
    return []


def _value(v: Any) -> str:
    """A default or allowed value as YAML writes it: null, true, 0.2, rft, [q_proj, k_proj]."""
    v = to_jsonable_python(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    return json.dumps(v)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is PydanticUndefined:  # pragma: no cover - is_required() covers it
        return "required"
    return f"`{_value(value)}`"


def _cell(text: str) -> str:
    """Text in a table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(path: str, field: FieldInfo) -> Row:
    ann = field.annotation
    models = _models_in(ann)
    literals = _literals(ann)
    allowed = [f"`{_value(v)}`" for v in literals] + _bounds(field.metadata)
    if models and len(models) > 1:
        kind = "list of sections" if any(get_origin(t) is list for t in _flat(ann)) else "section"
        type_ = f"{kind}, one variant of {len(models)} (below)"
    elif models:
        type_ = "list of sections" if any(get_origin(t) is list for t in _flat(ann)) else "section"
        if type(None) in _flat(ann):
            type_ += " or null"
    else:
        type_ = _type_name(ann)
    return Row(path, type_, _default(field), ", ".join(allowed), field.description or "")


@dataclass
class Section:
    """A table of the reference: the fields of one model at one path (a union's variant: `variant` says which)."""

    path: str
    model: type[BaseModel]
    variant: str  # `mode: fully_async, multi_explorer`; "" for a plain section
    rows: list[Row]


def _variant_label(model: type[BaseModel], siblings: list[type[BaseModel]]) -> str:
    """What selects `model` among its union's members: its `type` or `mode` literal values, or any other name."""
    for key in ("type", "mode"):
        field = model.model_fields.get(key)
        if field is not None and all(key in m.model_fields for m in siblings):
            values = _literals(field.annotation)
            if values:
                return f"{key}: " + ", ".join(str(v) for v in values)
            return f"{key}: a plugin's registered name"
    return model.__name__


def sections(root: type[BaseModel] | None = None) -> list[Section]:
    """Every table of the configuration reference, in the models' field order, depth first."""
    if root is None:
        from rl_engine.config import RFTConfig

        root = RFTConfig
    out: list[Section] = []

    def walk(model: type[BaseModel], path: str, variant: str) -> None:
        section = Section(path, model, variant, [])
        out.append(section)
        nested = []
        for name, field in model.model_fields.items():
            list_item = any(get_origin(t) is list for t in _flat(field.annotation))
            here = f"{path}.{name}" if path else name
            section.rows.append(_row(here, field))
            models = _models_in(field.annotation)
            inner = f"{here}.<i>" if list_item and models else here
            nested += [(m, inner, _variant_label(m, models) if len(models) > 1 else "") for m in models]
        for m, p, v in nested:
            walk(m, p, v)

    walk(root, "", "")
    return out


def field_count(root: type[BaseModel] | None = None) -> int:
    """The rows of the configuration reference: every (path, variant, field) the models have."""
    return sum(len(s.rows) for s in sections(root))


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def config_reference() -> str:
    """The configuration reference page (Markdown)."""
    found = sections()
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m cli.docs_reference` (`make docs`) from rl_engine/config/; do not edit. -->",
        "",
        "Every field of a run's config (`rl_engine.config.RFTConfig`), by its dotted path: the path",
        "`--set` takes, errors name and the Prefect form shows. A section whose variant one key selects",
        "(`type`, or the synchronizer's `mode`) has a table per variant; a list's items are `<i>`",
        "(`--set monitor.trackers.0.type=wandb`). `rft validate --schema` prints the same as JSON schema.",
        f"{field_count()} fields in all.",
        "",
    ]
    for s in found:
        if not s.path:
            title, level = "Top level", "##"
        else:
            title, level = f"`{s.path}`", "##" if "." not in s.path else "###"
        if s.variant:
            title += f" ({s.variant})"
        lines += [f"{level} {title}", ""]
        if _doc(s.model):
            lines += [_doc(s.model), ""]
        lines += ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
        for r in s.rows:
            cells = (f"`{r.path}`", r.type, r.default, r.allowed, r.description)
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI reference


@contextlib.contextmanager
def _help_width() -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _delegated_help(module: str) -> str:
    """The help of a subcommand whose engine module parses its own arguments: `main(["--help"])`'s output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        importlib.import_module(module).main(["--help"])
    return out.getvalue()


def _delegate_module(parser: argparse.ArgumentParser) -> str | None:
    fn = parser.get_default("fn")
    cells = getattr(fn, "__closure__", None) or ()
    names = [c.cell_contents for c in cells if isinstance(c.cell_contents, str)]
    return names[0] if names else None


def cli_reference() -> str:
    """The CLI reference page (Markdown): `rft --help` and every subcommand's."""
    from cli.main import build_parser

    lines = [
        "# CLI reference",
        "",
        "<!-- Generated by `python -m cli.docs_reference` (`make docs`) from cli/main.py's parser; do not edit. -->",
        "",
        "The `rft` command and each subcommand's `--help`, as the parsers print them. A user mistake",
        "(a bad config, a missing file) prints one message and exits 2.",
        "",
    ]
    with _help_width():
        root = build_parser()
        lines += ["## rft", "", "```text", root.format_help().rstrip(), "```", ""]

        def add(name: str, parser: argparse.ArgumentParser) -> None:
            module = _delegate_module(parser)
            text = _delegated_help(module) if module else parser.format_help()
            lines.extend([f"## rft {name}", "", "```text", text.rstrip(), "```", ""])
            for sub, p in _subparsers(parser).items():
                add(f"{name} {sub}", p)

        for name, parser in _subparsers(root).items():
            add(name, parser)
    return "\n".join(lines)


PAGES: dict[str, Callable[[], str]] = {CONFIG_PAGE: config_reference, CLI_PAGE: cli_reference}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cli.docs_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed page is out of date")
    a = ap.parse_args(argv)
    stale = []
    for page, make in PAGES.items():
        text = make() + "\n"
        path = REPO / page
        if path.exists() and path.read_text() == text:
            continue
        if a.check:
            stale.append(page)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {page}")
    if stale:
        print(f"out of date (run `make docs`): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
