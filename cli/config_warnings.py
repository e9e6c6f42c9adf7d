"""The warnings `rft validate` and `rft run` print about a config: its own (rl_engine.config.config_warnings)
and that of a file in an older version's shape, on stderr."""

from __future__ import annotations

import sys


def migration_warnings(path: str, notes: list[str]) -> list[str]:
    """What `rft config migrate` would change in an older version's config file, as warnings (the file loads either way)."""
    return (
        [f"{path} is in an older shape ({'; '.join(notes)}); `rft config migrate {path}` rewrites it"] if notes else []
    )


def print_warnings(warnings: list[str]) -> None:
    """A config's warnings (rl_engine.config.config_warnings) on stderr, one `warning:` line each."""
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
