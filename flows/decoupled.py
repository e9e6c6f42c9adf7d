"""Modes (c) fully asynchronous and (d) multi-explorer asynchronous: the decoupled schedule.

Explorers and the trainer never rendezvous. The trainer publishes its weights every
`sync_interval` trainer steps; each explorer, between its steps, picks up the newest published
version and waits only when `max_staleness` requires it. (c) is one explorer, (d) is
`explorer.count` explorers writing to one buffer, each with its own id and step counter. The
roles (rl_engine/roles/entry.py) run as tasks of this flow run or as flow runs of their own
deployments (`placement`).

    rft run configs/fully_async.yaml
    rft run configs/multi_explorer.yaml
"""

from __future__ import annotations

from flows.common import Overrides, mode_flow, run_mode
from rl_engine.config import RFTConfig


@mode_flow("fully-async", "fully_async")
def fully_async(set: Overrides = None, *, cfg: RFTConfig, resume: str | None = None):
    """Mode (c): one explorer and the trainer as independent loops."""
    return run_mode(cfg, resume, "fully_async", set)


@mode_flow("multi-explorer", "multi_explorer")
def multi_explorer(set: Overrides = None, *, cfg: RFTConfig, resume: str | None = None):
    """Mode (d): explorer.count explorers and one trainer, one buffer."""
    return run_mode(cfg, resume, "multi_explorer", set)
