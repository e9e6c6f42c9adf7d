"""fsspec access to a run's storage: one place that turns a URL + options into a filesystem.

Credentials are never passed here from the config: fsspec/s3fs read them from the environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or FSSPEC_S3_* variables), so they never reach the
resolved config or logs.

    fs, root = open_storage("s3://bucket/runs", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:5000"}})

Outages: on S3 every request goes through `_call_s3` of the filesystem built here, which keeps
retrying an unreachable store (refused or timed-out connections, 5xx answers) with backoff for up
to `outage_timeout_s` (`buffer.storage.outage_timeout_s`, carried in the options under that key
by `StorageConfig.fs_options()`), then raises `StorageUnavailableError` naming the URL and the
operation. botocore (standard mode) and s3fs retry only a few seconds' worth and have no
deadline, which is why this layer exists. A retried PUT sends the same whole object again, so
an object is still all-or-nothing. Local disk: a full disk (ENOSPC, EDQUOT) is
`StorageFullError` naming the path, and the temp file is removed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import fsspec
import yaml
from fsspec.core import split_protocol, url_to_fs

from rl_engine.errors import UserError

OUTAGE_KEY = "outage_timeout_s"  # the key StorageConfig.fs_options() puts in the options, consumed here
_S3_PROTOCOLS = ("s3", "s3a")
log = logging.getLogger(__name__)


class StorageUnavailableError(UserError):
    """The object store stayed unreachable past `buffer.storage.outage_timeout_s`; names URL and operation.
    `last` is the last error seen (what the endpoint answered, or how the connection failed)."""

    last: BaseException | None = None


class StorageFullError(UserError):
    """Local storage has no space left; names the path."""


def open_storage(url: str, options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path inside it) for a storage URL; local paths become absolute.

    `options` are fsspec options plus, optionally, `outage_timeout_s` (absent: the default of
    `buffer.storage.outage_timeout_s`).
    """
    opts = dict(options or {})
    limit = opts.pop(OUTAGE_KEY, None)
    if split_protocol(url)[0] not in _S3_PROTOCOLS:
        fs, root = url_to_fs(url, **opts)
        return fs, root.rstrip("/")
    if limit is None:
        from rl_engine.config import StorageConfig

        limit = StorageConfig.model_fields[OUTAGE_KEY].default
    config_kwargs = dict(opts.get("config_kwargs") or {})
    config_kwargs.setdefault("retries", {"mode": "standard"})  # jittered, capped backoff for short blips
    fs = _resilient_s3_class()(**{**opts, "config_kwargs": config_kwargs, "outage_timeout_s": float(limit)})
    return fs, fs._strip_protocol(url).rstrip("/")


def add_storage_options_arg(parser: Any) -> None:
    """The `--storage-options` flag of every CLI that opens a run; `parse_storage_options` reads it."""
    parser.add_argument(
        "--storage-options",
        default="{}",
        help='non-secret fsspec options as a JSON object, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\' (credentials come from the environment)',
    )


def parse_storage_options(text: str) -> dict[str, Any]:
    """The fsspec options `--storage-options` gives as JSON; UserError naming the flag if it is not a JSON object."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--storage-options: not valid JSON ({e}); pass a JSON object, e.g. '{{}}'") from None
    if not isinstance(options, dict):
        raise UserError(
            f"--storage-options: expected a JSON object, got {type(options).__name__}; pass a JSON object, e.g. '{{}}'"
        )
    return options


def join(*parts: str) -> str:
    """Join path parts with '/', the separator of every fsspec filesystem."""
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p != "")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local filesystem, where rename is atomic and temp+rename commits are safe."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def file_exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether the file `path` exists (a commit marker, say). On S3 one HEAD: s3fs's `exists`
    lists the prefix as well when the key is missing, in case it names a directory."""
    probe = getattr(fs, "file_exists", None)
    return probe(path) if probe is not None else fs.exists(path)


