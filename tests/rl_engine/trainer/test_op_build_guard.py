"""A torch extension build lock left by a killed process never hangs a trainer's start-up (issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from rl_engine.trainer.dist import op_build_guard


def make_lock(root, age_s: float = 0.0) -> str:
    d = root / "py311_cpu" / "deepspeed_shm_comm"
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return str(lock)


def test_a_stale_lock_is_removed(tmp_path):
    lock = make_lock(tmp_path, age_s=3600)
    started = time.monotonic()
    with op_build_guard(str(tmp_path), stale_after_s=30):
        assert not os.path.exists(lock)
    assert time.monotonic() - started < 5


def test_a_live_lock_is_waited_for_and_one_never_released_is_cleared_after_the_bound(tmp_path):
    lock = make_lock(tmp_path)
    threading.Timer(0.5, os.remove, (lock,)).start()  # a build that finishes
    started = time.monotonic()
    with op_build_guard(str(tmp_path), stale_after_s=10):
        waited = time.monotonic() - started
    assert 0.4 < waited < 5
    lock = make_lock(tmp_path)  # its holder died a moment ago: cleared after the bound, not forever
    started = time.monotonic()
    with op_build_guard(str(tmp_path), stale_after_s=1.5):
        assert not os.path.exists(lock)
    assert 1.4 < time.monotonic() - started < 6


def test_the_guard_is_exclusive_across_processes_and_freed_when_its_holder_dies(tmp_path):
    code = (
        "import sys, time; from rl_engine.trainer.dist import op_build_guard\n"
        f"with op_build_guard({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def enter():
            with op_build_guard(str(tmp_path)):
                entered.set()

        threading.Thread(target=enter, daemon=True).start()
        assert not entered.wait(1.0)  # the other process holds it
        holder.kill()  # SIGKILL: the kernel releases its flock
        assert entered.wait(10.0)
    finally:
        holder.kill()
        holder.wait(10)
