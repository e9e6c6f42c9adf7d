"""A lease two processes cannot both win: one driver per run, one run per lineage.

A lease is a directory of numbered generations, each created exclusively (`create_exclusive`:
a hard link on local disk, a conditional PUT on S3), so of any number of racing acquirers
exactly one creates the next generation and holds the lease:

    <run>/lease/gen=00000003.json    {holder, host, pid, boot, started, time, ttl_s, generation}

The holder renews its own generation's file every `ttl_s / 3` from a background thread. A new
acquirer looks at the newest generation: held (renewed within its ttl, holder alive), it is
refused with the holder named; free (released, expired, or its holder provably dead on this
machine: same host and boot, process gone), it creates the next generation. A holder whose
generation is no longer the newest has lost the lease; `Fence(fs, root, generation).check()`
raises `LeaseLost` then, and whoever commits on a holder's behalf (buffer commits, trainer
states, the end-of-attempt sweep, the lineage's latest.json) checks it first, so a driver that
lost its lease (paused past its ttl, partitioned) cannot commit over the new holder's run.

    lease = RunLease(*run.fs()).acquire()                    # UserError naming the holder if held
    fence = lease.fence()                                    # (fs, root, generation)
    fence.check()                                            # before a commit; LeaseLost if taken over
    lease.release()

Generations below the newest are deleted by the acquirer (best effort). `python -m bench.faults`
races acquirers (`lease_double_wins`, goal 0); tests: tests/rl_engine/run/test_lease.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import threading
import time
import uuid
from typing import Any

import psutil

from rl_engine.errors import UserError
from rl_engine.storage import create_exclusive, join, read_json, shown, write_json

LEASE_DIR = "lease"
_GEN = re.compile(r"gen=(\d+)\.json$")


class LeaseLost(UserError):
    """A newer generation of the lease exists: this holder must not commit anything more."""


def _gen_path(root: str, generation: int) -> str:
    return join(root, LEASE_DIR, f"gen={generation:08d}.json")


@dataclasses.dataclass(frozen=True)
class Fence:
    """What a writer acting for a lease holder needs to know it still holds: the lease's place
    (`root` of filesystem `fs`, the run's directory) and the holder's generation (None: no lease,
    nothing to check). A role makes its own from the generation on the run's start marker."""

    fs: Any
    root: str
    generation: int | None

    def check(self) -> None:
        """Raise LeaseLost if the lease moved past `generation` (two lookups of one object each)."""
        if self.generation is None:
            return
        fs, root = self.fs, self.root
        fs.invalidate_cache(join(root, LEASE_DIR))
        # An acquirer creates generation+1 before it deletes older ones: either is proof.
        if fs.exists(_gen_path(root, self.generation + 1)) or not fs.exists(_gen_path(root, self.generation)):
            newest = _newest(fs, root)
            who = (
                f"generation {newest[0]} (pid {newest[1].get('pid')} on {newest[1].get('host')})"
                if newest[1]
                else "a newer holder"
            )
            raise LeaseLost(
                f"{shown(fs, root)}: this process held lease generation {self.generation}, which {who} has taken over "
                "(this holder stopped renewing for longer than its ttl); it stops here without committing, the new holder goes on"
            )


def _newest(fs: Any, root: str) -> tuple[int, dict[str, Any] | None]:
    """(newest generation, its content) of the lease at `root`; (0, None) if there is none."""
    for _ in range(5):  # an acquirer may delete what we listed; list again
        fs.invalidate_cache(join(root, LEASE_DIR))
        try:
            gens = sorted(int(m.group(1)) for p in fs.ls(join(root, LEASE_DIR), detail=False) if (m := _GEN.search(p)))
        except FileNotFoundError:
            return 0, None
        if not gens:
            return 0, None
        try:
            return gens[-1], read_json(fs, _gen_path(root, gens[-1]))
        except FileNotFoundError:
            continue
    raise RuntimeError(f"{root}/{LEASE_DIR}: generations keep vanishing while read")


def read_lease(fs: Any, root: str) -> dict[str, Any] | None:
    """The newest generation of the lease at `root` of `fs` (its holder, time, ttl, `released`), or None."""
    return _newest(fs, root)[1]


class RunLease:
    """One holder at a time for whatever lives at `root` of filesystem `fs` (a run's driver, a lineage's runs)."""

    def __init__(self, fs: Any, root: str, ttl_s: float = 60.0):
        self.fs, self.root, self.ttl_s = fs, root, ttl_s
        me = psutil.Process()
        self.me = {
            "holder": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": me.pid,
            "boot": psutil.boot_time(),
            "started": me.create_time(),
        }
        self.generation: int | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, generation: int, **extra: Any) -> dict[str, Any]:
        return {**self.me, "generation": generation, "time": time.time(), "ttl_s": self.ttl_s, **extra}

    def _refuse(self, cur: dict[str, Any]) -> None:
        age = time.time() - cur["time"]
        raise UserError(
            f"run {shown(self.fs, self.root)} is being run by pid {cur['pid']} on {cur['host']} (its lease was renewed {age:.0f} s ago); "
            f"wait for that run to end or cancel it, or if it died, retry in {max(0.0, cur['ttl_s'] - age):.0f} s, when its lease expires"
        )

    def _free(self, cur: dict[str, Any]) -> bool:
        return bool(cur.get("released")) or time.time() - cur["time"] >= cur["ttl_s"] or self._holder_dead(cur)

    def acquire(self) -> RunLease:
        """Hold the lease, or raise UserError naming its live holder."""
        gen, cur = _newest(self.fs, self.root)
        if cur is not None and not self._free(cur):
            self._refuse(cur)
        nxt = gen + 1
        if not create_exclusive(self.fs, _gen_path(self.root, nxt), _json(self._body(nxt))):
            won = read_json(
                self.fs, _gen_path(self.root, nxt)
            )  # a racer's; or ours, if a retried PUT met its first try
            if won.get("holder") != self.me["holder"]:
                self._refuse(won)
        self.generation = nxt
        for old in range(gen, 0, -1):  # older generations are history; deleting them is best effort
            with contextlib.suppress(FileNotFoundError, OSError):
                if not self.fs.exists(_gen_path(self.root, old)):
                    break
                self.fs.rm(_gen_path(self.root, old))
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()
        return self

    def fence(self) -> Fence:
        return Fence(self.fs, self.root, self.generation)

    def check(self) -> None:
        """Raise LeaseLost if another holder took the lease over."""
        self.fence().check()

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
            try:
                self.check()
                write_json(self.fs, _gen_path(self.root, self.generation), self._body(self.generation))
            except LeaseLost:
                return  # taken over: its commits are refused by the fence; renewing would only confuse readers
            except Exception:  # noqa: BLE001 - a storage hiccup: the next renewal tries again
                continue

    def release(self) -> None:
        """Stop renewing and mark the generation released (free at once for the next acquirer)."""
        self._done.set()
        if self._thread is None:
            return
        self._thread.join(10)
        with contextlib.suppress(LeaseLost, FileNotFoundError):
            self.check()
            write_json(self.fs, _gen_path(self.root, self.generation), self._body(self.generation, released=True))


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()
