"""The control board: tiny JSON markers under `<run>/control/` through which workers see each other.

Explorers and the trainer may be threads of one flow run, processes, or deployments on other
machines; they coordinate only through the run's storage (local disk or S3), never through
shared memory. The trainer posts its version, explorers post their step/version and their
acknowledgements of loaded weights; a waiter polls with a timeout and a stop event (a marker
posted by its own process wakes it at once), and its timeout message says what it was waiting for.

    board = run.board                          # the run's board (RunContext opens it); or Board.at(run_url, options)
    board.post(TRAINER_KEY, {"version": 3})
    board.wait(TRAINER_KEY, lambda v: v["version"] >= 3, what="trainer version 3", timeout_s=60)

The run's stop request (`request_stop`, key `stop`) and each role's liveness (`role-<name>`:
pid, host, state, refreshed every heartbeat) live here too; `rl_engine.roles.entry` keeps them up.

Key schema: the run-level keys are defined below and nowhere else (`START_KEY`, `STOP_KEY`,
`TRAINER_KEY`, `role_key`, with role names from `role_name`); a weight-sync method's handshake
keys belong to that method and live in `rl_engine/sync/` (its callers never read them); the
reward role's name and the key of its service's address live in `rl_engine/rewards/run_service.py`.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rl_engine.storage import (
    is_remote,
    join,
    news,
    open_storage,
    poke,
    poll_interval,
    read_marker,
    wait_news,
    write_marker,
    written_since,
)

log = logging.getLogger(__name__)


# ---- the key schema (one file per key under <run>/control/)
START_KEY = "start"  # the attempt's start marker: attempt id, trainer version and explorer steps to start from (run.context.post_start)
STOP_KEY = "stop"  # the run's stop request: kind, reason, by, failure_of (request_stop, restate_failure)
TRAINER_KEY = "trainer"  # the trainer role's progress: version, newest published version, lost rows
TRAINER = "trainer"  # the trainer role's name (explorers are `explorer-<i>`, role_name)


def role_name(explorer_id: int | None = None) -> str:
    """A role's name: `trainer` (no explorer id), or `explorer-<i>`."""
    return TRAINER if explorer_id is None else f"explorer-{explorer_id}"


class StopSignal(Protocol):
    """What a waiter checks between polls: a threading.Event, or a role's view of the run's stop request."""

    def is_set(self) -> bool: ...


class Stopped(Exception):
    """The run was asked to stop (cancelled) while a worker was waiting."""


class WaitTimeout(TimeoutError):
    """A rendezvous did not happen in time; the message names what was awaited."""


T = TypeVar("T")


def poll_until(
    ready: Callable[[], T | None],
    *,
    what: str,
    timeout_s: float,
    interval_s: float,
    stop: StopSignal | None = None,
    timeout_error: Callable[[], BaseException] | None = None,
    between: Callable[[], None] | None = None,
    watch: str | None = None,
) -> T:
    """Call `ready()` until it returns something other than None or False, and return that. Raises
    Stopped once `stop` is set, after `timeout_s` `timeout_error()` (default: WaitTimeout naming
    `what`); between tries calls `between()` (drop a listing cache, post progress), then waits
    `interval_s` (never past the deadline), or less: until this process writes to storage (to a
    path under `watch`, if given; `rl_engine.storage.wait_news`), so a hand-off between roles of one
    process costs no poll interval."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = news()  # before the look: a write during it ends the wait below at once
        got = ready()
        if got is not None and got is not False:
            return got
        if stop is not None and stop.is_set():
            raise Stopped(f"stopped while waiting for {what}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise timeout_error() if timeout_error is not None else WaitTimeout(f"waited {timeout_s:.0f} s for {what}")
        if between is not None:
            between()
        wait_news(seen, min(interval_s, left), watch)


class _Slot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: float | None = None  # monotonic time the read began
        self.seq = 0  # this process's news() then
        self.value: dict[str, Any] | None = None


class SharedReads:
    """This process's latest reads of markers on an object store, shared by its roles.

    Explorers and the trainer in one process (placement `local`) all poll the same few markers
    (the trainer's, the stop request, the trainer's heartbeat): N explorers waiting their turn
    made N GETs a poll interval of the same object. A read younger than `max_age_s` serves every
    caller instead (one GET in flight per marker; the others wait for it), unless this process
    has posted that marker since (`rl_engine.storage.written_since`): its own posts are seen at
    once, another process's at most `max_age_s` later than by polling alone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[tuple[Any, str], _Slot] = {}

    def read(self, fs: Any, path: str, max_age_s: float) -> dict[str, Any] | None:
        with self._lock:
            slot = self._slots.setdefault((fs, path), _Slot())
        with slot.lock:
            if slot.at is None or time.monotonic() - slot.at >= max_age_s or written_since(slot.seq, path):
                slot.at, slot.seq = time.monotonic(), news()
                try:
                    slot.value = read_marker(fs, path)
                except FileNotFoundError:
                    slot.value = None
            value = slot.value
        return copy.deepcopy(value)

    def forget(self, under: str) -> None:
        """Drop the reads of markers under `under` (a board was cleared)."""
        with self._lock:
            for k in [k for k in self._slots if k[1].startswith(under)]:
                del self._slots[k]


