"""Benchmark of the rewards beyond rules (issue 47): the code sandbox.

    python -m bench.rewards [--quick] [--runs N]

`sandbox_overhead_ms`: what the sandbox adds to one execution (rl_engine.rewards.sandbox: its own
PID, network, mount, IPC and UTS namespaces, a root of its own, no rights, rlimits, a clean
environment) over a bare `subprocess.run` of the same program with the same interpreter and flags
(`python -I -S main.py`, in a directory holding the same files): the median of each over --runs
executions, taken in turns, and their difference. The program is a code_tests run (the harness,
a 2-line solution, 4 asserts). The goal is <= 50 ms.

`sandbox_contained_fraction`: the hostile programs of harness/hostile_code.py (fork bomb,
infinite loop, memory bomb, a 10 GB file, filling the disk, reading a fake ~/.aws and a run's
config holding a fake secret (and the environment), a socket to a listener on 127.0.0.1, killing
this process, printing 1 GB), each scored by the code_tests reward (2 s timeout) and run alone in
its sandbox: contained when it scored 0, counted, within its bound, leaked nothing, connected
nowhere and this process lived. The goal is 1.0.

Not measured (not built yet, issue 47 items 1 and 2): `rm_samples_per_s` (a reward model
service's throughput) and `judge_agreement` (an LLM judge against the exact rule reward); the JSON
line leaves them out. The code demo's held-out pass@1 before and after training is not measured
here either (`rft run configs/code.yaml` evaluates it at the start and the end).

--quick: 10 executions per side instead of 40; the hostile cases are the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

from bench._report import emit_json, print_table
from harness.hostile_code import ADD, CASES, TESTS, baited, contain
from rl_engine.rewards.code_tests import HARNESS, CodeTestsRewardFn
from rl_engine.rewards.sandbox import Sandbox, SandboxLimits, _python

HOSTILE_LIMITS = {"timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256, "file_size_mb": 8, "disk_mb": 32}


def overhead(runs: int) -> dict[str, float]:
    """Median ms per execution of the code_tests program in the sandbox and bare, and the difference."""
    files = {"main.py": HARNESS.format(tests=TESTS), "solution.py": ADD}
    box = Sandbox(SandboxLimits())
    bare_dir = tempfile.mkdtemp(prefix="bench-rewards-bare-")
    for name, text in files.items():
        Path(bare_dir, name).write_text(text)
    sandboxed, bare = [], []
    box.run(files, "main.py")  # warm: the first run pays the probe and the page cache
    for _ in range(runs):
        started = time.perf_counter()
        result = box.run(files, "main.py")
        sandboxed.append(1000 * (time.perf_counter() - started))
        assert result.status == "ok" and result.results == [f"{i} 1" for i in range(len(TESTS))], result
        started = time.perf_counter()
        subprocess.run([_python(), "-I", "-S", "main.py"], cwd=bare_dir, check=True, capture_output=True)
        bare.append(1000 * (time.perf_counter() - started))
    s, b = statistics.median(sandboxed), statistics.median(bare)
    return {
        "sandbox_ms": s,
        "bare_ms": b,
        "overhead_ms": s - b,
        "isolation": box.isolation,
        "guarantees": box.guarantees(),
    }


def hostile() -> list[dict[str, object]]:
    """One row per hostile case: contained or not, wall seconds, what went wrong."""
    reward = CodeTestsRewardFn(workers=1, sandbox=HOSTILE_LIMITS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rewards-bait-") as root, baited(Path(root)) as bait:
        names = ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "PREFECT_API_KEY")
        with mock.patch.dict(os.environ, dict.fromkeys(names, bait.secret)):  # the scorer's environment holds it too
            for name, case in CASES.items():
                v = contain(reward, case, bait)
                rows.append({"case": name, "contained": v.contained, "wall_s": round(v.wall_s, 2), "detail": v.detail})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 executions per side (default 40)")
    ap.add_argument("--runs", type=int, default=None, help="executions per side")
    a = ap.parse_args()
    runs = a.runs or (10 if a.quick else 40)
    o = overhead(runs)
    print_table(
        [{"side": "sandbox", "median_ms": o["sandbox_ms"]}, {"side": "bare subprocess.run", "median_ms": o["bare_ms"]}],
        title=f"one execution of a code_tests program, {runs} runs each (sandbox: {o['guarantees']})",
    )
    rows = hostile()
    print_table(rows, title="hostile programs (code_tests reward, 2 s timeout)")
    contained = sum(r["contained"] for r in rows) / len(rows)
    emit_json(
        {
            "sandbox_overhead_ms": round(o["overhead_ms"], 1),
            "sandbox_ms": round(o["sandbox_ms"], 1),
            "bare_ms": round(o["bare_ms"], 1),
            "sandbox_contained_fraction": contained,
            "sandbox_isolation": o["isolation"],
            "hostile_cases": len(rows),
            "runs": runs,
        }
    )


if __name__ == "__main__":
    main()
