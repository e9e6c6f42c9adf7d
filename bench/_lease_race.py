"""Processes racing for one lease, round after round: how many won each round (goal: exactly 1).

Each of `processes` spawned processes takes part in every round: all wait at a barrier, then
call `RunLease(*open_storage(<url>/race-<r>)).acquire()` at once; winners hold until every racer has tried, then
release. With `slow_s`, every write a racer makes on local disk lands up to that much later (a
slow disk or a paused process), which is what a read-write-read-back lease loses to. Used by tests/rl_engine/run/test_lease.py and `python -m bench.faults` (`lease_double_wins`).

    wins = race("runs/lease-race", {}, processes=4, rounds=200)    # [1, 1, 1, ...]
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from rl_engine.storage import open_storage

_TIMEOUT_S = 120.0


def slow_local_writes(max_delay_s: float, seed: int) -> None:
    """Make every file this process moves into place on local disk (rename, hard link) land
    0..max_delay_s later, as a slow or paused writer's does: the gap between looking at a lease
    and writing it that a race needs."""
    import os
    import random
    import time

    rng = random.Random(seed)
    for name in ("replace", "link"):
        real = getattr(os, name)

        def slow(src: Any, dst: Any, *a: Any, _real: Any = real, **kw: Any) -> Any:
            time.sleep(rng.uniform(0, max_delay_s))
            return _real(src, dst, *a, **kw)

        setattr(os, name, slow)


def _racer(
    url: str, storage_options: dict[str, Any], rounds: int, slow_s: float, start: Any, tried: Any, results: Any
) -> None:
    import os

    from rl_engine.errors import UserError
    from rl_engine.run.lease import RunLease

    if slow_s:
        slow_local_writes(slow_s, os.getpid())
    for r in range(rounds):
        start.wait(_TIMEOUT_S)
        lease = None
        try:
            lease = RunLease(*open_storage(f"{url}/race-{r}", storage_options), ttl_s=60).acquire()
        except UserError:
            pass
        except Exception as e:  # noqa: BLE001 - reported, counted as no win
            results.put((r, f"error {type(e).__name__}: {e}"))
        results.put((r, lease is not None))
        tried.wait(_TIMEOUT_S)  # a winner holds until everyone has tried
        if lease is not None:
            lease.release()


def race(
    url: str, storage_options: dict[str, Any] | None, processes: int = 4, rounds: int = 200, slow_s: float = 0.0
) -> list[int]:
    """Winners per round (one entry per round); `slow_s`: local writes land up to that much later
    (`slow_local_writes`). Raises if a racer failed other than by losing."""
    ctx = mp.get_context("spawn")  # no forked copies of a parent's threads (s3fs's loop, servers)
    start, tried, results = ctx.Barrier(processes), ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(
            target=_racer, args=(url, storage_options or {}, rounds, slow_s, start, tried, results), daemon=True
        )
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    wins = [0] * rounds
    try:
        for _ in range(rounds * processes):
            r, won = results.get(timeout=_TIMEOUT_S)
            if isinstance(won, str):
                raise RuntimeError(f"lease race round {r}: {won}")  # noqa: TRY004 - a racer's error text, not a wrong type
            wins[r] += int(won)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return wins
