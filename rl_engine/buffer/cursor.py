"""The trainer's cursor: which committed experiences it has consumed, as compact JSON.

Consumption is tracked per writer (the random id of one BufferWriter instance) because each
writer numbers its commits 1, 2, 3, ...: the cursor keeps, per writer, a watermark `upto`
(every seq <= upto is fully decided), the seqs above it that are fully decided (`done`, usually
empty or a few in flight), and row ranges of files decided only in part (`partial`). "Decided"
means handed to the trainer, dropped as stale, or skipped as corrupt: either way never offered
again. The state does not grow with the run's length, only with the number of writer instances.

Saved beside each trainer checkpoint with `save_cursor` and restored with `load_cursor`:

    save_cursor(fs, root, trainer_step=t, state=reader.state_dict())     # fs, root = run.fs()
    reader.load_state_dict(load_cursor(fs, root, trainer_step=t))

Tests: `.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_cursor.py`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from rl_engine.buffer import _files
from rl_engine.errors import UserError
from rl_engine.storage import join

CURSOR_FORMAT = 1
CURSOR_DIR = "cursor"
_STEP_RE = re.compile(r"^step=(\d+)\.json$")


class _WriterState:
    __slots__ = ("done", "partial", "upto")

    def __init__(self, upto: int = 0, done=(), partial: dict[int, list[list[int]]] | None = None):
        self.upto = upto
        self.done: set[int] = set(done)
        self.partial: dict[int, list[list[int]]] = dict(partial or {})

    def mark_done(self, seq: int) -> None:
        self.partial.pop(seq, None)
        if seq > self.upto:
            self.done.add(seq)
        while self.upto + 1 in self.done:
            self.upto += 1
            self.done.discard(self.upto)


class ConsumedSet:
    """Per (writer, seq), which rows are decided; JSON round trip via to_json / from_json."""

    def __init__(self) -> None:
        self._w: dict[str, _WriterState] = {}

    def is_done(self, key: _files.CommitKey) -> bool:
        s = self._w.get(key.writer)
        return s is not None and (key.seq <= s.upto or key.seq in s.done)

    def decided_rows(self, key: _files.CommitKey, num_rows: int) -> np.ndarray:
        """[num_rows] bool: rows of this file already decided."""
        out = np.zeros(num_rows, dtype=bool)
        if self.is_done(key):
            out[:] = True
            return out
        s = self._w.get(key.writer)
        for a, b in s.partial.get(key.seq, []) if s else []:
            out[a:b] = True
        return out

    def mark(self, key: _files.CommitKey, decided: np.ndarray) -> None:
        """Record the full decided-rows mask of a file (all True: the file is done)."""
        s = self._w.setdefault(key.writer, _WriterState())
        if decided.all():
            s.mark_done(key.seq)
        elif decided.any():
            s.partial[key.seq] = _ranges(decided)

    def to_json(self) -> dict[str, Any]:
        return {
            w: {"upto": s.upto, "done": sorted(s.done), "partial": {str(k): v for k, v in sorted(s.partial.items())}}
            for w, s in sorted(self._w.items())
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConsumedSet:
        out = cls()
        for w, s in data.items():
            out._w[w] = _WriterState(
                int(s["upto"]), (int(x) for x in s["done"]), {int(k): v for k, v in s["partial"].items()}
            )
        return out


def _ranges(mask: np.ndarray) -> list[list[int]]:
    """Half-open [a, b) ranges of True runs in a bool mask."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])]


# --------------------------------------------------------------------------- storage


def _cursor_dir(root: str) -> str:
    return join(_files.buffer_root(root), CURSOR_DIR)


def save_cursor(fs: Any, root: str, trainer_step: int, state: dict[str, Any]) -> str:
    """Atomically write the cursor of trainer step `trainer_step` of the run at `root`; returns its URI."""
    path = join(_cursor_dir(root), f"step={int(trainer_step):09d}.json")
    _files.put_json(fs, path, {"format": CURSOR_FORMAT, "trainer_step": int(trainer_step), "state": state})
    return fs.unstrip_protocol(path)


def list_cursor_steps(fs: Any, root: str) -> list[int]:
    """Trainer steps with a saved cursor, ascending."""
    names = _files.list_names(fs, _cursor_dir(root))
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, names) if m)


def load_cursor(fs: Any, root: str, trainer_step: int | None = None) -> dict[str, Any] | None:
    """The state saved at `trainer_step` (None: the latest; returns None if there is none)."""
    if trainer_step is None:
        steps = list_cursor_steps(fs, root)
        if not steps:
            return None
        trainer_step = steps[-1]
    path = join(_cursor_dir(root), f"step={int(trainer_step):09d}.json")
    try:
        data = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise UserError(
            f"{fs.unstrip_protocol(path)}: no buffer cursor saved for trainer step {trainer_step}"
        ) from None
    if data.get("format") != CURSOR_FORMAT:
        raise UserError(f"{fs.unstrip_protocol(path)}: cursor format {data.get('format')!r}, expected {CURSOR_FORMAT}")
    return data["state"]
