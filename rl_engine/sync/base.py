"""What both sides of a weight sync share (the interface, one Protocol per side, is in rl_engine.api); the explicit factories are in factory.py.

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

from rl_engine.board import Board, StopSignal


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
