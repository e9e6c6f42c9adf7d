"""The suite's own report, printed at the end of every run (CI's log included) and written to
runs/test-report.json: wall time against the budget, each test's duration, the expensive starts
(vLLM engines, DeepSpeed inits, torchrun launches, Prefect and S3 servers) and every rerun test.

Loaded by tests/conftest.py (`pytest_plugins`). Under pytest-xdist the controller writes the
report: the workers' reports reach it with their durations, and every process of the run (test
workers, the runs they start) appends its starts to one tally file (rl_engine/proc/starts.py).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from rl_engine.proc.starts import ENV as STARTS_ENV
from rl_engine.proc.starts import read_counts

# `make test` on the 2-core machine CI runs on; docs/guides/development.md says how it is kept.
BUDGET_MIN = 30.0
KINDS = ("vllm_engine", "deepspeed_init", "torchrun", "prefect_server", "moto_s3")
REPORT = Path(__file__).resolve().parents[1] / "runs" / "test-report.json"


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _controller(config):
        return
    if not os.environ.get(STARTS_ENV):  # the workers and every process they start inherit it
        fd, path = tempfile.mkstemp(prefix="rft-starts-", suffix=".txt")
        os.close(fd)
        os.environ[STARTS_ENV] = path
    config.stash[_STARTED] = time.monotonic()


_STARTED = pytest.StashKey[float]()


def _first_try(report: pytest.TestReport) -> str:
    """A rerun test's first failure: the crash message's first line, and where the message goes on
    (a bench's or a child's output tail, which the rerun's passing report does not keep) its last lines."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if not (crash and crash.message):
        return str(report.longrepr)[-1500:]
    lines = crash.message.splitlines()
    more = lines[1:][-20:]
    return lines[0][:300] + "".join(f"\n    | {line[:300]}" for line in more)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _controller(config) or _STARTED not in config.stash:
        return
    wall_min = (time.monotonic() - config.stash[_STARTED]) / 60
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport) and r.when in ("setup", "call", "teardown"):
                per_test[r.nodeid] = per_test.get(r.nodeid, 0.0) + r.duration
    counts = read_counts(os.environ.get(STARTS_ENV, ""))
    reruns = sorted({r.nodeid for r in terminalreporter.stats.get("rerun", [])})
    write = terminalreporter.write_line
    terminalreporter.section("suite report")
    write("starts: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in KINDS))
    if reruns:
        failed = {r.nodeid for r in terminalreporter.stats.get("failed", []) if isinstance(r, pytest.TestReport)}
        flaky = [n for n in reruns if n not in failed]
        write(
            f"RERUN {len(reruns)} test(s): {len(flaky)} failed once and then passed (flaky: fix it, a rerun only hides it)"
            f"{': ' + ', '.join(flaky) if flaky else ''}; {len(reruns) - len(flaky)} failed on the rerun too"
        )
        for r in terminalreporter.stats.get("rerun", []):  # what the first try failed on: the flake to fix
            write(f"  {r.nodeid} ({r.when}): {_first_try(r)}")
    else:
        write("reruns: none")
    # The budget is the whole suite's: a subset (paths, -k, -m) is reported, never called over it.
    whole = (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.getoption("keyword")
        and not config.getoption("markexpr")
    )
    line = f"suite time: {wall_min:.1f} min for {len(per_test)} tests (budget {BUDGET_MIN:g} min for the whole suite on 2 cores)"
    if whole and wall_min > BUDGET_MIN:
        line = f"OVER BUDGET: the suite took {wall_min:.1f} min, more than its {BUDGET_MIN:g} min; share the engines or servers of the slowest tests above"
    write(line)
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(
        json.dumps(
            {
                "wall_min": round(wall_min, 2),
                "budget_min": BUDGET_MIN,
                "tests": len(per_test),
                "exitstatus": int(exitstatus),
                "starts": {k: counts.get(k, 0) for k in sorted(set(KINDS) | set(counts))},
                "reruns": reruns,
                "durations_s": {n: round(s, 2) for n, s in sorted(per_test.items(), key=lambda kv: -kv[1])},
            },
            indent=1,
        )
    )
