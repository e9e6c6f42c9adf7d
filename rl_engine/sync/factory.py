"""Which weight sync a run uses: the factories behind `synchronizer.sync_method` (with
rl_engine.run.devices.check_plan, which refuses a collective group that shares a device, the only
code that branches on the method).

    sender = build_weight_sender(cfg, run.board)                 # the trainer's side
    receiver = build_weight_receiver(cfg, run.board, explorer_id)  # an explorer's side

Checkpoint sync writes and reads under the board's run directory (`board.fs`, `board.run_root`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_engine.adapter import peft_config, synced_adapter
from rl_engine.api import WeightReceiver, WeightSender
from rl_engine.board import Board
from rl_engine.config import RFTConfig
from rl_engine.pruning import delete, list_dirs, pointer_target
from rl_engine.sync.checkpoint import CHECKPOINTS, CheckpointReceiver, CheckpointSender
from rl_engine.sync.collective import CollectiveReceiver, CollectiveSender
from rl_engine.sync.delta import DELTAS, DeltaCheckpointReceiver, DeltaCheckpointSender


def wire_dtype(cfg: RFTConfig) -> torch.dtype:
    """Floating parameters travel and are stored in the engine's dtype (model.dtype)."""
    return getattr(torch, cfg.model.dtype)


def build_weight_sender(
    cfg: RFTConfig, board: Board, pinned: Callable[[], str | None] | None = None, device: str | None = None
) -> WeightSender:
    """Trainer-side sync of `cfg.synchronizer.sync_method` (checkpoint with `synchronizer.delta.enabled`:
    deltas, rl_engine.sync.delta), meeting the receivers on the run's `board` (checkpoints go to
    its run directory; a resolved cfg names that run). `pinned` returns the model URL a lineage points at
    (`rl_engine.run.retention.lineage_model`): a version it names is never pruned. `device`: the
    trainer's ('cuda:1'), where a collective sync's buckets are packed."""
    return _SENDERS[cfg.synchronizer.sync_method](cfg, board, pinned, device)


def build_weight_receiver(cfg: RFTConfig, board: Board, explorer_id: int = 0) -> WeightReceiver:
    """Explorer-side sync of `cfg.synchronizer.sync_method` for explorer `explorer_id`, on the run's `board`."""
    return _RECEIVERS[cfg.synchronizer.sync_method](cfg, board, explorer_id)


def _collective_sender(
    cfg: RFTConfig, board: Board, pinned: Callable[[], str | None] | None, device: str | None
) -> WeightSender:
    s = cfg.synchronizer
    count, tp = cfg.explorer.count, cfg.explorer.engine.tensor_parallel_size
    return CollectiveSender(s.collective, board, count, tp, wire_dtype(cfg), s.wait_timeout_s, device)


def _checkpoint_sender(
    cfg: RFTConfig, board: Board, pinned: Callable[[], str | None] | None, device: str | None
) -> WeightSender:
    s = cfg.synchronizer
    full = CheckpointSender(
        board.fs,
        board.run_root,
        cfg.model.path,
        wire_dtype(cfg),
        board,
        cfg.explorer.count,
        s.wait_timeout_s,
        keep_last=s.keep_last_checkpoints,
        pinned=None if pinned is None else lambda: pointer_target(pinned(), cfg.run_url, CHECKPOINTS),
        adapter_config=None if (lora := synced_adapter(cfg.model.lora)) is None else peft_config(lora, cfg.model.path),
    )
    return DeltaCheckpointSender(full, s.delta.full_every) if s.delta.enabled else full


def _collective_receiver(cfg: RFTConfig, board: Board, explorer_id: int) -> WeightReceiver:
    s = cfg.synchronizer
    count, tp = cfg.explorer.count, cfg.explorer.engine.tensor_parallel_size
    return CollectiveReceiver(s.collective, board, explorer_id, count, tp, s.wait_timeout_s)


def _checkpoint_receiver(cfg: RFTConfig, board: Board, explorer_id: int) -> WeightReceiver:
    s = cfg.synchronizer
    full = CheckpointReceiver(board.fs, board.run_root, board, explorer_id, timeout_s=s.wait_timeout_s)
    return DeltaCheckpointReceiver(full) if s.delta.enabled else full


_SENDERS = {"collective": _collective_sender, "checkpoint": _checkpoint_sender}
_RECEIVERS = {"collective": _collective_receiver, "checkpoint": _checkpoint_receiver}


def drop_versions_from(cfg: RFTConfig, fs: Any, root: str, version: int) -> list[int]:
    """A resumed trainer, before it announces any version: delete the weights of versions >=
    `version` that the stopped attempt published (full checkpoints and deltas); returns their
    numbers. The trainer publishes `version` and every later one again, announcing each before it
    writes it: an explorer told one would otherwise find the stopped attempt's files committed
    under its number and load them while the trainer deletes or rewrites them (a fully_async
    delta run's resume failed: `no *.safetensors files in checkpoint directory .../version=3`).
    Collective sync stores nothing; checkpoints are under `root` (the run's directory) of `fs`."""
    if cfg.synchronizer.sync_method != "checkpoint":
        return []
    dropped: set[int] = set()
    for kind in (CHECKPOINTS, DELTAS):
        committed, uncommitted = list_dirs(fs, root, kind)
        doomed = [n for n in committed + uncommitted if n >= version]
        delete(fs, root, kind, doomed)
        dropped.update(doomed)
    return sorted(dropped)
