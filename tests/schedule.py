"""How `make test`'s two xdist workers share the test files (loaded by tests/conftest.py).

As `--dist loadfile`: each file runs whole on one worker (module fixtures and test order kept). Two
changes to which unit goes where:

- The files whose tests take the real-model turn (TURN_FILES; tests/conftest.py's `heavy_turn`,
  `real_model_turn`, `real_model_module_turn`) are one unit. Spread over both workers, a worker
  waiting for the turn idled while the other held it (110 s in one CI run, in one test's set-up);
  on one worker they run back to back and the other worker meanwhile runs everything else.
- The longest units go first (LONGEST, then xdist's order: most tests first). Two workers finish
  together only when the last units are short; a few-test file of minutes queued last (xdist's
  order puts those there) ran alone at the end.

A worker takes a new unit only near the end of its current one (xdist's low-watermark of 2 pending
tests), so the turn's unit does not hold other files back on its worker.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

# Every test file that takes the real-model turn (tests/test_schedule.py checks the list).
TURN_FILES = frozenset(
    {
        "tests/deployments/test_live_operations.py",
        "tests/flows/test_demo_real.py",
        "tests/flows/test_placement_deployments.py",
        "tests/rl_engine/sync/test_real_model.py",
    }
)
TURN_UNIT = "real-model turn"

# The longest files after the turn's, by their time in a CI-path run of the suite (48101f6:
# 535, 256, 114, 111, 86, 69, 68, 68, 65, 59 s); the rest take under a minute each.
LONGEST = (
    "tests/bench/test_bench_smoke.py",
    "tests/flows/test_kill_resume.py",
    "tests/flows/test_pairwise.py",
    "tests/deployments/test_live_prefect.py",
    "tests/rl_engine/rollout/test_engine_faults.py",
    "tests/rl_engine/rewards/test_judge.py",
    "tests/flows/test_partial_crash.py",
    "tests/flows/test_lineage_flows.py",
    "tests/rl_engine/trainer/test_op_build_guard.py",
    "tests/rl_engine/test_storage_outage.py",
)
FIRST = (TURN_UNIT, *LONGEST)


class TurnScheduling(LoadFileScheduling):
    """`--dist loadfile` with the real-model turn's files as one unit, the longest units first."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return TURN_UNIT if path in TURN_FILES else path

    def _assign_work_unit(self, node) -> None:
        for unit in reversed(FIRST):  # the queue is xdist's (most tests first); ours go in front
            if unit in self.workqueue:
                self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> TurnScheduling | None:
    return TurnScheduling(config, log) if config.getvalue("dist") == "loadfile" else None
