"""Placement `local` runs every role as a thread of the flow's process, with the shorter GIL switch interval.

.venv/bin/python -m pytest tests/flows/test_run_local.py -q
"""

from __future__ import annotations

import sys
import types

import pytest

from flows import common
from rl_engine.roles.entry import SHARED_PROCESS_SWITCH_INTERVAL_S


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def test_local_roles_start_and_finish_under_the_shared_process_switch_interval(monkeypatch):
    seen = []

    def submit(*args):
        seen.append((args, sys.getswitchinterval()))
        return _Done(1)

    monkeypatch.setattr(common, "trainer_task", types.SimpleNamespace(submit=submit))
    monkeypatch.setattr(common, "explorer_task", types.SimpleNamespace(submit=submit))
    run = types.SimpleNamespace(
        url="runs/x", storage_options={}, cfg=types.SimpleNamespace(explorer=types.SimpleNamespace(count=2))
    )
    before = sys.getswitchinterval()
    common.run_local(run, "progress-id")
    assert [a for a, _ in seen] == [("runs/x", {}, "progress-id"), ("runs/x", 0, {}), ("runs/x", 1, {})]
    assert all(s == pytest.approx(SHARED_PROCESS_SWITCH_INTERVAL_S) for _, s in seen)
    assert sys.getswitchinterval() == before


class _Raises:
    def __init__(self, error):
        self.error = error

    def result(self):
        raise self.error


class _Board:
    def __init__(self, stop):
        self.stop = stop

    def get(self, key):
        return self.stop


@pytest.mark.parametrize("kind", ["cancelled", "failed"])
def test_a_cancelled_run_logs_no_error_line_a_failed_one_does(monkeypatch, kind):
    """A role cut short by a cancel from the UI (its error raised once every role ended) logs
    `run stopped: ...` as info; a failure stays an error (issue 44: a cancel logged an ERROR line)."""
    records = []

    class Logger:
        def __getattr__(self, level):
            return lambda msg, *args: records.append((level, msg % args))

    error = RuntimeError("the engine went away")
    monkeypatch.setattr(common, "get_run_logger", Logger)
    monkeypatch.setattr(common, "trainer_task", types.SimpleNamespace(submit=lambda *a: _Raises(error)))
    monkeypatch.setattr(common, "explorer_task", types.SimpleNamespace(submit=lambda *a: _Done(1)))
    reason = "the flow run was cancelled" if kind == "cancelled" else "trainer failed: boom"
    run = types.SimpleNamespace(
        url="runs/x",
        storage_options={},
        cfg=types.SimpleNamespace(explorer=types.SimpleNamespace(count=1)),
        board=_Board({"kind": kind, "reason": reason, "by": "flow"}),
    )
    with pytest.raises(RuntimeError, match="the engine went away"):
        common.run_local(run)
    level = "info" if kind == "cancelled" else "error"
    assert records == [(level, f"run stopped: {reason}")], records
