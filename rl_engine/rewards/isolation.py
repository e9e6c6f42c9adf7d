"""A bounded pool of worker processes for user code (python rewards, workflow tools), with a
per-call timeout and a hard kill.

User code can hang (a network wait, an unbounded loop, a catastrophic regex) or take its process
down (a segfault in a C extension, `os._exit`, the OOM killer). Run in the explorer's own thread,
either would stop the explorer; run here, the call ends as an exception and the worker is killed
and replaced, while the explorer goes on:

    pool = UserCodePool(workers=2, name="explorer-0")
    try:
        value = pool.call(my_module.fn, arg, timeout_s=5.0)          # or:
        futures = [pool.submit(my_module.fn, a, timeout_s=5.0) for a in args]
        values = [pool.wait(f) for f in futures]                      # bounded waits, in order
    except UserCodeTimeout: ...   # ran past timeout_s: its worker was killed and replaced
    except UserCodeCrashed: ...   # its worker process died (the message names the exit code / signal)
    finally:
        pool.close()              # bounded: kills the workers, never waits forever

`fn` must be picklable: a module-level function of a module the workers can import (they get the
parent's sys.path). An exception the function raises is re-raised as is (its remote traceback is
its `__cause__`). Workers start on the first call, not before.

Workers are started with "spawn", never "fork": the explorer process runs vLLM's and our own
threads, and a forked child inherits their locks in whatever state they were in (a deadlock
waiting to happen) along with CUDA state it cannot use. Spawn costs a fresh interpreter per
worker (a fraction of a second, plus importing the user's module once per worker).

The timeout counts from when a worker takes the call, not from `submit`: calls beyond `workers`
wait their turn. `wait` is still bounded: a call can start no later than when enough of the calls
ahead of it have ended, each of which is bounded by its own timeout plus `grace_s` (the time to
kill and replace a worker), so every call gets a deadline when submitted. A call still without an
answer at its deadline (a pool that lost track of it) is cancelled and raised as a timeout.
"""

from __future__ import annotations

import heapq
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pebble

from rl_engine.proc.exits import describe_exit

log = logging.getLogger(__name__)

GRACE_S = 5.0  # pebble kills a timed-out worker with SIGTERM, then SIGKILL after 3 s; plus a respawn
CLOSE_WAIT_S = 2.0


class UserCodeTimeout(Exception):
    """The call ran past its timeout; its worker was killed and replaced."""


class UserCodeCrashed(Exception):
    """The worker process died during the call (segfault, os._exit, OOM kill); the message names
    the exit code or signal. Its worker is replaced."""


class UserCodeCall(Future):
    """The future of one call: its result, or UserCodeTimeout / UserCodeCrashed / the function's
    own exception. `deadline` (time.monotonic()) bounds `UserCodePool.wait`."""

    def __init__(self, inner: pebble.ProcessFuture, label: str, timeout_s: float, deadline: float):
        super().__init__()
        self.inner, self.label, self.timeout_s, self.deadline = inner, label, timeout_s, deadline

    def cancel(self) -> bool:
        """Cancels the call; a running one has its worker killed (by pebble) and replaced."""
        self.inner.cancel()
        return super().cancel()


