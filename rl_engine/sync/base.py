"""The weight-sync interface (one Protocol per side); its explicit factories are in factory.py.

`synchronizer.sync_method` picks the method: `collective` (broadcast over a process group,
`collective.py`) or `checkpoint` (committed checkpoints on the run's storage, `checkpoint.py`; with
`synchronizer.delta.enabled`, sparse deltas between full ones, `delta.py`).
The trainer side runs in the trainer role, each explorer side in its explorer role: threads of
one process or processes on other machines. They meet only on the run's control board (`board`)
and, for `collective`, in the process group whose address the trainer publishes there. Every
board key of a sync is defined in this package; callers never branch on the method.

    sender = build_weight_sender(cfg, board)                   # trainer rank 0
    receiver = build_weight_receiver(cfg, board, explorer_id)  # each explorer, with its own engine
    # concurrently: sender.connect()  |  receiver.connect(engine)
    # each sync:    sender.prepare(t); sender.send(named_weights, t)  |  receiver.prepare(t); receiver.receive(engine, t) -> t
    #               sender.wait_loaded(t)   (rendezvous: every explorer acknowledged t)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rl_engine.board import Board, StopSignal


class WeightSender(Protocol):
    """Trainer side of a weight sync. Each sync is `prepare(v)` (wait until the receivers can take
    it; nothing for checkpoints), `send(weights, v)`, and at a rendezvous `wait_loaded(v)`."""

    method: str

    def connect(self, stop: StopSignal | None = None) -> None:
        """Join whatever the method needs (the process group); blocks until the receivers joined."""
        ...

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Block until every receiver is ready to take `version` (collective: all joined the broadcast)."""
        ...

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish (HF parameter name, full tensor) pairs as weight version `version`; a method
        that keeps versions on storage (checkpoint) prunes them here (synchronizer.keep_last_checkpoints)."""
        ...

    def wait_loaded(self, version: int, stop: StopSignal | None = None) -> None:
        """Block until every explorer acknowledged loading `version` (or newer)."""
        ...

    def close(self) -> None:
        """Release the method's resources; receivers still waiting for a send are released too."""
        ...


class WeightReceiver(Protocol):
    """Explorer side of a weight sync: installs weights into a live rollout engine.
    Each sync is `prepare(v)` (collective: join the broadcast) then `receive(engine, v)`."""

    method: str
    joins_every_version: bool  # a send waits for every explorer (a broadcast), so none may skip a version

    def connect(self, engine: Any, stop: StopSignal | None = None) -> None:
        """Join from the engine's inference workers (collective) or nothing (checkpoint)."""
        ...

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Block until the trainer is ready to hand over `version`; raises Stopped if it gave up."""
        ...

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Install the trainer's weights into `engine`, acknowledge them on the board, and
        return the installed version (engine.version too)."""
        ...

    def close(self) -> None: ...


class SyncError(RuntimeError):
    """A weight sync failed; the message names the side that broke it (explorer i, the trainer,
    a checkpoint version or file) and what to do."""


# Board key through which explorer i acknowledges the version its engine holds.
def loaded_key(explorer_id: int) -> str:
    return f"explorer-{explorer_id}"


def post_loaded(board: Board, explorer_id: int, version: int) -> None:
    board.post(loaded_key(explorer_id), {"version": version})


def wait_loaded(board: Board, num_explorers: int, version: int, timeout_s: float, stop: StopSignal | None) -> None:
    """Block until every explorer acknowledged `version` or newer."""
    for i in range(num_explorers):
        board.wait(
            loaded_key(i),
            lambda m: m["version"] >= version,
            what=f"explorer {i} to load version {version}",
            timeout_s=timeout_s,
            stop=stop,
        )
