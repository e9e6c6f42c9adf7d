"""Modes (a) synchronous and (b) one-step off-policy: the rendezvous schedule for any k, m.

The explorer syncs after explorer step e iff e > m and (e - m) % k == 0, receiving version
e - m; the trainer, after a step t that sync delivers, sends it and waits for the load. Between
sync points both roles run concurrently (rl_engine/roles/entry.py), as tasks of this flow run or as
flow runs of their own deployments (`placement`).

    rft run configs/synchronous.yaml          # k=1, m=0
    rft run configs/one_step_off_policy.yaml  # k=1, m=1
"""

from __future__ import annotations

from flows.common import Overrides, mode_flow, run_mode
from rl_engine.config import RFTConfig


@mode_flow("synchronous", "synchronous")
def synchronous(set: Overrides = None, *, cfg: RFTConfig, resume: str | None = None):
    """Mode (a): rollout with v(t-1), train t, sync vt; generalised to any sync_interval."""
    return run_mode(cfg, resume, "synchronous", set)


@mode_flow("one-step-off-policy", "one_step_off_policy")
def one_step_off_policy(set: Overrides = None, *, cfg: RFTConfig, resume: str | None = None):
    """Mode (b): the explorer runs sync_offset steps ahead, rollout e+1 overlaps train e."""
    return run_mode(cfg, resume, "one_step_off_policy", set)
