"""A run's identity and directory: the resolved config, saved once, and reopened on resume.

`start_run(cfg)` resolves the config, creates `<storage>/<name>/` and writes `config.yaml`
(without credentials: they never enter the config). `open_run(url)` reads it back for
`rft run --resume`. Every worker (explorer, trainer, reporter) gets a `RunContext`.
`RunLease` keeps two drivers (say, two `rft run --resume` of one run) from running it at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
import uuid
from typing import Any

import fsspec
import psutil
import yaml

from rl_engine.config import RFTConfig, to_yaml, validate_config
from rl_engine.errors import UserError
from rl_engine.storage import OUTAGE_KEY, join, open_storage, read_json, write_bytes_atomic, write_json

CONFIG_FILE = "config.yaml"


@dataclasses.dataclass(frozen=True)
class RunContext:
    """Where a run lives and how it is configured (resolved); cheap to pass to every task."""

    cfg: RFTConfig
    url: str  # <storage.url>/<name>

    @property
    def storage_options(self) -> dict[str, Any]:
        # fsspec's options plus buffer.storage.outage_timeout_s: the one handle every role and component opens storage with
        return self.cfg.buffer.storage.fs_options()

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """(filesystem, path of the run directory inside it)."""
        return open_storage(self.url, self.storage_options)

    def path(self, *parts: str) -> str:
        """Path of a file of the run inside its filesystem."""
        return join(self.fs()[1], *parts)


def start_run(cfg: RFTConfig) -> RunContext:
    """Resolve `cfg`, create the run directory and save the resolved config (refuses to reuse a run)."""
    from rl_engine.preflight import check_storage

    cfg = cfg.resolved()
    run = RunContext(cfg=cfg, url=cfg.run_url)
    check_storage(cfg.buffer.storage.url, run.storage_options)  # a missing bucket is an error, never created by makedirs below
    fs, root = run.fs()
    if fs.exists(join(root, CONFIG_FILE)):
        raise UserError(f"run {run.url} already exists; resume it with `rft run --resume {run.url}` or pick another name (name: ...)")
    fs.makedirs(root, exist_ok=True)
    write_bytes_atomic(fs, join(root, CONFIG_FILE), to_yaml(cfg).encode())
    return run


def open_run(url: str, storage_options: dict[str, Any] | None = None) -> RunContext:
    """Reopen an existing run from its saved `config.yaml` (for resume and inspection)."""
    fs, root = open_storage(url, storage_options)
    path = join(root, CONFIG_FILE)
    if not fs.exists(path):
        raise UserError(f"{url}: not a run directory (no {CONFIG_FILE}); runs live under buffer.storage.url, e.g. runs/<name>")
    data = yaml.safe_load(fs.cat_file(path))
    if storage_options:
        # The inverse of StorageConfig.fs_options(): the outage limit goes back to its own field.
        opts = dict(storage_options)
        storage = data.setdefault("buffer", {}).setdefault("storage", {})
        if OUTAGE_KEY in opts:
            storage["outage_timeout_s"] = opts.pop(OUTAGE_KEY)
        storage["options"] = opts
    cfg = validate_config(data, f"{url}/{CONFIG_FILE}")
    return RunContext(cfg=cfg, url=url.rstrip("/"))


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where the loops of a (resumed) run start: the trainer's restored version and, per
    explorer, one past its last committed explorer step. A fresh run is (0, all 1)."""

    trainer_version: int
    first_steps: dict[int, int]

    @property
    def resumed(self) -> bool:
        return self.trainer_version > 0 or any(s > 1 for s in self.first_steps.values())


def last_committed_steps(run: RunContext) -> dict[int, int]:
    """{explorer id: highest explorer step with committed experiences} from the buffer's commit records."""
    from rl_engine.buffer.stats import commit_records, last_committed

    return last_committed(commit_records(*run.fs()))


def resume_point(run: RunContext, trainer_version: int) -> ResumePoint:
    last = last_committed_steps(run)
    return ResumePoint(trainer_version, {i: last.get(i, 0) + 1 for i in range(run.cfg.explorer.count)})


LEASE_FILE = "lease.json"


class RunLease:
    """One writer per run: whoever drives a run (the mode's flow) holds `<run>/lease.json` and
    renews it every `ttl_s / 3` from a background thread; a second driver of the same run is
    refused with the holder named. A holder that died stops renewing, and its lease is free
    again after `ttl_s`, or at once when the acquirer runs on the holder's machine (same host name
    and boot time) and sees that its process is gone (a killed `rft run` resumed right away).
    Object stores have no atomic create, so an acquirer reads the lease back after writing it to
    see who won."""

    def __init__(self, run_url: str, storage_options: dict[str, Any] | None = None, ttl_s: float = 60.0):
        self.url, self.ttl_s = run_url, ttl_s
        self.fs, root = open_storage(run_url, storage_options)
        self.path = join(root, LEASE_FILE)
        me = psutil.Process()
        self.me = {"holder": uuid.uuid4().hex, "host": socket.gethostname(), "pid": me.pid, "boot": psutil.boot_time(), "started": me.create_time()}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        self.fs.invalidate_cache()
        try:
            return read_json(self.fs, self.path)
        except FileNotFoundError:
            return None

    def _refuse(self, cur: dict[str, Any]) -> None:
        age = time.time() - cur["time"]
        raise UserError(
            f"run {self.url} is being run by pid {cur['pid']} on {cur['host']} (its lease was renewed {age:.0f} s ago); "
            f"wait for that run to end or cancel it, or if it died, retry in {max(0.0, cur['ttl_s'] - age):.0f} s, when its lease expires"
        )

    def acquire(self) -> "RunLease":
        cur = self._read()
        if cur is not None and time.time() - cur["time"] < cur["ttl_s"] and not self._holder_dead(cur):
            self._refuse(cur)
        write_json(self.fs, self.path, {**self.me, "time": time.time(), "ttl_s": self.ttl_s})
        time.sleep(0.2)  # a racing acquirer's write lands in this window; the last writer wins
        cur = self._read()
        if cur is None or cur["holder"] != self.me["holder"]:
            self._refuse(cur or {**self.me, "time": time.time(), "ttl_s": self.ttl_s})
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def _holder_dead(self, cur: dict[str, Any]) -> bool:
        """True only when the holder provably ran on this machine and its process is gone (a
        reused pid has another start time); a lease from elsewhere waits for its ttl."""
        if (cur.get("host"), cur.get("boot")) != (self.me["host"], self.me["boot"]) or "started" not in cur:
            return False
        try:
            proc = psutil.Process(cur["pid"])
            return proc.create_time() != cur["started"] or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def _renew(self) -> None:
        while not self._done.wait(self.ttl_s / 3):
            with contextlib.suppress(Exception):  # a storage hiccup: the next renewal tries again
                write_json(self.fs, self.path, {**self.me, "time": time.time(), "ttl_s": self.ttl_s})

    def release(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(10)
            cur = self._read()
            if cur is not None and cur["holder"] == self.me["holder"]:
                self.fs.rm(self.path)
