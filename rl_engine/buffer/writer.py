"""BufferWriter: how an explorer puts a batch of experiences into the run's buffer.

One `write(explorer_step, batch)` = one Arrow IPC file under
`buffer/explorer=<id>/step=<e>/part-<uuid>.arrow`, then one commit record under
`buffer/_commits/`. The data file is complete before its record exists, so a reader (which
only follows records) never sees a partial file; a writer killed at any point leaves at most an
orphan data/temp file that nothing reads (the mode's flow removes it when the run's attempt
ends: `sweep.py`).

Each writer instance has a random writer id and numbers its commits 1, 2, 3, ...; readers track
consumption per (writer id, seq), which is what makes exactly-once exact (see reader.py).
Writers are thread-safe, and any number of them (threads, processes, machines) may write to one
buffer at once: they never touch the same path.

Durability: with `fsync=False` (default) a killed writer process still loses nothing committed
(the page cache outlives it); after a power loss a committed file can come back torn, which
the reader detects by size/checksum and reports per `buffer.on_corrupt`, never as wrong rows.
`fsync=True` flushes data and record to disk before `write` returns (survives power loss;
costs about one disk flush per step on local disk; object stores ignore it).

    w = BufferWriter(*run.fs(), explorer_id=0)     # the run's (filesystem, directory): rl_engine.run.context
    uri = w.write(1, batch)

Tests: `.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_io.py`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow.compute as pc

from rl_engine.buffer import _files
from rl_engine.experience import ExperienceBatch
from rl_engine.proc.failpoints import failpoint
from rl_engine.storage import join


class BufferWriter:
    """Writes experiences of one explorer; safe to share between threads."""

    def __init__(
        self,
        fs: Any,
        root: str,
        explorer_id: int,
        *,
        fsync: bool = False,
        before_commit: Callable[[], None] | None = None,
    ):
        """A writer into the buffer of the run at `root` of filesystem `fs`."""
        self.fs, self.root = fs, root
        self.before_commit = before_commit  # raises to refuse the commit (rl_engine.run.lease.Fence.check: a writer whose driver lost the run's lease)
        self.explorer_id = int(explorer_id)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._writer = _files.new_writer_id()
        self._seq = 0

    def write(self, explorer_step: int, batch: ExperienceBatch) -> str:
        """Write and commit `batch` as one file of explorer step `explorer_step`; returns its URI.

        Every row must carry this writer's explorer_id and `explorer_step` (the path says so too).
        """
        if explorer_step < 0:
            raise ValueError(f"explorer_step = {explorer_step} must be >= 0")
        table = batch.to_table()
        self._check_ids(table, explorer_step)
        with self._lock:
            self._seq += 1
            writer, seq = self._writer, self._seq
        try:
            rel = _files.data_relpath(self.explorer_id, explorer_step)
            path = join(_files.buffer_root(self.root), rel)
            info = _files.write_data(self.fs, path, table, fsync=self.fsync)
            failpoint("buffer.after_data", explorer_step)
            key = _files.CommitKey(time.time_ns(), self.explorer_id, writer, seq)
            record = {
                "format": _files.RECORD_FORMAT,
                "path": rel,
                "explorer_id": self.explorer_id,
                "explorer_step": int(explorer_step),
                "num_rows": len(batch),
                "committed_at": key.time_ns / 1e9,
                **info,
            }
            if self.before_commit is not None:
                self.before_commit()
            _files.put_json(self.fs, _files.record_path(self.root, key), record, fsync=self.fsync)
        except BaseException:
            # A failed seq is a permanent gap in this writer's numbering; starting a new writer id
            # keeps the reader's per-writer watermark moving instead of tracking every later seq.
            with self._lock:
                if self._writer == writer:
                    self._writer, self._seq = _files.new_writer_id(), 0
            raise
        return self.fs.unstrip_protocol(path)

    def _check_ids(self, table, explorer_step: int) -> None:
        if not table.num_rows:
            return
        ids = table.column("explorer_id").to_numpy()
        steps = table.column("explorer_step").to_numpy()
        if not (np.all(ids == self.explorer_id) and np.all(steps == explorer_step)):
            bad_id = pc.unique(table.column("explorer_id")).to_pylist()
            bad_step = pc.unique(table.column("explorer_step")).to_pylist()
            raise ValueError(
                f"BufferWriter(explorer_id={self.explorer_id}).write(step={explorer_step}): rows carry "
                f"explorer_id {bad_id} / explorer_step {bad_step}; they must match the writer and the step"
            )