def shown(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """How a message names `path` of `fs`: the local path itself, or its URL (s3://bucket/...)."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def is_remote(fs: fsspec.AbstractFileSystem) -> bool:
    """True for an object store (S3), where every look at storage is a request; not local disk or memory."""
    return not (is_local(fs) or "memory" in str(fs.protocol))


def poll_interval(fs: fsspec.AbstractFileSystem, configured: float | None = None) -> float:
    """Seconds between looks at storage for news: `configured`, else cheap on local disk, gentle on object stores."""
    if configured is not None:
        return configured
    return 0.1 if is_remote(fs) else 0.005


# --------------------------------------------------------------------------- in-process news
# Every write through this module (write_bytes_atomic, create_exclusive) is news to the waiters of
# this process (`rl_engine.board.poll_until`): roles that share a process (placement `local`) see a
# board marker or a buffer commit of another role at once instead of at their next poll, which
# would otherwise cost each hand-off of a step up to one poll interval. Writes by other processes or
# machines are still found by polling; a waiter never relies on news, it only wakes sooner.
_NEWS = threading.Condition()
_news_seq = 0
_news_paths: collections.deque[tuple[int, str]] = collections.deque(maxlen=256)  # (seq, path) of the latest writes


def news() -> int:
    """The sequence number of this process's latest write (pass it to `wait_news`)."""
    return _news_seq


def _written(path: str) -> None:
    global _news_seq
    with _NEWS:
        _news_seq += 1
        _news_paths.append((_news_seq, path))
        _NEWS.notify_all()


def poke(path: str) -> None:
    """News of `path` without a write: wakes this process's waiters on it (a thread told to end)."""
    _written(path)


def wait_news(seen: int, timeout_s: float, under: str | tuple[str, ...] | None = None) -> None:
    """Wait up to `timeout_s` for a write of this process after `seen` (`news()`); with `under`, one
    to a path that starts with it, or with one of them (a later write elsewhere keeps waiting)."""

    def arrived() -> bool:
        if _news_seq == seen:
            return False
        if under is None or not _news_paths or _news_paths[0][0] > seen + 1:  # the record of some writes fell off: look
            return True
        return any(seq > seen and path.startswith(under) for seq, path in reversed(_news_paths))

    with _NEWS:
        _NEWS.wait_for(arrived, timeout_s)


def written_since(seen: int, path: str) -> bool:
    """Whether this process wrote `path` after `news()` was `seen` (True when unsure: the record of
    some writes fell off)."""
    with _NEWS:
        if _news_seq == seen:
            return False
        if not _news_paths or _news_paths[0][0] > seen + 1:
            return True
        return any(seq > seen and p == path for seq, p in _news_paths)


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: Any, fsync: bool = True) -> None:
    """Make `path` appear whole or not at all (`data`: bytes or any buffer).

    Local disk: write `.tmp-*` beside it (ignored by Arrow tools: leading dot), then rename
    (atomic on POSIX); `fsync` makes it survive a power loss too. Object stores (S3, memory):
    a single PUT is already all-or-nothing.
    """
    if not is_local(fs):
        fs.pipe_file(path, _bytes(data))
        _written(path)
    else:
        write_local_atomic(path, lambda f: write_chunks(f, data), fsync)


def write_local_atomic(path: str, fill: Callable[[BinaryIO], None], fsync: bool = True) -> None:
    """`write_bytes_atomic` on local disk for a file written piece by piece: `fill(f)` writes into
    the temp file (an open binary file), which then becomes `path` by one rename."""
    _write_local(path, fill, fsync, os.replace)
    _written(path)


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: Any, fsync: bool = True) -> bool:
    """Make `path` appear whole with `data` only if no file is there: True if this call created
    it, False if one existed (whoever wrote it). Of any number of racing callers exactly one
    gets True: a hard link on local disk, a conditional PUT (`If-None-Match: *`) on S3 (AWS
    applies it atomically; moto only as the tests start it, harness/s3_server.py; check that an
    S3-compatible store does before sharing a run among hosts).

    On S3 a PUT retried after a timeout may find its own first try's object and answer False;
    callers that must know read the object back (RunLease does).
    """
    if is_local(fs):

        def link(tmp: str, dst: str) -> None:
            os.link(tmp, dst)  # fails if dst exists, atomically
            os.remove(tmp)

        try:
            _write_local(path, lambda f: write_chunks(f, data), fsync, link)
        except FileExistsError:
            return False
        _written(path)
        return True
    try:
        # s3fs sends If-None-Match: *; fsspec's default (memory://, stores without a conditional
        # write) checks and then writes, which is exclusive only within one process.
        fs.pipe_file(path, _bytes(data), mode="create")
    except FileExistsError:
        return False
    _written(path)
    return True


