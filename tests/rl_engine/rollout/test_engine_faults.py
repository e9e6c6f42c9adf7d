"""Dead vLLM engines: calls in flight fail within a bound, close() never hangs, no orphans.

Each test kills engine processes on purpose, so each builds its own engine (explorer 7, not
the session's shared ones) and discards it. Every wait is bounded (thread joins with a timeout):
a regression fails these tests instead of hanging the suite.

    .venv/bin/python -m pytest tests/rl_engine/rollout/test_engine_faults.py -q -s
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from rl_engine.config import SamplingConfig
from rl_engine.rollout.engine import EngineDiedError
from rl_engine.trainer.dist import free_port
from tests.rl_engine.rollout.engines import discard, shared_engine

EXPLORER = 7
DEATH_BOUND_S = 30.0  # kill -> EngineDiedError in the caller (measured ~0.3 s; the design bound is ~2.3 s)
CLOSE_BOUND_S = 30.0  # close() with a call stuck on a dead engine (measured ~1 s)
ORPHAN_BOUND_S = 15.0  # owner SIGKILLed -> its engine processes gone (measured ~0.6 s)
REPO = Path(__file__).resolve().parents[3]

# ~250k tokens to sample: tens of seconds on 2 cores, so a kill 1 s in lands mid-generate.
BIG_BATCH = [[3 + (i * 7 + j) % 250 for j in range(10)] for i in range(256)]
BIG_SAMPLING = SamplingConfig(max_tokens=100)


class _Call:
    """One call on its own thread: the test joins it with a timeout and never hangs on it."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout: float) -> bool:
        """True if the call ended within `timeout` s."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


@pytest.fixture
def doomed_engine(tiny_model_dir):
    """A fresh engine for a test that kills it; closed and forgotten afterwards."""
    discard(EXPLORER)
    eng = shared_engine(tiny_model_dir, EXPLORER)
    try:
        yield eng
    finally:
        t0 = time.monotonic()
        discard(EXPLORER)
        assert time.monotonic() - t0 < CLOSE_BOUND_S


def _worker(eng) -> psutil.Process:
    """The engine's one worker process (its EngineCore runs in this process on CPU)."""
    ((worker, _),) = eng._procs.workers
    return worker


def _in_flight(eng, what: str) -> _Call:
    call = _Call(lambda: eng.generate(BIG_BATCH, 8, BIG_SAMPLING, seed=0), name=f"test-{what}")
    time.sleep(1.0)
    assert call.thread.is_alive(), f"the {what} ended before the kill ({call.error!r}); give it more work"
    return call


def _alive(p: psutil.Process) -> bool:
    """Still running; a zombie its (new) parent has not reaped yet holds no memory and counts as gone."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.slow
def test_worker_killed_during_generate_fails_it(doomed_engine):
    eng = doomed_engine
    call = _in_flight(eng, "generate")
    worker = _worker(eng)
    killed_at = time.monotonic()
    worker.kill()
    assert call.join(DEATH_BOUND_S), f"generate still blocked {DEATH_BOUND_S} s after its worker was killed"
    took = call.ended_at - killed_at
    print(f"worker SIGKILLed mid-generate -> EngineDiedError after {took:.2f} s")
    assert isinstance(call.error, EngineDiedError), repr(call.error)
    msg = str(call.error)
    assert f"explorer {EXPLORER} died" in msg and f"pid {worker.pid}" in msg and "SIGKILL" in msg, msg
    # The helper thread that ran vLLM's generate was woken too (nothing left behind).
    deadline = time.monotonic() + 5
    while [
        t for t in threading.enumerate() if t.name.startswith(f"rft-explorer-{EXPLORER}-")
    ] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith(f"rft-explorer-{EXPLORER}-")]
    # Every later call fails at once, and close() is quick.
    for later in (lambda: eng.rpc("rft_version", timeout=10), lambda: eng.generate([[5, 6]], 1, BIG_SAMPLING, seed=0)):
        after = _Call(later, name="test-after-death")
        assert after.join(DEATH_BOUND_S)
        assert isinstance(after.error, EngineDiedError) and f"explorer {EXPLORER} died" in str(after.error), repr(
            after.error
        )


@pytest.mark.slow
def test_worker_killed_during_collective_rpc_fails_it(doomed_engine):
    """A group join that waits for a trainer that never comes; its vLLM worker is killed meanwhile."""
    eng = doomed_engine
    join = _Call(lambda: eng.rpc("rft_join_group", "127.0.0.1", free_port(), 1, 2, "gloo", 300.0), name="test-join")
    time.sleep(2.0)
    assert join.thread.is_alive(), f"the group join ended without its trainer: {join.error!r}"
    killed_at = time.monotonic()
    _worker(eng).kill()
    assert join.join(DEATH_BOUND_S), f"collective_rpc still blocked {DEATH_BOUND_S} s after its worker was killed"
    print(f"worker SIGKILLed mid-collective_rpc -> EngineDiedError after {join.ended_at - killed_at:.2f} s")
    assert isinstance(join.error, EngineDiedError), repr(join.error)
    assert f"explorer {EXPLORER} died" in str(join.error), str(join.error)


@pytest.mark.slow
def test_close_returns_while_a_call_is_stuck_on_a_wedged_engine(doomed_engine):
    """The hang of issue 13: close() waited for a generate stuck on an engine that never answers.

    The worker is stopped (SIGSTOP): alive, so nothing reports a death, and silent, so vLLM's
    generate waits for it. close() must still return within its bound (vLLM's shutdown, then
    SIGKILL, which a stopped process takes too), and the caller must get EngineDiedError.
    """
    eng = doomed_engine
    call = _in_flight(eng, "generate")
    worker = _worker(eng)
    worker.suspend()
    try:
        time.sleep(1.0)
        assert call.thread.is_alive(), f"generate ended on a stopped worker: {call.error!r}"
        closer = _Call(eng.close, name="test-close")  # at once: the generate still holds the call lock
        started = time.monotonic()
        assert closer.join(CLOSE_BOUND_S), f"close() still blocked after {CLOSE_BOUND_S} s"
        print(f"close() with a generate stuck on a stopped worker returned after {closer.ended_at - started:.2f} s")
        assert closer.error is None, repr(closer.error)
        assert call.join(DEATH_BOUND_S), f"generate still blocked {DEATH_BOUND_S} s after close()"
        assert isinstance(call.error, EngineDiedError) and f"explorer {EXPLORER}" in str(call.error), repr(call.error)
        assert not _alive(worker), "close() left the stopped worker running"
    finally:
        with contextlib.suppress(psutil.Error):
            worker.kill()


_OWNER = """
import sys, time
from rl_engine.rollout.engine import build_rollout_engine
from tests.rl_engine.rollout.engines import make_config

