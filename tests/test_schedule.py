"""The workers' schedule (tests/schedule.py): its lists name the files they mean."""

from __future__ import annotations

import re
from pathlib import Path

from tests.schedule import LONGEST, TURN_FILES, TURN_UNIT, TurnScheduling

REPO = Path(__file__).resolve().parents[1]
TURN_FIXTURE = re.compile(r"\b(heavy_turn|real_model_turn|real_model_module_turn)\b")


def test_the_turn_unit_is_every_file_that_takes_the_turn():
    """A file that takes the real-model turn outside the unit would wait on the turn's lock beside it."""
    takes = {
        str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if TURN_FIXTURE.search(p.read_text())
    }
    takes.discard("tests/test_schedule.py")
    assert takes == TURN_FILES


def test_the_longest_files_exist_and_stay_out_of_the_turn():
    assert all((REPO / f).is_file() for f in LONGEST), [f for f in LONGEST if not (REPO / f).is_file()]
    assert not set(LONGEST) & TURN_FILES


def test_units_are_files_but_the_turns_and_go_longest_first():
    from collections import OrderedDict

    sched = TurnScheduling.__new__(TurnScheduling)  # only the unit logic: no xdist session
    ids = [
        "tests/rl_engine/test_board.py::test_a",
        "tests/flows/test_demo_real.py::test_b",
        "tests/flows/test_kill_resume.py::test_c",
        "tests/rl_engine/sync/test_real_model.py::test_d[x::y]",
    ]
    assert [sched._split_scope(i) for i in ids] == [
        "tests/rl_engine/test_board.py",
        TURN_UNIT,
        "tests/flows/test_kill_resume.py",
        TURN_UNIT,
    ]
    queue = ["tests/rl_engine/test_board.py", "tests/flows/test_kill_resume.py", TURN_UNIT]  # xdist's order

    class Node:
        def send_runtest_some(self, indexes):
            pass

    node = Node()
    sched.workqueue, sched.assigned_work, sched.registered_collections = (
        OrderedDict((u, {}) for u in queue),
        {},
        {node: []},
    )
    order = []
    while sched.workqueue:
        sched._assign_work_unit(node)
        order.append(list(sched.assigned_work[node])[-1])
    assert order == [TURN_UNIT, "tests/flows/test_kill_resume.py", "tests/rl_engine/test_board.py"]
