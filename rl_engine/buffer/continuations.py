"""ContinuationStore: an explorer's unfinished (partial) rollouts, persisted between explorer steps.

Same files as the buffer (Arrow IPC, EXPERIENCE_SCHEMA, CRC-32-checked), under
`continuations/explorer=<id>/part-<uuid>.arrow`, plus `_manifest.json` beside them: the manifest
is the source of truth (a Prefect artifact may mirror `manifest()` for people and the next flow
run). A data file is written whole before the manifest names it, and every change of the
manifest is one atomic write, so after a crash the store holds either the old sets or the new
ones. `save(batch, retire=ids)` adds a set and retires the ones it continues in one step, so a
resumed set can never be resumed twice nor lost. `commit(sets, retire=..., state=...)` does the
same for several sets of different kinds at once (`pending`: to be continued; `outbox`: a
finished batch staged before its buffer commit, see rl_engine/roles/partial.py) together with the
owner's state (its task-stream position), which `state()` reads back.

One store per explorer, used by one process at a time (the explorer that owns it); it is
thread-safe within that process.

    store = ContinuationStore(*run.fs(), explorer_id=0)   # the run's (filesystem, directory)
    cid = store.save(unfinished, explorer_step=3)
    batch = store.load([e.id for e in store.list()])
    store.save(still_unfinished, explorer_step=4, retire=[cid])

Tests: `.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_continuations.py`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rl_engine.buffer import _files
from rl_engine.errors import UserError
from rl_engine.experience import ExperienceBatch
from rl_engine.storage import join

MANIFEST_FORMAT = 1
MANIFEST_NAME = "_manifest.json"  # leading underscore: Arrow dataset discovery skips it
STORE_DIR = "continuations"  # <run>/continuations/explorer=<id>/
UNFINISHED = "length"  # finish_reason of a cut generation in the store
_RETIRED_KEPT = 1000  # retired ids remembered so a repeated retire is a no-op


@dataclasses.dataclass(frozen=True)
class ContinuationEntry:
    """One saved set of unfinished trajectories."""

    id: str
    path: str  # file name inside the store directory
    num_rows: int
    response_tokens: int  # tokens generated so far, over all rows
    explorer_step: int | None
    created_at: float
    size: int
    crc32: int
    kind: str = "pending"  # pending (to be continued) | outbox (staged for the buffer)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def store_explorer_ids(fs: Any, root: str) -> list[int]:
    """Ids of the explorers that have a continuation store in the run at `root` (none without partial rollouts); reads only."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(join(root, STORE_DIR), detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(n.split("=", 1)[1]) for n in names if n.startswith("explorer=") and n.split("=", 1)[1].isdigit())


