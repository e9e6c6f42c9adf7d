"""Failpoints: SIGKILL this process at a named point of a run, for crash tests.

    RFT_FAILPOINT=explorer.after_commit@3 rft run CONFIG   # dies right after explorer step 3's buffer commit

Only the environment turns one on; a run without RFT_FAILPOINT never stops at one. SIGKILL, not
an exception: nothing gets to clean up, as when a machine is lost. Points (name@explorer step):

- explorer.after_stage: a partial step's batch is staged in the continuation store, not committed;
- explorer.after_commit: the batch is committed to the buffer, its staged copy not yet retired;
- buffer.after_data: a BufferWriter wrote the step's data file, not yet its commit record.

Used by tests/flows/test_partial_crash.py and tests/rl_engine/buffer/test_buffer_sweep.py.
"""

from __future__ import annotations

import os
import signal

ENV = "RFT_FAILPOINT"


def failpoint(name: str, step: int) -> None:
    """Kill this process at once if RFT_FAILPOINT names this point and step."""
    if os.environ.get(ENV) == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
