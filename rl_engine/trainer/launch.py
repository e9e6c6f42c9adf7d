"""Start the trainer's ranks with torchrun and watch them until they exit.

    run_ranks(ranks_command(run_url, storage_options, num_ranks=2), poll=forward_steps)

torchrun (`python -m torch.distributed.run --standalone`, fail-fast: no restarts) starts
`rl_engine.roles.trainer_rank` once per rank and sets RANK / WORLD_SIZE / LOCAL_RANK and the
rendezvous; when one rank dies it stops the others and prints which rank failed first. The ranks
watch this process (`rl_engine.proc.owner_watch`): if it is killed, they and torchrun's agent exit.
`run_ranks` raises `RanksFailed` naming the first rank that failed and how. `rft trainer-node`
(node i of trainer.nodes, on another machine) is rl_engine/roles/trainer_node.py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from rl_engine.proc.owner_watch import OWNER_PID_ENV
from rl_engine.proc.starts import count_start
from rl_engine.trainer.dist import OWNER

RANK_MAIN = "rl_engine.roles.trainer_rank"
# Rendezvous variables a launcher sets; inherited ones (a test, a process that trained in-process) must not reach torchrun's ranks.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", OWNER)


class RanksFailed(RuntimeError):
    """A trainer rank failed; the message names the first one and how it ended."""


def ranks_command(
    run_url: str,
    storage_options: dict[str, Any] | None,
    num_ranks: int,
    nodes: int = 1,
    node_rank: int = 0,
    rendezvous: str | None = None,
) -> list[str]:
    """torchrun's command line for node `node_rank`'s share of the `num_ranks` trainer ranks of
    the run at `run_url`: all of them on one machine, or num_ranks / nodes per node, meeting at
    `rendezvous` (host:port on node 0; node 0 holds global rank 0)."""
    if nodes == 1:
        where = ["--standalone", f"--nproc-per-node={num_ranks}"]
    else:
        host, port = rendezvous.rsplit(":", 1)
        where = [
            f"--nnodes={nodes}",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={num_ranks // nodes}",
            "--rdzv-backend=static",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]
    return [
        sys.executable, "-m", "torch.distributed.run", *where, "--max-restarts=0", "--monitor-interval=0.5",
        "-m", RANK_MAIN, run_url, "--storage-options", json.dumps(storage_options or {}),
    ]  # fmt: skip


def launcher_env() -> dict[str, str]:
    """This process's environment without rendezvous variables, for a torchrun it starts."""
    return {k: v for k, v in os.environ.items() if k not in _DIST_ENV}


def run_ranks(
    cmd: list[str],
    poll: Callable[[], None] = lambda: None,
    poll_s: float = 1.0,
    stop_grace_s: float = 15.0,
    env: dict[str, str] | None = None,
) -> None:
    """Run torchrun's `cmd` (with `env` on top of this process's environment: the run's device
    plan, CUDA_VISIBLE_DEVICES), calling `poll()` every `poll_s` until it exits; then stop whatever
    it left (also when `poll` raises or this thread is interrupted). Raises RanksFailed on failure."""
    env = {**launcher_env(), **(env or {}), OWNER_PID_ENV: str(os.getpid())}
    count_start("torchrun")
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    tail: collections.deque[str] = collections.deque(maxlen=400)
    echo = threading.Thread(target=_echo, args=(proc.stderr, tail), name="trainer-ranks-stderr", daemon=True)
    echo.start()
    try:
        while proc.poll() is None:
            poll()
            time.sleep(poll_s)
    finally:
        _stop(proc, stop_grace_s)
        echo.join(5)
    poll()
    if proc.returncode:
        raise RanksFailed(describe_failure("".join(tail), proc.returncode))


_FAILURE = re.compile(
    r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)(?: \(pid: (\d+)\))?.*?traceback\s*:\s*(.*?)(?=\n-{8,}|\n={8,}|\Z)",
    re.DOTALL,
)


def describe_failure(output: str, returncode: int) -> str:
    """The rank that failed and how, from torchrun's failure summary: a rank killed by a signal
    from outside (not torchrun's SIGTERM to the others) first, since its peers then fail in the
    collective they shared with it, and may do so before torchrun sees the death; else torchrun's
    root cause. How: the signal, or the exception's last line (rank_main's `record`)."""
    start = output.rfind("Failures:")
    failures = [m.groups() for m in _FAILURE.finditer(output[start:])] if start >= 0 else []
    if not failures:
        return f"the trainer's ranks (torchrun) exited with code {returncode}; see the output above"
    killed = [f for f in failures if int(f[1]) < 0 and int(f[1]) != -15]
    root = output.rfind("Root Cause")
    if killed:
        rank, code, pid, trace = killed[0]
    elif root >= 0 and (first := _FAILURE.search(output[root:])) is not None:
        rank, code, pid, trace = first.groups()
    else:
        rank, code, pid, trace = failures[0]
    lines = [line.strip() for line in trace.splitlines() if line.strip()]
    how = lines[-1] if lines and lines[0].startswith("Traceback") else (lines[0] if lines else "")
    if how.startswith("To enable traceback") or not how:
        how = f"exit code {code}"
    return f"trainer rank {rank} (pid {pid}) failed: {how}"


def _echo(stream: Any, tail: collections.deque[str]) -> None:
    for line in stream:
        tail.append(line)
        sys.stderr.write(line)
    sys.stderr.flush()


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """torchrun stops its ranks on SIGTERM; anything still there after `grace_s` is killed."""
    if proc.poll() is not None:
        return
    left: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        left = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
