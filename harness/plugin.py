"""The documentation's plugin (docs/guides/extending.md, "Extending rft") as an importable module in
a directory of the caller's, outside the repository's packages, as a user would have it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "guides" / "extending.md"  # where the plugin is shown to users


def readme_block(marker: str) -> str:
    """The fenced code block right after `<!-- plugin: NAME -->` in the extending guide."""
    text = PAGE.read_text()
    m = re.search(rf"<!-- plugin: {re.escape(marker)} -->\n```\w*\n(.*?)\n```", text, re.DOTALL)
    if m is None:
        raise LookupError(f"{PAGE} has no code block after <!-- plugin: {marker} -->")
    return m.group(1) + "\n"


def readme_yaml_after(heading_text: str) -> str:
    """The first ```yaml block after the line containing `heading_text`."""
    text = PAGE.read_text()
    start = text.index(heading_text)
    m = re.search(r"```yaml\n(.*?)\n```", text[start:], re.DOTALL)
    if m is None:
        raise LookupError(f"{PAGE} has no yaml block after {heading_text!r}")
    return m.group(1) + "\n"


def write_readme_plugin(directory: Path) -> str:
    """Write the extending guide's my_plugin.py into `directory`; returns the module name."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "my_plugin.py").write_text(readme_block("my_plugin.py"))
    return "my_plugin"
