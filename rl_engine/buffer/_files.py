"""Low-level file handling of the buffer: layout, Arrow IPC bytes, commit records, checksums.

Everything here is stateless; `writer.py`, `reader.py`, `continuations.py` and `stats.py` build
on it. Paths are fsspec paths (no protocol) inside the filesystem returned by `open_storage`.

Checksums. A data file's record carries its size and a checksum of its bytes: XXH3-64
(`xxh3_64`) since record format 2, CRC-32 (`crc32`) before (still verified). XXH3 runs at
memory speed (tens of GB/s); zlib's CRC-32 (~7 GB/s) took as long as pyarrow's whole read of
the file, which made a verified read cost several raw reads.

Layout under `<run>/buffer/`:
    explorer=<id>/step=<e>/part-<uuid>.arrow     data, one Arrow IPC file, written whole
    _commits/<bucket>/<commit key>.json           one commit record per data file, written last
    cursor/step=<t>.json                          the trainer's consumption state

A commit key is `<unix ns:020d>-e<explorer id>-<writer id>-<seq:09d>`: it sorts by commit time,
and (writer id, seq) identifies the record exactly (see reader.py for why both matter). Its
bucket is the first 10 of those 20 digits, one folder per 10 seconds of commit time, so a reader
can list the records of the last minute without listing the whole run (`list_commits` with
`since_ns`). Records directly in `_commits/` (runs written before buckets) are still read.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
import zlib
from typing import Any, NamedTuple

import fsspec
import pyarrow as pa
import xxhash

from rl_engine.errors import UserError
from rl_engine.experience import ExperienceBatch, SchemaError
from rl_engine.storage import is_local, join, write_bytes_atomic, write_chunks, write_json, write_local_atomic

RECORD_FORMAT = 2  # 2: the data file's checksum is `xxh3_64`; 1 (still read): `crc32`
_READ_RECORD_FORMATS = (1, 2)
BUFFER_DIR = "buffer"
COMMITS_DIR = "_commits"
BUCKET_DIGITS = 10  # a bucket = the first 10 of 20 timestamp digits: 10 s of commits
_BUCKET_NS = 10 ** (20 - BUCKET_DIGITS)


class CorruptFileError(UserError):
    """A committed file that cannot be read back as it was written; names the file."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"{path}: {reason}. Nothing was deleted: restore the file from a copy, or set buffer.on_corrupt: skip "
            "(for a started run, in its config.yaml) to leave it out, counted in the report"
        )


class CommitKey(NamedTuple):
    """Parsed commit record name; ordering = commit order (time first). A tuple: readers hash,
    compare and sort these on every poll, which tuples do in C."""

    time_ns: int
    explorer_id: int
    writer: str
    seq: int

    @property
    def name(self) -> str:
        return f"{self.time_ns:020d}-e{self.explorer_id}-{self.writer}-{self.seq:09d}"

    @classmethod
    def parse(cls, name: str) -> CommitKey | None:
        """Key of a record file name (basename, with or without .json); None if not a record."""
        return _parse_record_name(name.rsplit("/", 1)[-1])


@functools.lru_cache(maxsize=4096)  # a poll lists the same recent names again and again
def _parse_record_name(stem: str) -> CommitKey | None:
    if not stem.endswith(".json"):
        return None
    parts = stem[:-5].split("-")
    if len(parts) != 4 or not parts[1].startswith("e"):
        return None
    try:
        return CommitKey(int(parts[0]), int(parts[1][1:]), parts[2], int(parts[3]))
    except ValueError:
        return None


def new_writer_id() -> str:
    return uuid.uuid4().hex[:16]


def buffer_root(root: str) -> str:
    return join(root, BUFFER_DIR)


def commits_dir(root: str) -> str:
    return join(root, BUFFER_DIR, COMMITS_DIR)


def bucket_of(time_ns: int) -> str:
    """Bucket folder name of a commit time (ns); times before 1970 go to the first bucket."""
    return f"{max(0, time_ns) // _BUCKET_NS:0{BUCKET_DIGITS}d}"


def record_path(root: str, key: CommitKey) -> str:
    """Where a writer puts the commit record of `key`."""
    return join(commits_dir(root), bucket_of(key.time_ns), key.name + ".json")


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


