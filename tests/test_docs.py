"""The documentation site (mkdocs.yml, docs/) against the code: the generated reference pages are
what the code generates today, the configuration reference has a row for every field of the
models, every page is in the site's navigation, and `make docs` / `make docs-serve` run what
they say. CI builds the site itself (`make docs` in .ci/run: mkdocs build --strict).

    .venv/bin/python -m pytest tests/test_docs.py -q
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel

from cli import docs_reference
from rl_engine.config.unions import _flat

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_reference_pages_are_what_the_code_generates():
    for page, make in docs_reference.PAGES.items():
        committed = (REPO / page).read_text()
        assert committed == make() + "\n", f"{page} is out of date: run `make docs` and commit it"


def _paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted path of every field reachable from `model`, once per union member that has it
    (a list's items are `<i>`, a mapping's values carry no path of their own). Walked apart from
    the generator's walk, so that a field the generator skips is counted here."""
    out = []
    for name, field in model.model_fields.items():
        path = prefix + name
        out.append(path)
        for t in _flat(field.annotation):
            inner, item = (
                (_flat(get_args(t)[-1]), ".<i>" if get_origin(t) is list else "")
                if get_origin(t) in (list, dict)
                else ([t], "")
            )
            for m in inner:
                if isinstance(m, type) and issubclass(m, BaseModel):
                    out += _paths(m, f"{path}{item}.")
    return out


def test_the_config_reference_lists_every_field_of_the_models():
    from rl_engine.config import RFTConfig

    page = (REPO / docs_reference.CONFIG_PAGE).read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", page, re.MULTILINE)
    expected = _paths(RFTConfig)
    assert sorted(rows) == sorted(expected), (
        f"reference rows missing: {sorted(set(expected) - set(rows))}; extra: {sorted(set(rows) - set(expected))}"
    )
    assert len(rows) == docs_reference.field_count() and f"{len(rows)} fields in all." in page
    # Unions are shown per variant: the synchronizer's two shapes, every built-in reward and loss.
    for heading in (
        "## `synchronizer` (mode: synchronous, one_step_off_policy)",
        "## `synchronizer` (mode: fully_async, multi_explorer)",
        "### `taskset.reward` (type: code_tests)",
        "### `algorithm.loss` (type: cispo)",
        "### `monitor.trackers.<i>` (type: wandb)",
    ):
        assert heading in page
    # A field's row carries its type, default, allowed values and description.
    assert re.search(
        r"^\| `synchronizer.max_backlog_steps` \| int or null \| `8` \| >= 1 \| Without max_staleness",
        page,
        re.MULTILINE,
    )
    assert "| `model.dtype` | str | `float32` | `float32`, `bfloat16`, `float16` |" in page


def test_the_cli_reference_has_every_subcommand():
    from cli.main import build_parser

    page = (REPO / docs_reference.CLI_PAGE).read_text()
    parser = build_parser()
    for name, sub in docs_reference._subparsers(parser).items():
        assert f"## rft {name}\n" in page
        for inner in docs_reference._subparsers(sub):
            assert f"## rft {name} {inner}\n" in page
    # The subcommands whose engine module parses its own arguments show that module's options.
    assert "usage: rft buffer stats" in page and "--node-rank" in page


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return []


def test_every_page_is_in_the_nav():
    """mkdocs only logs a page left out of `nav` (at INFO, which --strict lets pass): this fails on it."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert sorted(nav) == pages


def test_the_readmes_links_reach_files_and_headings():
    """The README sits outside the site, so mkdocs does not check its links into docs/: this does."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(#[^)]*)?\)", text)
    assert len(links) > 20
    for path, anchor in links:
        assert (REPO / path).is_file(), f"README links to {path}, which is not in the repository"
        assert not anchor, f"README links to {path}{anchor}: link the page, its anchors are the site's"


def _dry(*args: str) -> str:
    return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_make_docs_regenerates_the_reference_and_builds_strictly():
    out = _dry("docs")
    assert "-m cli.docs_reference" in out and "mkdocs build --strict" in out
    assert "-m cli.docs_reference --check" in _dry("docs", "DOCS_REFERENCE=--check")
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.index("make lint") < ci.index("make docs DOCS_REFERENCE=--check") < ci.index("make test")


def test_make_docs_serve_serves_the_site():
    out = _dry("docs-serve")
    assert "-m cli.docs_reference" in out and "mkdocs serve" in out


def test_the_prefect_screenshots_are_the_ones_their_script_makes():
    """docs/guides/prefect.md shows each screenshot harness/prefect_screens.py makes (and no
    other docs/img/prefect-*.png), each a PNG kept small (the script reduces it to a palette)."""
    from harness.prefect_screens import SHOTS

    page = (REPO / "docs" / "guides" / "prefect.md").read_text()
    shown = set(re.findall(r"\(\.\./img/(prefect-[^)]+\.png)\)", page))
    committed = {p.name for p in (REPO / "docs" / "img").glob("prefect-*.png")}
    assert shown == committed == set(SHOTS), (shown, committed, set(SHOTS))
    for name in SHOTS:
        png = (REPO / "docs" / "img" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) < 300_000, (name, len(png))
    assert "harness/prefect_screens.py" in page
