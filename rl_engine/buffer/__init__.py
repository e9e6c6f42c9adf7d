"""The experience buffer: Arrow IPC files on any fsspec URL, committed, read FIFO exactly once.

    from rl_engine.buffer import BufferWriter, BufferReader, save_cursor, load_cursor, ContinuationStore

- writer.py: BufferWriter, one committed Arrow file per write (explorers).
- reader.py: BufferReader, FIFO batches with staleness / whole-group rules (trainer); how commit
  order and exactly-once work is documented there.
- cursor.py: the reader's consumption state and save_cursor / load_cursor.
- continuations.py: ContinuationStore for unfinished (partial) rollouts.
- stats.py: `rft buffer stats RUN` (`python -m rl_engine.buffer.stats RUN`).
- synthetic.py: experience batches of a given shape for tests and benchmarks.

Tests: `.venv/bin/python -m pytest tests/rl_engine/buffer/` (add `-m "not slow"` for the quick ones).
"""

from rl_engine.buffer._files import CorruptFileError
from rl_engine.buffer.continuations import ContinuationEntry, ContinuationStore
from rl_engine.buffer.cursor import list_cursor_steps, load_cursor, save_cursor
from rl_engine.buffer.reader import BufferReader, BufferTimeout
from rl_engine.buffer.writer import BufferWriter

__all__ = [
    "BufferReader",
    "BufferTimeout",
    "BufferWriter",
    "ContinuationEntry",
    "ContinuationStore",
    "CorruptFileError",
    "list_cursor_steps",
    "load_cursor",
    "save_cursor",
]