class UserCodePool:
    """`workers` spawned processes running user functions; see the module docstring."""

    def __init__(self, workers: int, name: str, grace_s: float = GRACE_S):
        if workers < 1:
            raise ValueError(f"UserCodePool {name!r}: workers must be >= 1, got {workers}")
        self.workers, self.name, self.grace_s = workers, name, grace_s
        self._pool: pebble.ProcessPool | None = None
        self._lock = threading.Lock()
        self._pending: set[UserCodeCall] = set()
        self._closed = False

    # ----------------------------------------------------------------- calls

    def submit(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float, label: str | None = None, **kwargs: Any
    ) -> UserCodeCall:
        """Schedule `fn(*args, **kwargs)`; `label` names it in errors (default: module:qualname)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        label = label or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        with self._lock:
            if self._closed:
                raise RuntimeError(f"UserCodePool {self.name!r} is closed")
            inner = self._live_pool().schedule(fn, args=args, kwargs=kwargs, timeout=timeout_s)
            call = UserCodeCall(inner, label, timeout_s, self._start_bound() + timeout_s + self.grace_s)
            self._pending.add(call)
        inner.add_done_callback(lambda f: self._settle(call, f))
        return call

    def wait(self, call: UserCodeCall) -> Any:
        """The call's result, waiting at most until its deadline (see the module docstring)."""
        try:
            return call.result(timeout=max(0.0, call.deadline - time.monotonic()))
        except TimeoutError:
            if call.done():  # settled just now, or settled with a timeout of its own
                return call.result(timeout=0)
            call.cancel()
            raise UserCodeTimeout(
                f"{call.label}: no answer within its timeout of {call.timeout_s:g} s plus {self.grace_s:g} s grace "
                f"(pool {self.name!r}); cancelled, its worker killed"
            ) from None

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float, label: str | None = None, **kwargs: Any
    ) -> Any:
        """`fn(*args, **kwargs)` in a worker: its result, or UserCodeTimeout / UserCodeCrashed /
        the function's own exception."""
        return self.wait(self.submit(fn, *args, timeout_s=timeout_s, label=label, **kwargs))

    def close(self) -> None:
        """Kill the workers and cancel calls not yet answered. Bounded and idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            pending, self._pending = list(self._pending), set()
        for call in pending:
            call.cancel()
        if pool is not None:
            _stop(pool, self.name)

    def __enter__(self) -> UserCodePool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _live_pool(self) -> pebble.ProcessPool:
        """The pebble pool, (re)made when there is none or it broke (a worker died while idle)."""
        if self._pool is not None and not self._pool.active:
            log.warning("user-code pool %r broke; starting a new one", self.name)
            _stop(self._pool, self.name)
            self._pool = None
        if self._pool is None:
            self._pool = pebble.ProcessPool(max_workers=self.workers, context=multiprocessing.get_context("spawn"))
        return self._pool

    def _start_bound(self) -> float:
        """Latest time a call submitted now can start: when all but `workers - 1` of the calls
        ahead of it have ended, each by its own deadline (FIFO)."""
        ahead = [c.deadline for c in self._pending if not c.done()]
        must_end = len(ahead) - self.workers + 1
        now = time.monotonic()
        return max(now, heapq.nsmallest(must_end, ahead)[-1]) if must_end > 0 else now

    def _settle(self, call: UserCodeCall, inner: Future) -> None:
        """Hand the inner future's outcome to `call`, mapping pebble's errors to ours."""
        with self._lock:
            self._pending.discard(call)
        try:
            if inner.cancelled():
                call.cancel()
            elif (error := inner.exception()) is None:
                call.set_result(inner.result())
            else:
                call.set_exception(_map_error(error, call))
        except InvalidStateError:  # cancelled meanwhile (by wait or close)
            pass


def _map_error(error: BaseException, call: UserCodeCall) -> BaseException:
    if isinstance(error, TimeoutError) and error.args[:1] == ("Task timeout",) and error.__cause__ is None:
        # pebble's own; a TimeoutError the function raised carries its remote traceback as cause
        return UserCodeTimeout(
            f"{call.label} ran past its timeout of {call.timeout_s:g} s; its worker was killed and replaced"
        )
    if isinstance(error, pebble.ProcessExpired):
        return UserCodeCrashed(
            f"{call.label}: its worker process {error.pid} died ({describe_exit(error.exitcode)}); it is replaced"
        )
    if isinstance(error, BrokenProcessPool):
        return UserCodeCrashed(f"{call.label}: the worker pool broke ({error}); it is restarted on the next call")
    if isinstance(error, CancelledError):
        return UserCodeCrashed(f"{call.label}: cancelled by the pool")
    return error


def _stop(pool: pebble.ProcessPool, name: str) -> None:
    """Stop `pool`'s workers; wait for them at most CLOSE_WAIT_S (pebble's own join waits up to
    3 s per worker that ignores SIGTERM before it SIGKILLs it, so it finishes in the background)."""
    pool.stop()
    joiner = threading.Thread(target=pool.join, name=f"user-code-close-{name}", daemon=True)
    joiner.start()
    joiner.join(CLOSE_WAIT_S)
    if joiner.is_alive():
        log.warning(
            "user-code pool %r: workers still stopping after %.0f s; left to finish in the background",
            name,
            CLOSE_WAIT_S,
        )
