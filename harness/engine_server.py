"""A real `rft engine serve` on loopback for tests and benchmarks (rl_engine/rollout/server.py).

    with engine_server(config_yaml, log_dir) as srv:
        srv.url, srv.start_s     # http://127.0.0.1:<port>; seconds until /health answered

The server runs in a process group of its own (killed with it on exit, and by a watcher if this
process dies first); a server that exits or does not answer within `timeout_s` fails with its log.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.prefect_live import REPO, _base_env, kill_process_group, log_tail, reap_with_this_process

START_TIMEOUT_S = 300.0


@dataclass
class EngineServer:
    url: str
    start_s: float
    log_path: Path
    proc: subprocess.Popen


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def engine_server(
    config: str | Path, log_dir: Path, *overrides: str, timeout_s: float = START_TIMEOUT_S
) -> Iterator[EngineServer]:
    """`rft engine serve CONFIG --port <free>` until the block ends."""
    from rl_engine.trainer.dist import free_port

    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"engine-server-{port}.log"
    sets = [a for o in overrides for a in ("--set", o)]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "engine", "serve", str(config), "--port", str(port), *sets],
            cwd=REPO, env=_base_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    reaper = reap_with_this_process(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        while not _healthy(url):
            if proc.poll() is not None:
                raise AssertionError(f"`rft engine serve` exited with {proc.returncode}\n{log_tail(log_path)}")
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(
                    f"`rft engine serve` did not answer at {url}/health within {timeout_s:.0f} s\n{log_tail(log_path)}"
                )
            time.sleep(0.5)
        yield EngineServer(url, time.monotonic() - t0, log_path, proc)
    finally:
        kill_process_group(proc, grace_s=10)
        kill_process_group(reaper, grace_s=1)