class _Crc32:
    """zlib's CRC-32 with xxhash's streaming interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value & 0xFFFFFFFF


CHECKSUM = "xxh3_64"  # what write_data records by default
_CHECKSUMS = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}  # record key -> streaming checksum of the file's bytes


def digest(kind: str, data) -> int:
    """Checksum `kind` (a key of a commit record: xxh3_64 or crc32) of bytes or any buffer."""
    h = _CHECKSUMS[kind]()
    h.update(memoryview(data))
    return h.intdigest()


def checksum_of(meta: dict[str, Any]) -> tuple[str, int] | None:
    """(kind, value) of the data file's checksum in a commit record or manifest entry; None if it has none."""
    for kind in _CHECKSUMS:
        if meta.get(kind) is not None:
            return kind, int(meta[kind])
    return None


def put_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, fsync: bool = True) -> None:
    """Every small JSON file of the buffer (records, cursor, manifest) goes through here (a test seam)."""
    write_json(fs, path, obj, fsync=fsync)


def write_data(
    fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, fsync: bool = True, checksum: str = CHECKSUM
) -> dict[str, int]:
    """Write a table as one IPC file atomically; returns {size, <checksum>} for its commit record."""
    if not is_local(fs):  # one PUT of the whole file
        data = table_to_ipc(table)
        info = {"size": data.size, checksum: digest(checksum, data)}
        write_bytes_atomic(fs, path, data, fsync=fsync)
        return info
    # Local disk: Arrow's writer streams into the temp file through a sink that checksums what
    # passes, with no copy of the file in memory (serialising into memory first made a 5.6 MB
    # write ~15% slower: issue 25's notes).
    sink = _ChecksumSink(checksum)

    def fill(f) -> None:
        sink.out = f
        with pa.PythonFile(sink, mode="w") as out, pa.ipc.new_file(out, table.schema) as w:
            w.write_table(table)

    write_local_atomic(path, fill, fsync=fsync)
    return {"size": sink.size, checksum: sink.hash.intdigest()}


class _ChecksumSink:
    """A write-only file for `pa.PythonFile`: passes Arrow's writes to `out`, checksumming and counting them."""

    closed = False

    def __init__(self, checksum: str):
        self.hash, self.size, self.out = _CHECKSUMS[checksum](), 0, None

    def write(self, data) -> int:
        with memoryview(data) as view:  # Arrow hands its buffers over without a copy
            self.hash.update(view)
            write_chunks(self.out, view)
            self.size += view.nbytes
            return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the temp file is write_local_atomic's to close (after its fsync)
        self.closed = True


_READ_CHUNK = 1 << 18  # checksummed as read, while still in the CPU's cache (cheaper than a second pass over the file)


def _read_checked(fs: fsspec.AbstractFileSystem, path: str, checksum: str | None) -> tuple[pa.Buffer, int | None]:
    """A data file's bytes, and their checksum of kind `checksum` (None: not taken)."""
    if not is_local(fs):
        data = pa.py_buffer(fs.cat_file(path))
        return data, digest(checksum, data) if checksum else None
    h = _CHECKSUMS[checksum]() if checksum else None
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        data = pa.allocate_buffer(size)  # Arrow's pool reuses this memory from file to file: no page faults per read
        got = 0
        with memoryview(data) as view:
            while got < size and (n := f.readinto(view[got : got + _READ_CHUNK])):
                if h is not None:
                    h.update(view[got : got + n])
                got += n
    return (data if got == size else data.slice(0, got)), h.intdigest() if h is not None else None