def _bytes(data: Any) -> bytes:
    return data if isinstance(data, bytes) else bytes(memoryview(data))


# Local writes go out one MiB per write(): a single write() of several MiB now and then stalls
# for ~10 ms (measured on ext4: 5 MB in one call took 1.2 ms or 11 ms from run to run, in 1 MiB
# calls 1.2 ms every time), which is also how pyarrow's own file writer issues them (per buffer).
_WRITE_CHUNK = 1 << 20


def write_chunks(f: BinaryIO, data: Any) -> None:
    """Write bytes or any buffer to `f` in calls of at most `_WRITE_CHUNK` bytes."""
    with memoryview(data) as raw, raw.cast("B") as view:
        for start in range(0, view.nbytes, _WRITE_CHUNK):  # noqa: FURB122 - `f` needs only write() (a sink, a test's fake)
            f.write(view[start : start + _WRITE_CHUNK])


def _write_local(path: str, fill: Callable[[BinaryIO], None], fsync: bool, place: Any) -> None:
    """`fill` a temp file beside `path`, then `place(tmp, path)`; no temp file stays."""
    parent = path.rsplit("/", 1)[0]
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
    try:
        os.makedirs(parent, exist_ok=True)
        with open(tmp, "wb") as f:
            fill(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        place(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(
                f"cannot write {path}: {os.strerror(e.errno)}; nothing was written there (files committed before are untouched). "
                "Free space on that filesystem, or point buffer.storage.url at one with room, then resume the run"
            ) from e
        raise


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, fsync: bool = True) -> None:
    write_bytes_atomic(fs, path, json.dumps(obj, sort_keys=True).encode(), fsync=fsync)


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    return json.loads(fs.cat_file(path))


_MARKER_PREVIOUS: dict[
    str, str
] = {}  # marker path -> the file it named before this process's last write (removed at the next)
_MARKER_LOCK = threading.Lock()


def write_marker(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    """A small JSON file rewritten often (a board marker), whole or not at all, without fsync.

    Local disk: the bytes go to a new hidden file beside it (`.<name>.<id>`) and `path` becomes a
    symbolic link to that file, by one rename. Renaming a regular file over an existing one makes
    ext4 start writing the new file back at once (`auto_da_alloc`): 0.2-1 ms a write on the dev
    machine, several under other I/O, and a step's hand-offs post several markers; a link is not a
    regular file. Readers open `path` as before. The file a marker named two writes ago (by this
    process's count) is removed, so a reader that has just resolved the link still finds its file.
    Elsewhere (S3, memory): one PUT, as `write_json`.
    """
    data = json.dumps(obj, sort_keys=True).encode()
    if not is_local(fs):
        write_bytes_atomic(fs, path, data)
        return
    parent, name = path.rsplit("/", 1)
    target = f".{name}.{uuid.uuid4().hex}"
    _write_local(
        f"{parent}/{target}", lambda f: write_chunks(f, data), False, os.replace
    )  # a new name: no file is replaced
    link = f"{parent}/.tmp-{uuid.uuid4().hex}"
    try:
        os.symlink(target, link)
        try:
            before = os.readlink(path)
        except OSError:  # none yet, or a regular file (a marker written before markers were links)
            before = None
        os.replace(link, path)
    except BaseException:
        for leftover in (link, f"{parent}/{target}"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        raise
    with _MARKER_LOCK:
        stale, _MARKER_PREVIOUS[path] = _MARKER_PREVIOUS.get(path), before
    if stale is not None and "/" not in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{parent}/{stale}")
    _written(path)


def read_marker(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A marker `write_marker` wrote (or a plain JSON file); FileNotFoundError if there is none."""
    for attempt in range(3):
        try:
            return read_json(fs, path)
        except FileNotFoundError:
            # The link was there but its file was just removed (a reader stalled across two writes): look again.
            if attempt == 2 or not is_local(fs) or not os.path.islink(path):
                raise
    raise AssertionError("unreachable")


def write_yaml(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    write_bytes_atomic(fs, path, yaml.safe_dump(obj, sort_keys=False).encode())


# --------------------------------------------------------------------------- S3 outages

_OPERATIONS = {"put": "write", "get": "read", "head": "look up", "list": "list", "delete": "delete", "copy": "copy"}


def _unreachable(e: BaseException) -> bool:
    """True for errors that say the store is not answering (worth waiting out), not that the request is wrong."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    cause = e.__cause__ if isinstance(e.__cause__, ClientError) else e
    if isinstance(
        cause, ClientError
    ):  # s3fs turns these into OSError; the status says whether the server is struggling
        return int(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500
    return isinstance(
        e, (ConnectionError, HTTPClientError, asyncio.TimeoutError, ConnectionRefusedError, ConnectionResetError)
    )


# S3 error codes of a refused request (HTTP 403): wrong, missing or expired credentials, or no permission.
_DENIED_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AccountProblem",
    "403",
}


def access_denied(e: BaseException) -> str | None:
    """The S3 error code when `e` (botocore's ClientError, or the PermissionError s3fs makes of it)
    says the store refused the request's credentials or permissions (HTTP 403), else None."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(e, NoCredentialsError) or isinstance(e.__cause__, NoCredentialsError):
        return "NoCredentials"
    cause = e if isinstance(e, ClientError) else e.__cause__
    if not isinstance(cause, ClientError):
        return None
    code = str(cause.response.get("Error", {}).get("Code") or "")
    status = int(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return (code or "403") if code in _DENIED_CODES or status == 403 else None


@functools.cache
def _resilient_s3_class() -> type:
    """s3fs's filesystem whose every request waits out an outage of up to `outage_timeout_s` seconds."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    class ResilientS3FileSystem(s3fs.S3FileSystem):
        def __init__(self, *args: Any, outage_timeout_s: float, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.outage_timeout_s = outage_timeout_s

        async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            deadline, delay, last = start + self.outage_timeout_s, 0.5, None
            while True:
                try:
                    # An attempt may itself hang (a stalled server): the deadline bounds it too.
                    out = await asyncio.wait_for(
                        super()._call_s3(method, *akwarglist, **kwargs), max(deadline - time.monotonic(), 0.01)
                    )
                except Exception as e:  # noqa: BLE001 - sorted by _unreachable; the rest propagate unchanged
                    if not _unreachable(e):
                        raise
                    if last is None:
                        log.warning(
                            "storage %s unreachable (%s: %s); retrying for up to %.0f s",
                            self._url(kwargs),
                            method,
                            type(e).__name__,
                            deadline - time.monotonic(),
                        )
                    last = (
                        e if last is None or not isinstance(e, asyncio.TimeoutError) else last
                    )  # the cut-off attempt says less than what came before
                    if time.monotonic() >= deadline:
                        raise self._outage_error(method, kwargs, time.monotonic() - start, last) from None
                    await asyncio.sleep(min(delay * random.uniform(0.5, 1.0), max(deadline - time.monotonic(), 0)))
                    delay = min(delay * 2, 5.0)
                    continue
                if last is not None:
                    log.warning(
                        "storage %s reachable again after %.1f s (%s)",
                        self._url(kwargs),
                        time.monotonic() - start,
                        method,
                    )
                return out

        call_s3 = sync_wrapper(_call_s3)  # s3fs binds the sync twin to its own _call_s3: rebind it to this one

        async def _cat_file(
            self,
            path: str,
            version_id: str | None = None,
            start: int | None = None,
            end: int | None = None,
            chunksize: int | None = None,
            max_concurrency: int | None = None,
        ) -> bytes:
            """A whole object in one GET up to `default_block_size`; larger ones in concurrent ranges.

            s3fs asks for the size first (a HEAD) before every whole read, and a missing key costs
            it a HEAD and a listing; board markers, commit records and configs are polled and read
            all the time, so that doubled every request a run makes. The first block's GET tells
            the size instead (its Content-Range), and a missing key is its 404."""
            if start is not None or end is not None or (max_concurrency or self.max_concurrency) <= 1:
                return await super()._cat_file(path, version_id, start, end, chunksize, max_concurrency)
            from s3fs.core import version_id_kw

            bucket, key, vers = self.split_path(path)
            block, versions = chunksize or self.default_block_size, version_id_kw(version_id or vers)
            try:
                resp = await self._call_s3(
                    "get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{block - 1}", **versions
                )
            except FileNotFoundError as e:
                raise FileNotFoundError(
                    path
                ) from e  # as s3fs's own miss says it: the path, not S3's "key does not exist"
            except OSError as e:
                if (
                    getattr(e.__cause__, "response", {}).get("Error", {}).get("Code") == "InvalidRange"
                ):  # an empty object has no byte 0
                    return b""
                raise
            try:
                first = await resp["Body"].read()
            finally:
                resp["Body"].close()
            total = int(str(resp.get("ContentRange") or f"/{len(first)}").rsplit("/", 1)[1])
            if total <= len(first):
                return first
            return await self._cat_file_concurrent(
                bucket, key, total, block, max_concurrency, version_id=version_id or vers
            )

        async def _exists(self, path: str) -> bool:
            bucket, key, _ = self.split_path(path)
            if bucket and not key:
                # s3fs takes any failure of its bucket probe for "no such bucket"; an outage must say so instead.
                try:
                    await self._call_s3("head_bucket", Bucket=bucket)
                    return True
                except StorageUnavailableError:
                    raise
                except Exception:  # noqa: BLE001 - not found, forbidden: s3fs's own probes decide
                    pass
            return await super()._exists(path)

        exists = sync_wrapper(_exists)

        async def _file_exists(self, path: str) -> bool:
            from s3fs.core import version_id_kw

            bucket, key, vers = self.split_path(path)
            if not key:
                return await self._exists(path)
            try:
                await self._call_s3("head_object", Bucket=bucket, Key=key, **version_id_kw(vers))
                return True
            except FileNotFoundError:
                return False

        file_exists = sync_wrapper(_file_exists)

        def _url(self, kwargs: dict[str, Any]) -> str:
            return "s3://" + "/".join(p for p in (kwargs.get("Bucket"), kwargs.get("Key") or kwargs.get("Prefix")) if p)

        def _outage_error(
            self, method: str, kwargs: dict[str, Any], waited: float, e: BaseException
        ) -> StorageUnavailableError:
            op = _OPERATIONS.get(method.split("_", 1)[0], method)
            err = StorageUnavailableError(
                f"storage unreachable: could not {op} {self._url(kwargs)} ({method}) in {waited:.0f} s of retries, "
                f"the limit buffer.storage.outage_timeout_s = {self.outage_timeout_s:g} (last error {type(e).__name__}: {e}). "
                "Check that the S3 endpoint (buffer.storage.options.client_kwargs.endpoint_url) is up and reachable from here, "
                "or raise buffer.storage.outage_timeout_s; then resume the run"
            )
            err.last = e
            return err

    return ResilientS3FileSystem


@contextlib.contextmanager
def local_dir(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[str]:
    """A local path holding the directory at `url`: the directory itself on local disk, else a
    temporary copy, removed on exit (vLLM's workers load weights from local files)."""
    fs, root = open_storage(url, storage_options)
    if is_local(fs):
        yield root
        return
    tmp = tempfile.mkdtemp(prefix="rft-dir-")
    try:
        download_dir(fs, root, tmp)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def download_dir(fs: Any, root: str, dest: str, skip: Callable[[str], bool] = lambda rel: False) -> None:
    """Every file under `root` on `fs` into the local directory `dest`, at its path relative to
    `root` (`skip(rel)`: leave that file out)."""
    for path in fs.find(root):
        rel = path[len(root.rstrip("/")) + 1 :]
        if skip(rel):
            continue
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(path, target)
