"""Retention: a run keeps its last N trainer states and weight checkpoints, never one still needed.

Two kinds of numbered directories grow with a run (layouts: `rl_engine.trainer.checkpoint`,
`rl_engine.sync.checkpoint`):

    trainer_state/step=<t>/      every trainer.checkpoint_interval steps   COMMITTED marks it whole
    checkpoints/version=<v>/     every publish of checkpoint weight sync   _COMMITTED marks it whole

After each save / publish the trainer deletes committed directories beyond the newest
`trainer.keep_last_states` / `synchronizer.keep_last_checkpoints` (null: keep all), except:

* the newest committed trainer state (a resume loads it);
* a checkpoint an explorer may still load: the version just published, and every committed one
  newer than the oldest version an explorer acknowledged loading (`loaded` acks on the run's
  board, `rl_engine.sync.base`; no ack yet counts as nothing loaded). At a rendezvous this is
  exactly the published version (the schedule makes an explorer load the version the trainer
  just sent, never an older one; a resumed one loads `resume_catch_up`, which the trainer sends
  anew); in the decoupled modes an explorer loads whatever `published` it last read, never older
  than what it holds;
* the directory a lineage's `latest.json` model points at, if it points into this run.

Uncommitted directories older than the newest committed one are leftovers (a crashed write or
delete) and go too. Deleting removes the commit marker first, then the rest: a delete cut short
leaves an uncommitted directory, which no reader loads and no resume picks, and the next prune
finishes it. The policy is pure functions (`to_delete`, `needed_checkpoints`); `prune_states` and
`prune_checkpoints` apply it (called by `rl_engine.roles.trainer.TrainerRole` after writing), `delete` deletes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rl_engine.board import Board
from rl_engine.run.context import RunContext
from rl_engine.storage import join
from rl_engine.sync.checkpoint import COMMIT
from rl_engine.trainer.checkpoint import COMMIT_MARKER

FAILPOINT = "retention.after_marker"  # RFT_FAILPOINT=retention.after_marker@<n>: killed between marker and rest


@dataclass(frozen=True)
class Kind:
    """Numbered directories `<parent>/<prefix><n>/` of a run, committed when `<marker>` exists in one."""

    parent: str
    prefix: str
    marker: str

    def dir(self, root: str, n: int) -> str:
        return join(root, self.parent, f"{self.prefix}{n}")


STATES = Kind("trainer_state", "step=", COMMIT_MARKER)  # rl_engine.roles.trainer.STATE_DIR is STATES.parent
CHECKPOINTS = Kind("checkpoints", "version=", COMMIT)


# --------------------------------------------------------------------------- policy (pure)


def to_delete(committed: Iterable[int], uncommitted: Iterable[int], keep_last: int | None, protected: Iterable[int]) -> list[int]:
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


def needed_checkpoints(committed: Iterable[int], published: int, loaded: Iterable[int | None]) -> set[int]:
    """Checkpoint versions an explorer may still load: `published` (just sent) and every committed
    version newer than the oldest one acknowledged in `loaded` (one entry per explorer; None: no
    ack yet, so any version may still be loaded)."""
    oldest = min((-1 if v is None else v for v in loaded), default=-1)
    return {published} | {v for v in committed if v > oldest}


def pointer_target(model_url: str | None, run_url: str, kind: Kind) -> int | None:
    """The number of the `kind` directory of the run at `run_url` that `model_url` points into, or None."""
    if not model_url:
        return None
    m = re.match(re.escape(f"{run_url.rstrip('/')}/{kind.parent}/{kind.prefix}") + r"(\d+)(/|$)", model_url)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- storage


def list_dirs(fs: Any, root: str, kind: Kind) -> tuple[list[int], list[int]]:
    """(committed, uncommitted) numbers of the `kind` directories under the run at `root`."""
    fs.invalidate_cache()  # object-store listings are cached; deletion needs the current one
    number = re.compile(re.escape(kind.prefix) + r"(\d+)$")
    found = {int(m.group(1)) for p in fs.glob(join(root, kind.parent, f"{kind.prefix}*")) if (m := number.search(p.rstrip("/").rsplit("/", 1)[-1]))}
    committed = {n for n in found if fs.exists(join(kind.dir(root, n), kind.marker))}
    return sorted(committed), sorted(found - committed)


def delete(fs: Any, root: str, kind: Kind, numbers: Iterable[int]) -> None:
    """Delete the `kind` directories `numbers`, each marker first (then it is no longer committed
    for any reader), then the rest; an interrupted delete leaves only an uncommitted directory."""
    from rl_engine.run.failpoints import failpoint

    for n in numbers:
        d = kind.dir(root, n)
        marker = join(d, kind.marker)
        if fs.exists(marker):
            fs.rm(marker)
        failpoint(FAILPOINT, n)
        if fs.exists(d):
            fs.rm(d, recursive=True)
    fs.invalidate_cache()


def _lineage_pointer(run: RunContext, kind: Kind) -> set[int]:
    """{n} if the run's lineage's latest.json model points into `kind` directory n of this run."""
    name = run.cfg.lineage.name
    if name is None:
        return set()
    from rl_engine.run.lineage import lineage_url, read_latest

    latest = read_latest(lineage_url(run.cfg.buffer.storage.url, name), run.storage_options) or {}
    n = pointer_target(latest.get("model"), run.url, kind)
    return set() if n is None else {n}


def prune_states(run: RunContext) -> list[int]:
    """After a trainer state was committed: delete states beyond `trainer.keep_last_states`
    (never the newest committed one). Returns the steps deleted."""
    fs, root = run.fs()
    committed, uncommitted = list_dirs(fs, root, STATES)
    protected = set(committed[-1:]) | _lineage_pointer(run, STATES)
    doomed = to_delete(committed, uncommitted, run.cfg.trainer.keep_last_states, protected)
    delete(fs, root, STATES, doomed)
    return doomed


def prune_checkpoints(run: RunContext, board: Board, published: int) -> list[int]:
    """After weight version `published` was sent: with checkpoint sync, delete checkpoints beyond
    `synchronizer.keep_last_checkpoints` that no explorer may still load. Returns the versions deleted."""
    from rl_engine.sync.base import loaded_key

    s = run.cfg.synchronizer
    if s.sync_method != "checkpoint" or s.keep_last_checkpoints is None:
        return []
    fs, root = run.fs()
    committed, uncommitted = list_dirs(fs, root, CHECKPOINTS)
    loaded = [(board.get(loaded_key(i)) or {}).get("version") for i in range(run.cfg.explorer.count)]
    protected = needed_checkpoints(committed, published, loaded) | _lineage_pointer(run, CHECKPOINTS)
    doomed = to_delete(committed, uncommitted, s.keep_last_checkpoints, protected)
    delete(fs, root, CHECKPOINTS, doomed)
    return doomed
