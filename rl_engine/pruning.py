"""Keep-last pruning of a run's numbered, committed directories: the policy and the delete.

Two kinds of numbered directories grow with a run, each pruned by its owner after a write:

    trainer_state/step=<t>/      COMMITTED marks it whole    rl_engine.run.retention (trainer states)
    checkpoints/version=<v>/     _COMMITTED marks it whole   rl_engine.sync.checkpoint (the checkpoint sender)
    checkpoints/delta=<v>/       _COMMITTED marks it whole   rl_engine.sync.delta (the delta checkpoint sender; keeps the bases kept versions need)

Both apply the same rules: committed directories beyond the newest `keep_last` go unless an owner
protects them; uncommitted directories older than the newest committed one are leftovers (a
crashed write or delete) and go too; a newer one may be a write in progress and stays. Deleting
removes the commit marker first, then the rest: a delete cut short leaves an uncommitted
directory, which no reader loads and no resume picks, and the next prune finishes it.
`to_delete` and `pointer_target` are pure; `list_dirs`, `committed` and `delete` touch storage.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rl_engine.proc.failpoints import failpoint
from rl_engine.storage import join

FAILPOINT = "retention.after_marker"  # RFT_FAILPOINT=retention.after_marker@<n>: killed between marker and rest


@dataclass(frozen=True)
class Kind:
    """Numbered directories `<parent>/<prefix><n>/` of a run, committed when `<marker>` exists in one."""

    parent: str
    prefix: str
    marker: str

    def dir(self, root: str, n: int) -> str:
        return join(root, self.parent, f"{self.prefix}{n}")


def to_delete(
    committed: Iterable[int], uncommitted: Iterable[int], keep_last: int | None, protected: Iterable[int]
) -> list[int]:
    """Numbers to delete, ascending: committed ones outside the newest `keep_last` and not
    `protected`, and uncommitted ones older than the newest committed (leftovers; a newer one may
    be a write in progress). `keep_last` None deletes nothing; 0 keeps only `protected`."""
    committed = sorted(set(committed))
    if keep_last is None or not committed:
        return []
    keep = set(committed[-keep_last:] if keep_last else []) | set(protected)  # fewer than keep_last: all
    old = [n for n in committed if n not in keep]
    leftovers = [n for n in set(uncommitted) - set(committed) if n < committed[-1] and n not in keep]
    return sorted(old + leftovers)


def pointer_target(model_url: str | None, run_url: str, kind: Kind) -> int | None:
    """The number of the `kind` directory of the run at `run_url` that `model_url` points into, or None."""
    if not model_url:
        return None
    m = re.match(re.escape(f"{run_url.rstrip('/')}/{kind.parent}/{kind.prefix}") + r"(\d+)(/|$)", model_url)
    return int(m.group(1)) if m else None


def list_dirs(fs: Any, root: str, kind: Kind) -> tuple[list[int], list[int]]:
    """(committed, uncommitted) numbers of the `kind` directories under the run at `root`."""
    fs.invalidate_cache()  # object-store listings are cached; deletion needs the current one
    number = re.compile(re.escape(kind.prefix) + r"(\d+)$")
    found = {
        int(m.group(1))
        for p in fs.glob(join(root, kind.parent, f"{kind.prefix}*"))
        if (m := number.search(p.rstrip("/").rsplit("/", 1)[-1]))
    }
    committed = {n for n in found if fs.exists(join(kind.dir(root, n), kind.marker))}
    return sorted(committed), sorted(found - committed)


def committed(fs: Any, root: str, kind: Kind) -> list[int]:
    """The committed numbers of the `kind` directories under the run at `root`, ascending (one listing of their markers)."""
    fs.invalidate_cache()  # object-store listings are cached; readers need the current one
    number = re.compile(re.escape(kind.prefix) + r"(\d+)$")
    found = (
        number.search(p.rstrip("/").rsplit("/", 2)[-2])
        for p in fs.glob(join(root, kind.parent, f"{kind.prefix}*", kind.marker))
    )
    return sorted(int(m.group(1)) for m in found if m)


def delete(fs: Any, root: str, kind: Kind, numbers: Iterable[int]) -> None:
    """Delete the `kind` directories `numbers`, each marker first (then it is no longer committed
    for any reader), then the rest; an interrupted delete leaves only an uncommitted directory."""
    for n in numbers:
        d = kind.dir(root, n)
        marker = join(d, kind.marker)
        if fs.exists(marker):
            fs.rm(marker)
        failpoint(FAILPOINT, n)
        if fs.exists(d):
            fs.rm(d, recursive=True)
    fs.invalidate_cache()


def prune(fs: Any, root: str, kind: Kind, keep_last: int | None, protect: Callable[[list[int]], set[int]]) -> list[int]:
    """List the `kind` directories, delete what `to_delete` picks with `protect(committed)` (the
    numbers the owner keeps whatever `keep_last` says) protected; returns the numbers deleted."""
    if keep_last is None:
        return []
    committed, uncommitted = list_dirs(fs, root, kind)
    doomed = to_delete(committed, uncommitted, keep_last, protect(committed))
    delete(fs, root, kind, doomed)
    return doomed