SHARED_READS = SharedReads()


class Board:
    """JSON markers of a run, one file per key, each written atomically.

    Not fsynced: a marker only describes the live attempt (a resumed run clears the board first,
    `RunDriver.start`), so it need not survive a power loss, and a step's hand-offs post several
    (an fsync costs 2-5 ms on the dev machine's ext4). A killed process loses none: the rename is
    done. On local disk a marker is a symbolic link to its latest file (`rl_engine.storage.write_marker`).
    """

    def __init__(self, fs: Any, run_root: str, poll_s: float | None = None):
        """The board of the run at `run_root` of `fs` (its markers under `<run_root>/control/`);
        `poll_s`: buffer.poll_interval_s (None: the storage's default)."""
        self.fs, self.run_root = fs, run_root
        self.root = join(run_root, "control")
        self.poll_s = poll_interval(self.fs, poll_s)
        self._shared = is_remote(self.fs)  # reads there cost a request each

    @classmethod
    def at(cls, run_url: str, storage_options: dict[str, Any] | None = None, poll_s: float | None = None) -> Board:
        """The board of the run at `run_url`, for a tool or test that has only the URL (a role or
        driver uses its RunContext's: `run.board`)."""
        return cls(*open_storage(run_url, storage_options), poll_s)

    def _path(self, key: str) -> str:
        return join(self.root, f"{key}.json")

    def post(self, key: str, value: dict[str, Any]) -> None:
        write_marker(self.fs, self._path(key), {**value, "time": time.time()})

    def get(self, key: str) -> dict[str, Any] | None:
        if self._shared:
            return SHARED_READS.read(self.fs, self._path(key), self.poll_s / 2)
        try:
            return read_marker(self.fs, self._path(key))
        except FileNotFoundError:
            return None

    def clear(self) -> None:
        """Remove every marker (a resumed run must not see the crashed run's progress)."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)
        self.fs.invalidate_cache()
        SHARED_READS.forget(self.root + "/")

    def wait(
        self,
        key: str,
        ready: Callable[[dict[str, Any]], bool],
        *,
        what: str,
        timeout_s: float,
        stop: StopSignal | None = None,
    ) -> dict[str, Any]:
        """Poll `key` until `ready(value)`; raise Stopped on `stop`, WaitTimeout after `timeout_s`."""
        last: dict[str, Any] | None = None

        def ready_value() -> dict[str, Any] | None:
            nonlocal last
            last = self.get(key)
            return last if last is not None and ready(last) else None

        def timed_out() -> WaitTimeout:
            return WaitTimeout(
                f"waited {timeout_s:.0f} s for {what}; last {key!r} marker: {last} (synchronizer.wait_timeout_s)"
            )

        return poll_until(
            ready_value,
            what=what,
            timeout_s=timeout_s,
            interval_s=self.poll_s,
            stop=stop,
            timeout_error=timed_out,
            between=self.fs.invalidate_cache,
            watch=self._path(key),
        )


def role_key(role: str) -> str:
    """Board key of a role's liveness marker (`role-explorer-0`, `role-trainer`)."""
    return f"role-{role}"


def request_stop(board: Board, kind: str, reason: str, by: str, failure_of: str | None = None) -> None:
    """Ask every role of the run to stop: kind `finished` (training done), `cancelled`, or `failed`.
    The first request wins: a later one never hides why the run stopped. `failure_of` names the
    role whose own failure the request reports (its loop raised), which that role may restate."""
    if board.get(STOP_KEY) is None:
        board.post(
            STOP_KEY, {"kind": kind, "reason": reason, "by": by, **({"failure_of": failure_of} if failure_of else {})}
        )