def _read_small(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    if is_local(fs):
        with open(
            path, "rb"
        ) as f:  # a plain read: fsspec's cat_file or pa.OSFile cost several times more for a small file
            return f.read()
    return fs.cat_file(path)


def read_data(
    fs: fsspec.AbstractFileSystem,
    path: str,
    *,
    size: int | None,
    checksum: tuple[str, int] | None,
    uri: str,
    num_rows: int | None = None,
    verify: bool = True,
) -> ExperienceBatch:
    """Read a committed data file and check it against its record; CorruptFileError names `uri`.

    Size (always) and checksum (`checksum_of(record)`, if `verify`) are checked before parsing,
    so a torn or altered file never yields rows; the schema check then names the column of a
    file written by an incompatible version. The row rules of the schema were checked when the
    batch was built, before it was written: a file whose checksum matches holds those very bytes,
    so they are checked again only when the checksum is not (`verify=False`, or no checksum).
    """
    verified = verify and checksum is not None
    try:
        data, got = _read_checked(fs, path, checksum[0] if verified else None)
    except FileNotFoundError:
        raise CorruptFileError(uri, "committed but missing") from None
    if size is not None and data.size != size:
        raise CorruptFileError(uri, f"size {data.size} bytes, its commit record says {size}: truncated or overwritten")
    if verified and got != checksum[1]:
        raise CorruptFileError(uri, "checksum mismatch with its commit record: the file was altered after commit")
    try:
        table = pa.ipc.open_file(data).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise CorruptFileError(uri, f"not a readable Arrow IPC file ({e})") from None
    try:
        batch = ExperienceBatch.from_table(table, source=uri, check_rows=not verified)
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


def list_commits(
    fs: fsspec.AbstractFileSystem, root: str, since_ns: int | None = None, until_ns: int | None = None
) -> list[tuple[CommitKey, str]]:
    """Commit records visible now, as (key, path) in commit order.

    Without `since_ns`: all of them, a cost that grows with the run (every name; one request
    per 1,000 records on S3). With `since_ns` and `until_ns`: at least the records stamped in
    that span (the result may hold a few more), at a cost set by the span, not by the run: on
    S3 one ListObjectsV2 request (two near a prefix boundary) for a narrow decimal prefix of
    bucket names around the span, starting after `since_ns`; elsewhere the span's bucket
    folders one by one.
    """
    return parse_record_paths(record_paths(fs, root, since_ns, until_ns))


def parse_record_paths(paths) -> list[tuple[CommitKey, str]]:
    """(key, path) of the record paths among `paths`, in commit order."""
    keyed = ((CommitKey.parse(p), p) for p in paths)
    return sorted((k, p) for k, p in keyed if k is not None)


def record_paths(
    fs: fsspec.AbstractFileSystem, root: str, since_ns: int | None = None, until_ns: int | None = None
) -> list[str]:
    """What `list_commits` lists, as paths in no particular order and not parsed (names that
    are not records included): a poll parses only the names it has not seen before."""
    directory = commits_dir(root)
    if since_ns is None:
        return _all_record_paths(fs, directory)
    first, last = max(0, since_ns) // _BUCKET_NS, max(0, until_ns if until_ns is not None else since_ns) // _BUCKET_NS
    if _is_s3(fs):
        after = f"{bucket_of(since_ns)}/{max(0, since_ns):020d}"
        return [p for prefix in _bucket_prefixes(first, last) for p in _s3_list_after(fs, directory, prefix, after)]
    paths = []
    for i in range(first, last + 1):
        bucket = f"{directory}/{i:0{BUCKET_DIGITS}d}"
        paths += [f"{bucket}/{n}" for n in list_names(fs, bucket)]
    return paths


def _all_record_paths(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    if not is_local(fs):
        fs.invalidate_cache(directory)
        try:
            return fs.find(directory)  # on S3 one recursive listing: one request per 1,000 records
        except FileNotFoundError:
            return []
    out = []
    for name in list_names(fs, directory):
        if name.endswith(".json"):  # a record from before buckets
            out.append(join(directory, name))
        elif len(name) == BUCKET_DIGITS and name.isdigit():
            out += [join(directory, name, n) for n in list_names(fs, join(directory, name))]
    return out


def _bucket_prefixes(first: int, last: int) -> list[str]:
    """One or two decimal prefixes of bucket names (two across a boundary like ...99 | ...00) that
    cover buckets first..last, each at most ten times as wide as that span.

    Some servers (moto, other S3-compatible stores) filter and sort every key under a listing's
    prefix before applying StartAfter; a narrow prefix keeps that work near the window.
    """
    k = len(str(last - first + 1))
    if k >= BUCKET_DIGITS:
        return [""]
    return sorted({f"{b // 10**k:0{BUCKET_DIGITS - k}d}" for b in (first, last)})


def _is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "s3" in protocols and hasattr(fs, "call_s3")


def _s3_list_after(fs, directory: str, prefix: str, after: str) -> list[str]:
    """Paths of the objects under `directory/prefix` whose key sorts after `directory/after` (S3 StartAfter).

    s3fs's ls/find have no start-after, so this pages through ListObjectsV2 itself.
    """
    bucket, key, _ = fs.split_path(directory)
    kwargs = {"Bucket": bucket, "Prefix": f"{key}/{prefix}", "StartAfter": f"{key}/{after}"}
    out = []
    while True:
        page = fs.call_s3("list_objects_v2", **kwargs)
        out += [f"{bucket}/{o['Key']}" for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return out
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


def read_record(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    """The commit record at `path` (from `list_commits`), checked for its format."""
    try:
        record = json.loads(_read_small(fs, path))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFileError(fs.unstrip_protocol(path), f"unreadable commit record ({e})") from None
    if record.get("format") not in _READ_RECORD_FORMATS:
        expected = " or ".join(map(str, _READ_RECORD_FORMATS))
        raise CorruptFileError(
            fs.unstrip_protocol(path), f"commit record format {record.get('format')!r}, expected {expected}"
        )
    return record