class ContinuationStore:
    """Save / list / load / retire sets of partial rollouts of one explorer."""

    def __init__(self, fs: Any, root: str, explorer_id: int, *, fsync: bool = True):
        """Explorer `explorer_id`'s store in the run at `root` of filesystem `fs`."""
        self.fs = fs
        self.explorer_id = int(explorer_id)
        self.dir = join(root, STORE_DIR, f"explorer={self.explorer_id}")
        self.fsync = fsync
        self._lock = threading.Lock()

    # ---- public API

    def save(
        self, batch: ExperienceBatch | pa.Table, *, explorer_step: int | None = None, retire: Iterable[str] = ()
    ) -> str:
        """Persist a set (validated against the schema); retire `retire` in the same commit; returns its id."""
        if isinstance(batch, pa.Table):
            batch = ExperienceBatch.from_table(batch, source="ContinuationStore.save")
        (cid,) = self.commit([(batch, "pending")], explorer_step=explorer_step, retire=retire)
        return cid

    def commit(
        self,
        sets: list[tuple[ExperienceBatch, str]],
        *,
        explorer_step: int | None = None,
        retire: Iterable[str] = (),
        state: dict[str, Any] | None = None,
        tasks: dict[str, dict[str, Any]] | None = None,
    ) -> list[str | None]:
        """Add sets `(batch, kind)`, retire `retire` and (if given) replace the owner's state and
        add carried tasks (`carried_tasks`), in one manifest write; returns the new ids (None for
        an empty batch, which adds no set)."""
        added: list[ContinuationEntry | None] = []
        for batch, kind in sets:
            if kind not in ("pending", "outbox"):
                raise ValueError(f"continuation set kind {kind!r}: expected pending or outbox")
            if not len(batch):
                added.append(None)
                continue
            cid = uuid.uuid4().hex
            name = f"part-{cid}.arrow"
            info = _files.write_data(
                self.fs, join(self.dir, name), batch.to_table(), fsync=self.fsync, checksum="crc32"
            )  # the manifest entry's field
            tokens = pc.sum(pc.list_value_length(batch.to_table().column("response_ids"))).as_py() or 0
            added.append(
                ContinuationEntry(
                    cid, name, len(batch), int(tokens), explorer_step, time.time(), info["size"], info["crc32"], kind
                )
            )
        with self._lock:
            manifest = self._read_manifest()
            doomed = self._check_retire(manifest, retire)
            manifest["entries"] = [e for e in manifest["entries"] if e["id"] not in doomed] + [
                e.to_dict() for e in added if e is not None
            ]
            if state is not None:
                manifest["state"] = state
            if tasks:
                manifest["tasks"] = {**manifest.get("tasks", {}), **tasks}
            self._commit(manifest, doomed)
        return [e.id if e is not None else None for e in added]

    def state(self) -> dict[str, Any] | None:
        """The owner's state saved by the last `commit(..., state=...)`, or None."""
        return self._read_manifest().get("state")

    def carried_tasks(self) -> dict[str, dict[str, Any]]:
        """{task id: {task_id, prompt, answer, row}} of sets carried in from another run (the previous
        run of a lineage, rl_engine/run/lineage.py), whose tasks this run's task set does not draw."""
        return dict(self._read_manifest().get("tasks", {}))

    def list(self) -> list[ContinuationEntry]:
        """Active (not retired) sets, oldest first."""
        return [ContinuationEntry(**e) for e in self._read_manifest()["entries"]]

    def load(self, ids: Iterable[str] | None = None) -> ExperienceBatch:
        """The rows of the given sets (all active sets if None), in the order given."""
        entries = {e.id: e for e in self.list()}
        wanted = list(entries) if ids is None else list(ids)
        unknown = [i for i in wanted if i not in entries]
        if unknown:
            raise KeyError(
                f"{self._uri(MANIFEST_NAME)}: no active continuation set {unknown} (retired, or never saved by explorer {self.explorer_id})"
            )
        parts = []
        for i in wanted:
            e = entries[i]
            path = join(self.dir, e.path)
            parts.append(
                _files.read_data(
                    self.fs,
                    path,
                    size=e.size,
                    checksum=("crc32", e.crc32),
                    uri=self.fs.unstrip_protocol(path),
                    num_rows=e.num_rows,
                )
            )
        return ExperienceBatch.concat(parts)

    def retire(self, ids: Iterable[str]) -> None:
        """Remove sets (once resumed) in one atomic manifest write; retiring twice is a no-op."""
        with self._lock:
            manifest = self._read_manifest()
            doomed = self._check_retire(manifest, ids)
            if not doomed:
                return
            manifest["entries"] = [e for e in manifest["entries"] if e["id"] not in doomed]
            self._commit(manifest, doomed)

    def manifest(self) -> dict[str, Any]:
        """The manifest as stored (what a Prefect artifact mirrors): entries, totals, URIs."""
        m = self._read_manifest()
        m["uri"] = self._uri(MANIFEST_NAME)
        m["num_rows"] = sum(e["num_rows"] for e in m["entries"])
        m["response_tokens"] = sum(e["response_tokens"] for e in m["entries"])
        for e in m["entries"]:
            e["uri"] = self._uri(e["path"])
        return m

    @property
    def manifest_uri(self) -> str:
        return self._uri(MANIFEST_NAME)

    # ---- internals

    def _uri(self, name: str) -> str:
        return self.fs.unstrip_protocol(join(self.dir, name))

    def _read_manifest(self) -> dict[str, Any]:
        path = join(self.dir, MANIFEST_NAME)
        try:
            m = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return {
                "format": MANIFEST_FORMAT,
                "explorer_id": self.explorer_id,
                "revision": 0,
                "entries": [],
                "retired": [],
            }
        except ValueError as e:
            raise UserError(f"{self._uri(MANIFEST_NAME)}: unreadable continuation manifest ({e})") from None
        if m.get("format") != MANIFEST_FORMAT:
            raise UserError(
                f"{self._uri(MANIFEST_NAME)}: manifest format {m.get('format')!r}, expected {MANIFEST_FORMAT}"
            )
        return m

    def _check_retire(self, manifest: dict[str, Any], ids: Iterable[str]) -> set[str]:
        ids = set(ids)
        active = {e["id"] for e in manifest["entries"]}
        unknown = ids - active - set(manifest["retired"])
        if unknown:
            raise KeyError(f"{self._uri(MANIFEST_NAME)}: cannot retire unknown continuation set(s) {sorted(unknown)}")
        return ids & active

    def _commit(self, manifest: dict[str, Any], retired: set[str]) -> None:
        old_paths = [join(self.dir, f"part-{i}.arrow") for i in sorted(retired)]
        manifest["revision"] += 1
        manifest["retired"] = (manifest["retired"] + sorted(retired))[-_RETIRED_KEPT:]
        _files.put_json(self.fs, join(self.dir, MANIFEST_NAME), manifest, fsync=self.fsync)
        # Only after the manifest no longer names them; a crash here leaves unnamed files, never
        # a named file that is missing.
        for p in old_paths:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass
