"""`reward: {type: code_tests}`: the response's code run against the task's tests in the sandbox.

The code is the response's last fenced ```python (or ```py) block, else its last untagged fenced
block, else the whole response (a block the token budget cut short counts up to the response's
end). The tests are the task row's `tests_key` column (default `tests`): a list of test strings
(each one test, e.g. `assert add(2, 3) == 5`), or one snippet, whose top-level `assert`s are one
test each (the statements before an assert belong to it; a snippet without one is one test).

One sandbox run per sample (rl_engine.rewards.sandbox: its own namespaces, rlimits, a clean
environment, killed whole at `sandbox.timeout_s`): the code is executed as module `solution`,
then each test in its namespace, in order; a test passes when it runs without raising. The
reward is the fraction of tests passed (`scoring: fraction`) or 1 only when all pass
(`all_or_nothing`). A run the sandbox had to stop (past its timeout, killed by a CPU or file
limit, more output than `output_kb`) scores 0, whatever it had passed. A task without tests is
left out (a reward error, counted).

A step's samples run `workers` at a time in threads of the explorer (each waits on its own
process), so a step's scoring takes at most ceil(samples / workers) x (timeout_s + 2 s). Each step
reports `reward/sandbox/...`: runs, timeouts, killed, output_limit, errors (the program exited
non-zero: a syntax error, the code raising at import), passed_frac (mean fraction of tests
passed) and run_ms_mean.

    rft make-tasks runs/data/code-train.jsonl --task python-functions
    reward: {type: code_tests, scoring: fraction, workers: 2, sandbox: {timeout_s: 5}}
"""

from __future__ import annotations

import ast
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl_engine.errors import UserError
from rl_engine.rewards.sandbox import STOP_GRACE_S, Sandbox, SandboxLimits, SandboxResult

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")
_COUNTED = {
    "timeout": "timeouts",
    "killed": "killed",
    "output_limit": "output_limit",
    "error": "errors",
}  # status -> metric

# The program each run executes (main.py): the solution as module `solution`, then each test in
# its namespace; one line `<index> <1|0>` per test on the results channel (fd 3) as it ends.
HARNESS = """\
import os as _os
import sys as _sys

_TESTS = {tests!r}


def _report(i, ok):
    try:
        _os.write(3, ("%d %d\\n" % (i, ok)).encode())
    except OSError:
        pass


_ns = {{"__name__": "solution", "__builtins__": __builtins__}}
try:
    with open("solution.py", encoding="utf-8") as _f:
        _code = compile(_f.read(), "solution.py", "exec")
    exec(_code, _ns)
except BaseException as _e:
    print("solution: %s: %s" % (type(_e).__name__, _e), file=_sys.stderr)
    raise SystemExit(1)
for _i, _test in enumerate(_TESTS):
    try:
        exec(compile(_test, "test_%d" % _i, "exec"), _ns)
        _report(_i, 1)
    except BaseException as _e:
        print("test %d: %s: %s" % (_i, type(_e).__name__, _e), file=_sys.stderr)
        _report(_i, 0)
"""


def extract_code(response: str) -> str:
    """The code of a response (see the module docstring)."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(response)]
    tagged = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if tagged:
        return tagged[-1]
    plain = [body for tag, body in blocks if not tag]
    return plain[-1] if plain else response


def split_tests(tests: Any, where: str = "the task") -> list[str]:
    """The tests of a task's tests column: one per list item, or one per top-level assert of a
    snippet (with the statements before it). ValueError naming `where` for anything else."""
    if isinstance(tests, (list, tuple)):
        if not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise ValueError(f"{where}: tests must be a non-empty list of non-empty strings, got {tests!r:.200}")
        return list(tests)
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError(
            f"{where}: tests must be a list of test strings or a test snippet, got {type(tests).__name__} {tests!r:.200}"
        )
    try:
        body = ast.parse(tests).body
    except SyntaxError as e:
        raise ValueError(f"{where}: its test snippet is not valid Python ({e.msg}, line {e.lineno})") from None
    out, chunk = [], []
    for stmt in body:
        chunk.append(stmt)
        if isinstance(stmt, ast.Assert):
            out.append("\n".join(ast.unparse(s) for s in chunk))
            chunk = []
    if chunk:
        out.append("\n".join(ast.unparse(s) for s in chunk))
    return out


class CodeTestsRewardFn:
    """The `code_tests` reward (see the module docstring); built from its config variant's fields."""

    def __init__(
        self,
        tests_key: str = "tests",
        scoring: str = "fraction",
        workers: int = 2,
        sandbox: dict[str, Any] | None = None,
    ):
        if scoring not in ("fraction", "all_or_nothing"):
            raise UserError(f"taskset.reward.scoring = {scoring!r}: use fraction or all_or_nothing")
        self.tests_key, self.scoring, self.workers = tests_key, scoring, max(1, int(workers))
        self.sandbox = Sandbox(SandboxLimits(**(sandbox or {})), field="taskset.reward.sandbox")

    def __call__(self, prompt: str, response: str, task: Any, finish_reason: str = "stop") -> float:
        outcome, _ = self._score(response, task)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def score_samples(
        self, samples: Sequence[Any]
    ) -> tuple[list[tuple[float, dict[str, float]] | Exception], dict[str, Any]]:
        """(reward, components) or the exception of each (prompt, response, task, finish_reason)
        sample, in order, and the step's `reward/sandbox/...` metrics; `workers` runs at a time."""
        started = time.monotonic()
        outcomes: list[Any] = [None] * len(samples)
        runs: list[SandboxResult | None] = [None] * len(samples)
        passed: list[float | None] = [None] * len(samples)
        if samples:
            bound_s = math.ceil(len(samples) / self.workers) * (self.sandbox.limits.timeout_s + STOP_GRACE_S + 10.0)
            with ThreadPoolExecutor(max_workers=min(self.workers, len(samples)), thread_name_prefix="code-tests") as ex:
                futures = [ex.submit(self._score, s[1], s[2]) for s in samples]
                for i, f in enumerate(futures):
                    outcome, (runs[i], passed[i]) = f.result(timeout=max(1.0, started + bound_s - time.monotonic()))
                    outcomes[i] = outcome if isinstance(outcome, Exception) else (outcome, {})
        done = [r for r in runs if r is not None]
        fractions = [p for p in passed if p is not None]
        metrics: dict[str, Any] = {
            "reward/sandbox/runs": len(done),
            **{f"reward/sandbox/{name}": 0 for name in _COUNTED.values()},
            "reward/sandbox/passed_frac": sum(fractions) / len(fractions) if fractions else float("nan"),
            "reward/sandbox/run_ms_mean": 1000 * sum(r.elapsed_s for r in done) / len(done) if done else float("nan"),
        }
        for r in done:
            if r.status in _COUNTED:
                metrics[f"reward/sandbox/{_COUNTED[r.status]}"] += 1
        return outcomes, metrics

    def _score(self, response: str, task: Any) -> tuple[float | Exception, tuple[SandboxResult | None, float | None]]:
        """(reward or the exception that leaves the sample out, (the run, fraction of tests passed))."""
        row = getattr(task, "row", None) or {}
        tid = getattr(task, "task_id", "?")
        if self.tests_key not in row:
            err = ValueError(
                f"task {tid!r} has no {self.tests_key!r} column (keys: {sorted(row)}); the code_tests reward runs the code against it "
                "(a list of assert statements or a test snippet); set taskset.reward.tests_key to the column that holds them"
            )
            return err, (None, None)
        try:
            tests = split_tests(row[self.tests_key], f"task {tid!r} column {self.tests_key!r}")
            result = self.sandbox.run(
                {"main.py": HARNESS.format(tests=tests), "solution.py": extract_code(response)}, "main.py"
            )
        except Exception as e:  # noqa: BLE001 - a bad tests column or a sandbox that cannot start: this sample out
            return e, (None, None)
        ok = set()
        for line in result.results:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1] == "1" and int(parts[0]) < len(tests):
                ok.add(int(parts[0]))
        frac = 0.0 if result.contained_failure else len(ok) / len(tests)
        reward = frac if self.scoring == "fraction" else float(frac == 1.0)
        return reward, (result, frac)

    def __repr__(self) -> str:
        return f"CodeTestsRewardFn(tests_key={self.tests_key!r}, scoring={self.scoring!r}, workers={self.workers}, {self.sandbox.isolation})"
