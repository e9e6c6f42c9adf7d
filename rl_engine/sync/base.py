"""The weight-sync interface (one Protocol per side) and its explicit factories.

`synchronizer.sync_method` picks the method: `collective` (broadcast over a process group,
`collective.py`) or `checkpoint` (committed checkpoints on the run's storage, `checkpoint.py`).
The trainer side runs in the trainer's thread, each explorer side in its explorer's thread.

    sender = build_weight_sender(cfg)                  # trainer rank 0
    receiver = build_weight_receiver(cfg, explorer_id) # each explorer, with its own engine
    # concurrently: sender.connect()  |  receiver.connect(engine)
    # each sync:    sender.send(named_weights, version=t)  |  receiver.receive(engine) -> t
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rl_engine.config import RFTConfig


class WeightSender(Protocol):
    """Trainer side of a weight sync."""

    method: str

    def connect(self) -> None:
        """Join whatever the method needs (the process group); blocks until the receivers joined."""
        ...

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish (HF parameter name, full tensor) pairs as weight version `version`."""
        ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """Explorer side of a weight sync: installs weights into a live rollout engine."""

    method: str

    def connect(self, engine: Any) -> None:
        """Join from the engine's inference workers (collective) or nothing (checkpoint)."""
        ...

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Install the trainer's weights into `engine` and return the installed version (engine.version too)."""
        ...

    def close(self) -> None: ...


def wire_dtype(cfg: RFTConfig) -> torch.dtype:
    """Floating parameters travel and are stored in the engine's dtype (model.dtype)."""
    return getattr(torch, cfg.model.dtype)


def build_weight_sender(cfg: RFTConfig) -> WeightSender:
    """Trainer-side sync of `cfg.synchronizer.sync_method`; checkpoint needs a resolved cfg (run URL)."""
    s = cfg.synchronizer
    if s.sync_method == "collective":
        from rl_engine.sync.collective import CollectiveSender

        return CollectiveSender(s.collective, cfg.explorer.count, cfg.explorer.engine.tensor_parallel_size, wire_dtype(cfg))
    if s.sync_method == "checkpoint":
        from rl_engine.sync.checkpoint import CheckpointSender

        return CheckpointSender(cfg.run_url, cfg.buffer.storage.options, cfg.model.path, wire_dtype(cfg))
    raise ValueError(f"unknown synchronizer.sync_method {s.sync_method!r}")


def build_weight_receiver(cfg: RFTConfig, explorer_id: int = 0) -> WeightReceiver:
    """Explorer-side sync of `cfg.synchronizer.sync_method` for explorer `explorer_id`."""
    s = cfg.synchronizer
    if s.sync_method == "collective":
        from rl_engine.sync.collective import CollectiveReceiver

        return CollectiveReceiver(s.collective, explorer_id, cfg.explorer.count, cfg.explorer.engine.tensor_parallel_size)
    if s.sync_method == "checkpoint":
        from rl_engine.sync.checkpoint import CheckpointReceiver

        return CheckpointReceiver(cfg.run_url, cfg.buffer.storage.options, timeout_s=s.wait_timeout_s)
    raise ValueError(f"unknown synchronizer.sync_method {s.sync_method!r}")
