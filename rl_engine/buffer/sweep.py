"""What a killed writer leaves in the buffer, and removing it once no writer can be running.

A writer killed between its data file and its commit record (`BufferWriter.write`) leaves a
complete Arrow file under `buffer/explorer=<id>/step=<e>/` that no record names, and on local
disk a killed write can leave a `.tmp-*` file. Nothing in this project reads either (readers
follow records), but plain Arrow tools reading the directory (the README's pyarrow recipe)
count the orphan's rows next to those of the step's rewritten file. The mode's flow removes them
when an attempt of the run has ended: it holds the run's lease and every role has stopped, so a
file no record names can no longer get one.

    python -c "from rl_engine.buffer.sweep import uncommitted_files; from rl_engine.storage import open_storage; print(uncommitted_files(*open_storage('runs/r1')))"
"""

from __future__ import annotations

from typing import Any

from rl_engine.buffer import _files
from rl_engine.buffer.stats import commit_records
from rl_engine.storage import join


def _orphans(fs: Any, root: str) -> list[str]:
    base = _files.buffer_root(root)
    fs.invalidate_cache(base)
    if not fs.isdir(base):
        return []
    named = {join(base, rec["path"]) for _, rec in commit_records(fs, root)}
    found = (p for p in fs.find(base) if p[len(base) :].lstrip("/").startswith("explorer="))
    return sorted(p for p in found if p not in named)


def uncommitted_files(fs: Any, root: str) -> list[str]:
    """URIs of the files under buffer/explorer=*/ of the run at `root` that no commit record names (orphans, temp files)."""
    return [fs.unstrip_protocol(p) for p in _orphans(fs, root)]


def remove_uncommitted(fs: Any, root: str) -> list[str]:
    """Delete what `uncommitted_files` lists; returns the URIs removed. Only while no writer of
    the run can be running (its lease held, its roles stopped): a live writer's data file has no
    record for the moment between its two writes."""
    orphans = _orphans(fs, root)
    if orphans:
        fs.rm(orphans)
    return [fs.unstrip_protocol(p) for p in orphans]
