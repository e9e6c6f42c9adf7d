"""fsspec access to a run's storage: one place that turns a URL + options into a filesystem.

Credentials are never passed here from the config: fsspec/s3fs read them from the environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or FSSPEC_S3_* variables), so they never reach the
resolved config or logs.

    fs, root = open_storage("s3://bucket/runs", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:5000"}})
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import fsspec
import yaml
from fsspec.core import url_to_fs


def open_storage(url: str, options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path inside it) for a storage URL; local paths become absolute."""
    fs, root = url_to_fs(url, **(options or {}))
    return fs, root.rstrip("/")


def join(*parts: str) -> str:
    """Join path parts with '/', the separator of every fsspec filesystem."""
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p != "")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local filesystem, where rename is atomic and temp+rename commits are safe."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def poll_interval(fs: fsspec.AbstractFileSystem, configured: float | None = None) -> float:
    """Seconds between looks at storage for news: `configured`, else cheap on local disk, gentle on object stores."""
    if configured is not None:
        return configured
    return 0.005 if is_local(fs) or "memory" in str(fs.protocol) else 0.1


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: Any, fsync: bool = True) -> None:
    """Make `path` appear whole or not at all (`data`: bytes or any buffer).

    Local disk: write `.tmp-*` beside it (ignored by Arrow tools: leading dot), then rename
    (atomic on POSIX); `fsync` makes it survive a power loss too. Object stores (S3, memory):
    a single PUT is already all-or-nothing.
    """
    if not is_local(fs):
        fs.pipe_file(path, data if isinstance(data, bytes) else bytes(memoryview(data)))
        return
    parent = path.rsplit("/", 1)[0]
    os.makedirs(parent, exist_ok=True)
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, fsync: bool = True) -> None:
    write_bytes_atomic(fs, path, json.dumps(obj, sort_keys=True).encode(), fsync=fsync)


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    return json.loads(fs.cat_file(path))


def write_yaml(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    write_bytes_atomic(fs, path, yaml.safe_dump(obj, sort_keys=False).encode())