if __name__ == "__main__":
    # One engine thread: the worker is bound to core 0; the EngineCore runs in this process.
    explorer = {"engine": {"kv_cache_space_gib": 0.25, "num_threads": 1}, "sampling": {"max_tokens": 16}}
    engine = build_rollout_engine(make_config(sys.argv[1], explorer=explorer), explorer_id=0)
    print("READY", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_engine_processes_exit_when_their_owner_is_killed(tiny_model_dir, tmp_path):
    log = tmp_path / "owner.log"
    with open(log, "w") as err:
        owner = subprocess.Popen(
            [sys.executable, "-c", _OWNER, tiny_model_dir], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in owner.stdout], daemon=True).start()
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if "READY" in lines.get(timeout=max(0.1, deadline - time.monotonic())):
                    break
            except queue.Empty:
                pytest.fail(
                    f"the owner did not start its engine within 240 s (exit code {owner.poll()}):\n{log.read_text()[-3000:]}"
                )
        children = psutil.Process(owner.pid).children(recursive=True)
        names = sorted(c.name() for c in children)
        # On CPU the EngineCore runs in the owner itself: its one child process is the worker.
        assert any("Worker" in n for n in names) and not any("EngineCore" in n for n in names), names
        killed_at = time.monotonic()
        owner.kill()
        owner.wait(timeout=30)
        while any(_alive(c) for c in children) and time.monotonic() - killed_at < ORPHAN_BOUND_S:
            time.sleep(0.05)
        survivors = [(c.pid, c.name()) for c in children if _alive(c)]
        print(
            f"owner SIGKILLed -> its {len(children)} processes {names} gone after {time.monotonic() - killed_at:.2f} s"
        )
        assert not survivors, (
            f"still running {ORPHAN_BOUND_S} s after their owner was killed: {survivors}\n{log.read_text()[-3000:]}"
        )
    finally:
        owner.kill()
        for c in children:
            if _alive(c):
                c.kill()


_TRAINER_BESIDE = """
import gc, os, random, sys, threading, time
import numpy as np
import torch
import torch.distributed as dist
from rl_engine.rollout.engine import build_rollout_engine
from rl_engine.trainer.dist import free_port
from tests.rl_engine.rollout.engines import make_config

if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # what the trainer of a local run holds
    states = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()
    torch.set_num_threads(3)  # a trainer's setting (any count but vLLM's 1)
    built = []  # an explorer builds its engine in a thread of its own
    t = threading.Thread(target=lambda: built.append(build_rollout_engine(make_config(sys.argv[1], explorer={"engine": {"kv_cache_space_gib": 0.25}}), explorer_id=0)))
    t.start()
    seen = set()  # what a thread takes at its first torch op, during the engine's start (a trainer loading its model)
    while t.is_alive():
        probe = threading.Thread(target=lambda: seen.add(torch.get_num_threads()))
        probe.start(); probe.join(); time.sleep(0.02)
    t.join()
    engine = built[0]
    probe = threading.Thread(target=lambda: seen.add(torch.get_num_threads()))  # and after it
    probe.start(); probe.join()
    print("THREADS", torch.get_num_threads(), sorted(seen), flush=True)
    # vLLM warns that seeding may touch this process's random state: it seeds in its worker.
    print("RNG", states == (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()), flush=True)
    engine.close()
    del engine
    gc.collect()  # vLLM's client finalizer would run here
    print("GROUP", dist.is_initialized(), flush=True)
"""


@pytest.mark.slow
def test_an_engine_leaves_the_process_group_random_state_and_threads_of_the_trainer_beside_it(tiny_model_dir):
    """The EngineCore runs in the process that builds the engine, as does a local run's trainer
    (rank 0): vLLM's own EngineCore teardown destroys torch.distributed's default process group,
    and the trainer's next collective failed ("dist is not initialized"). Building the engine
    leaves the process's random generators (Python, numpy, torch) where they were, and torch's
    thread count: vLLM sets it to 1 for serving, and a thread that made its first torch op then
    (a trainer loading its model during the engine's start) computed on one core for good."""
    p = subprocess.run(
        [sys.executable, "-c", _TRAINER_BESIDE, tiny_model_dir], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RNG True" in p.stdout and "GROUP True" in p.stdout, p.stdout[-2000:]
    assert "THREADS 3 [3]" in p.stdout, p.stdout[-2000:]
