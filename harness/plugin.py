"""The README's plugin (its "Extending rft" section) as an importable module in a directory of
the caller's, outside the repository's packages, as a user would have it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_block(marker: str) -> str:
    """The fenced code block right after `<!-- plugin: NAME -->` in README.md."""
    text = (REPO / "README.md").read_text()
    m = re.search(rf"<!-- plugin: {re.escape(marker)} -->\n```\w*\n(.*?)\n```", text, re.DOTALL)
    if m is None:
        raise LookupError(f"README.md has no code block after <!-- plugin: {marker} -->")
    return m.group(1) + "\n"


def readme_yaml_after(heading_text: str) -> str:
    """The first ```yaml block after the line containing `heading_text`."""
    text = (REPO / "README.md").read_text()
    start = text.index(heading_text)
    m = re.search(r"```yaml\n(.*?)\n```", text[start:], re.DOTALL)
    if m is None:
        raise LookupError(f"README.md has no yaml block after {heading_text!r}")
    return m.group(1) + "\n"


def write_readme_plugin(directory: Path) -> str:
    """Write README.md's my_plugin.py into `directory`; returns the module name."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "my_plugin.py").write_text(readme_block("my_plugin.py"))
    return "my_plugin"
