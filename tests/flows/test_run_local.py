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