def restate_failure(board: Board, reason: str, role: str) -> None:
    """`role` failed: post `reason` as the run's stop request in place of `role`'s own earlier
    report of that failure, or as the first request; any other request stays (a peer's failure, a
    silent peer, a cancel). The trainer's launcher uses it: it sees every rank, while trainer rank
    0, which reports its own failure first, sees only its side: a peer rank killed mid-collective
    reached rank 0 as "Connection reset by peer", and the run said that, not the killed rank."""
    req = board.get(STOP_KEY)
    if req is None or req.get("failure_of") == role:
        board.post(STOP_KEY, {"kind": "failed", "reason": reason, "by": role, "failure_of": role})


class RoleSignals:
    """One role's link to the run's board, kept up by a background thread.

    It posts the role's liveness marker (pid, host, state; its `time` is the heartbeat) every
    `heartbeat_s`, turns the run's stop request into `is_set()`, and requests a stop when a peer
    of the same attempt has gone silent for `heartbeat_timeout_s` (killed without a word).
    """

    def __init__(
        self, board: Board, role: str, peers: list[str], attempt: str, heartbeat_s: float, heartbeat_timeout_s: float
    ):
        self.board, self.role, self.peers, self.attempt = board, role, peers, attempt
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.request: dict[str, Any] | None = None  # the stop request seen, if any
        self._stop, self._done = threading.Event(), threading.Event()
        self._marker = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state": "running",
            "attempt": attempt,
            "started": time.time(),
        }
        board.post(role_key(role), self._marker)
        self._thread = threading.Thread(target=self._watch, name=f"{role}-signals", daemon=True)
        self._thread.start()

    def is_set(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, kind: str, reason: str) -> None:
        request_stop(self.board, kind, reason, by=self.role)
        self._stop.set()

    def report_failure(self, error: str) -> None:
        """This role failed (`error`): stop the run, saying so (a request its launcher may restate)."""
        request_stop(self.board, "failed", f"{self.role} failed: {error}", by=self.role, failure_of=self.role)
        self._stop.set()

    def _check(self, now: float) -> None:
        if (req := self.board.get(STOP_KEY)) is not None:
            self.request = req
            self._stop.set()
        for peer in self.peers:
            m = self.board.get(role_key(peer))
            if (
                m is not None
                and m.get("attempt") == self.attempt
                and m.get("state") == "running"
                and now - m["time"] > self.heartbeat_timeout_s
            ):
                reason = f"{peer} went silent: no heartbeat for {now - m['time']:.0f} s (pid {m.get('pid')} on {m.get('host')} killed, or its machine lost)"
                self.request_stop("failed", reason)

    def _wake_on(self) -> tuple[str, str]:
        # A stop request posted by this process (the flow's cancel watcher, a role beside this one
        # under placement `local`) is seen at once, not at the next look; `_end` pokes the marker.
        return self.board._path(STOP_KEY), self.board._path(role_key(self.role))

    def _watch(self) -> None:
        # Stop requests of other processes are seen within a fraction of a second; object stores are polled gentler.
        check_s = min(self.heartbeat_s, max(10 * self.board.poll_s, 0.1))
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            seen = news()
            if self._done.is_set():
                return
            wait_news(seen, check_s, self._wake_on())
            if self._done.is_set():
                return
            try:
                if time.monotonic() >= next_beat:
                    self.board.post(role_key(self.role), self._marker)
                    next_beat = time.monotonic() + self.heartbeat_s
                self._check(time.time())
            except Exception as e:  # noqa: BLE001 - a storage hiccup must not kill the heartbeat
                log.warning("%s: board unreachable for a heartbeat: %s: %s", self.role, type(e).__name__, e)

    def _end(self) -> None:
        self._done.set()
        poke(self._wake_on()[1])
        self._thread.join(10)

    def detach(self) -> None:
        """Stop the thread and post nothing: the board is no longer this role's (its driver lost the run's lease)."""
        self._end()

    def close(self, state: str, error: str | None = None) -> None:
        """Stop the thread and post the role's final state (done / stopped / failed)."""
        self._end()
        self.board.post(role_key(self.role), {**self._marker, "state": state, "error": error})


def running_roles(board: Board, roles: list[str], attempt: str) -> dict[str, float]:
    """{role: seconds since its last heartbeat} of the roles of `attempt` still marked running."""
    now, out = time.time(), {}
    for role in roles:
        m = board.get(role_key(role))
        if m is not None and m.get("attempt") == attempt and m.get("state") == "running":
            out[role] = now - m["time"]
    return out


def silent_roles(board: Board, roles: list[str], attempt: str, timeout_s: float) -> list[str]:
    """Roles of `attempt` still marked running whose heartbeat is older than `timeout_s`."""
    return [role for role, age in running_roles(board, roles, attempt).items() if age > timeout_s]
