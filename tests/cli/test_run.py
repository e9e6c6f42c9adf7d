"""`rft run` starts its ephemeral Prefect server while preflight's model checks run (cli.run.prefect_server_ahead).

Each case runs in its own Python process, as `rft run` does, with its own PREFECT_HOME: the server
process must be launched inside the block, answer when the block ends, and be gone once the
process has exited, also when the block fails (a model check that finds a problem).

    .venv/bin/python -m pytest tests/cli/test_run.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, time
import httpx
from prefect.server.api.server import SubprocessASGIServer
from cli.run import prefect_server_ahead

out, fail = {}, sys.argv[2] == "fail"
try:
    with prefect_server_ahead():
        deadline = time.monotonic() + 60
        while SubprocessASGIServer().server_process is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc = SubprocessASGIServer().server_process
        out["pid"] = proc.pid if proc is not None else None
        if fail:
            raise RuntimeError("a model check found a problem")
    out["health"] = httpx.get(SubprocessASGIServer().api_url + "/health", timeout=10).status_code
finally:
    json.dump(out, open(sys.argv[1], "w"))
"""


def _start(tmp_path: Path, case: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    home = tmp_path / f"prefect-home-{case}"
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
    )
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / f"{case}.json"), case],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_the_server_starts_during_the_checks_and_no_process_outlives_it(tmp_path):
    procs = {case: _start(tmp_path, case) for case in ("ok", "fail")}  # side by side: each ~10 s of imports and start
    try:
        err = {case: p.communicate(timeout=180)[1] for case, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()  # only one left running past the deadline is still there
    out = {case: json.loads((tmp_path / f"{case}.json").read_text()) for case in procs}
    assert procs["ok"].returncode == 0, err["ok"][-3000:]
    assert out["ok"]["pid"] is not None, "no server process was launched while the block ran"
    assert out["ok"]["health"] == 200
    # A model check that fails inside the block: the error propagates, and the server the block
    # started is stopped when the process exits.
    assert procs["fail"].returncode == 1 and "a model check found a problem" in err["fail"]
    assert out["fail"]["pid"] is not None and "health" not in out["fail"]
    for case in procs:
        assert _gone(out[case]["pid"]), (
            f"{case}: the ephemeral server (pid {out[case]['pid']}) outlived the process that started it"
        )
