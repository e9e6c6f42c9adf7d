"""Low-level file handling of the buffer: layout, Arrow IPC bytes, commit records, checksums.

Everything here is stateless; `writer.py`, `reader.py`, `continuations.py` and `stats.py` build
on it. Paths are fsspec paths (no protocol) inside the filesystem returned by `open_storage`.

Layout under `<run>/buffer/`:
    explorer=<id>/step=<e>/part-<uuid>.arrow     data, one Arrow IPC file, written whole
    _commits/<commit key>.json                    one commit record per data file, written last
    cursor/step=<t>.json                          the trainer's consumption state

A commit key is `<unix ns:020d>-e<explorer id>-<writer id>-<seq:09d>`: it sorts by commit time,
and (writer id, seq) identifies the record exactly (see reader.py for why both matter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
import zlib
from typing import Any

import fsspec
import pyarrow as pa

from rl_engine.errors import UserError
from rl_engine.experience import ExperienceBatch, SchemaError
from rl_engine.storage import is_local, join, write_bytes_atomic, write_json

RECORD_FORMAT = 1
BUFFER_DIR = "buffer"
COMMITS_DIR = "_commits"


class CorruptFileError(UserError):
    """A committed file that cannot be read back as it was written; names the file."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"{path}: {reason}. Nothing was deleted: restore the file from a copy, or set buffer.on_corrupt: skip "
            "(for a started run, in its config.yaml) to leave it out, counted in the report"
        )


@dataclasses.dataclass(frozen=True, order=True)
class CommitKey:
    """Parsed commit record name; ordering = commit order (time first)."""

    time_ns: int
    explorer_id: int
    writer: str
    seq: int

    @property
    def name(self) -> str:
        return f"{self.time_ns:020d}-e{self.explorer_id}-{self.writer}-{self.seq:09d}"

    @classmethod
    def parse(cls, name: str) -> "CommitKey | None":
        """Key of a record file name (basename, with or without .json); None if not a record."""
        stem = name.rsplit("/", 1)[-1]
        if not stem.endswith(".json"):
            return None
        parts = stem[:-5].split("-")
        if len(parts) != 4 or not parts[1].startswith("e"):
            return None
        try:
            return cls(int(parts[0]), int(parts[1][1:]), parts[2], int(parts[3]))
        except ValueError:
            return None


def new_writer_id() -> str:
    return uuid.uuid4().hex[:16]


def buffer_root(root: str) -> str:
    return join(root, BUFFER_DIR)


def commits_dir(root: str) -> str:
    return join(root, BUFFER_DIR, COMMITS_DIR)


def data_relpath(explorer_id: int, explorer_step: int) -> str:
    """Path of a new data file relative to `buffer/` (hive-style partitions for Arrow tools)."""
    return f"explorer={explorer_id}/step={explorer_step}/part-{uuid.uuid4().hex}.arrow"


# --------------------------------------------------------------------------- bytes


def table_to_ipc(table: pa.Table) -> pa.Buffer:
    """Arrow IPC *file* format bytes (readable by pa.ipc.open_file and pyarrow.dataset)."""
    # Size it first (MockOutputStream only counts), then write once into an exact buffer:
    # a growing BufferOutputStream would reallocate and copy several times.
    mock = pa.MockOutputStream()
    with pa.ipc.new_file(mock, table.schema) as w:
        w.write_table(table)
    buf = pa.allocate_buffer(mock.size())
    with pa.ipc.new_file(pa.FixedSizeBufferWriter(buf), table.schema) as w:
        w.write_table(table)
    return buf


def crc32(data) -> int:
    # zlib's crc32 runs at several GB/s here: cheap next to the I/O it guards.
    return zlib.crc32(memoryview(data)) & 0xFFFFFFFF


def put_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, fsync: bool = True) -> None:
    """Every small JSON file of the buffer (records, cursor, manifest) goes through here (a test seam)."""
    write_json(fs, path, obj, fsync=fsync)


def write_data(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, fsync: bool = True) -> dict[str, int]:
    """Write a table as one IPC file atomically; returns {size, crc32} for its commit record."""
    data = table_to_ipc(table)
    info = {"size": data.size, "crc32": crc32(data)}
    write_bytes_atomic(fs, path, data, fsync=fsync)
    return info


def _read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> pa.Buffer:
    if is_local(fs):
        # Arrow's own file reader: its allocator reuses memory (no page faults per file), and
        # the result feeds pa.ipc without a copy.
        with pa.OSFile(path) as f:
            return f.read_buffer()
    return pa.py_buffer(fs.cat_file(path))


def read_data(
    fs: fsspec.AbstractFileSystem, path: str, *, size: int | None, crc: int | None, uri: str, num_rows: int | None = None, verify: bool = True
) -> ExperienceBatch:
    """Read a committed data file and check it against its record; CorruptFileError names `uri`.

    Size (always) and CRC (if `verify`) are checked before parsing, so a torn or altered file
    never yields rows; the schema check then names the column of a file written by an
    incompatible version.
    """
    try:
        data = _read_bytes(fs, path)
    except FileNotFoundError:
        raise CorruptFileError(uri, "committed but missing") from None
    if size is not None and data.size != size:
        raise CorruptFileError(uri, f"size {data.size} bytes, its commit record says {size}: truncated or overwritten")
    if verify and crc is not None and crc32(data) != crc:
        raise CorruptFileError(uri, "checksum mismatch with its commit record: the file was altered after commit")
    try:
        table = pa.ipc.open_file(data).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise CorruptFileError(uri, f"not a readable Arrow IPC file ({e})") from None
    try:
        batch = ExperienceBatch.from_table(table, source=uri)
    except SchemaError as e:
        raise CorruptFileError(uri, str(e).removeprefix(f"{uri}: ")) from None
    if num_rows is not None and len(batch) != num_rows:
        raise CorruptFileError(uri, f"{len(batch)} rows, its commit record says {num_rows}")
    return batch


def list_names(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """Basenames in `directory`, freshly listed (no fsspec listing cache); [] if it does not exist."""
    try:
        if is_local(fs):
            return os.listdir(directory)
        fs.invalidate_cache(directory)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)]
    except FileNotFoundError:
        return []


def list_commits(fs: fsspec.AbstractFileSystem, root: str) -> list[CommitKey]:
    """All commit keys visible now, in commit order."""
    keys = (CommitKey.parse(n) for n in list_names(fs, commits_dir(root)))
    return sorted(k for k in keys if k is not None)


def read_record(fs: fsspec.AbstractFileSystem, root: str, key: CommitKey) -> dict[str, Any]:
    path = join(commits_dir(root), key.name + ".json")
    try:
        record = json.loads(fs.cat_file(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFileError(fs.unstrip_protocol(path), f"unreadable commit record ({e})") from None
    if record.get("format") != RECORD_FORMAT:
        raise CorruptFileError(fs.unstrip_protocol(path), f"commit record format {record.get('format')!r}, expected {RECORD_FORMAT}")
    return record
