"""How the EngineCore in the explorer's process (CPU: `rl_engine.rollout.inproc`) waits for its
worker's reply to each model step: sleeping with backoff instead of vLLM's spinning, which there
takes a core from the trainer beside it.

vLLM 0.32's reader (MessageQueue.acquire_read -> SpinCondition.wait) spins with sched_yield for a
second after every message before it waits on a zmq notification, so every model step is spun
through in the trainer's process (bench.real --quick, one run each: s_per_step 21.7 -> 20.9 s,
generated tokens/s 70 -> 84 with the backoff). vLLM's idle mode is no
fix: a notification can be dropped (its PUB socket keeps one), and the reader then sleeps out
vLLM's 5 s recheck (the demo's synchronous step median went 0.10 -> 5.1 s with the busy loop off).

The worker's own reader (waiting for the next step, in its process) keeps vLLM's spin: sleeping
there too made each demo generation ~2.3 ms and each RPC after an idle gap ~0.8 ms slower, and the
demo's synchronous step median 0.100 -> 0.113-0.122 s (bench.learning --quick, two runs).

    .venv/bin/python -m pytest tests/rl_engine/rollout/test_shm_wait.py -q
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

SPIN_S = 0.0002  # right after a message the next is often a moment away: yield the core, do not sleep
MAX_SLEEP_S = 0.001  # the most a message can wait unseen once it has arrived


def backoff_wait(condition: Any, timeout_ms: int | None = None) -> None:
    """SpinCondition.wait's replacement (`condition` is vLLM's SpinCondition of a reader): yield for
    SPIN_S after the last message, then sleep a tenth of the time waited so far, at most
    MAX_SLEEP_S, and never past the caller's timeout: a message is seen at most ~10% or 1 ms late."""
    waited = time.monotonic() - condition.last_read
    if waited < SPIN_S:
        os.sched_yield()
        return
    sleep = min(MAX_SLEEP_S, waited / 10)
    time.sleep(sleep if timeout_ms is None else min(sleep, timeout_ms / 1000))


def wait_with_backoff(queue: Any) -> None:
    """Make one MessageQueue's reader wait with `backoff_wait` (a writer has nothing to wait on)."""
    condition = getattr(queue, "_spin_condition", None)
    if condition is not None and condition.is_reader:
        condition.wait = functools.partial(backoff_wait, condition)
