"""Where a run's trainer states are and which is the latest: the query resume, preflight, lineage and the report share.

Layout (written by rl_engine.trainer.checkpoint, pruned by rl_engine.run.retention):

    <run>/trainer_state/step=<t>/COMMITTED    the state after trainer step t, whole once COMMITTED exists
"""

from __future__ import annotations

from rl_engine.run.context import RunContext
from rl_engine.storage import join
from rl_engine.trainer.checkpoint import COMMIT_MARKER

STATE_DIR = "trainer_state"


def latest_state_step(run: RunContext) -> int | None:
    """Highest trainer step with a committed trainer state, or None."""
    fs, root = run.fs()
    steps = []
    for p in fs.glob(join(root, STATE_DIR, "step=*", COMMIT_MARKER)):
        steps.append(int(p.rsplit("step=", 1)[1].split("/")[0]))
    return max(steps, default=None)
