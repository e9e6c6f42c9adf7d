"""Weight sync without hangs (issue 13 item 4): a side that dies or never comes fails the other
within a stated bound, naming it; a damaged checkpoint version is refused by name, never half-loaded.

Bounds: a rendezvous wait fails after synchronizer.wait_timeout_s (plus a poll); a broken
broadcast fails both sides within SYNC_ERROR_GRACE_S (5 s, the wait for the peers' reports) plus
gloo's notice of the closed connection (under a second), far below collective.timeout_s, which
these tests set to 60 s so that reaching it fails them. Processes that die here are either plain
processes of this test or a dedicated vLLM engine (never the session's shared ones).

    .venv/bin/python -m pytest tests/rl_engine/sync/test_sync_faults.py -q -s
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_engine.board import Board, Stopped, WaitTimeout
from rl_engine.config import CollectiveConfig
from rl_engine.rollout.engine import EngineDiedError, build_rollout_engine
from rl_engine.storage import open_storage
from rl_engine.sync.base import SyncError
from rl_engine.sync.checkpoint import COMMIT, CheckpointReceiver, CheckpointSender
from rl_engine.sync.collective import ADDRESS_KEY, SYNC_ERROR_GRACE_S, CollectiveReceiver, CollectiveSender, group_key
from rl_engine.trainer.dist import free_port
from tests.rl_engine.rollout.engines import load_hf, make_config, max_logprob_diff
from tests.rl_engine.rollout.test_engine_faults import _Call
from tests.rl_engine.sync.helpers import named_weights, perturbed_hf, rollouts

REPO = Path(__file__).resolve().parents[3]
WAIT_S = 2.0  # synchronizer.wait_timeout_s in these tests
MARGIN_S = 3.0  # stated margin over a bound: polls, thread hand-offs on a loaded 2-core machine
BROKEN_BOUND_S = SYNC_ERROR_GRACE_S + MARGIN_S  # a broken broadcast -> each side's error
GROUP_TIMEOUT_S = 60.0  # collective.timeout_s: reaching it would mean a hang, not a named failure
LOGPROB_TOL = 1e-5


def _collective(**kw: Any) -> CollectiveConfig:
    return CollectiveConfig(**{"bucket_mb": 0.01, "timeout_s": GROUP_TIMEOUT_S, **kw})


def _joined(side: _Call, timeout: float) -> _Call:
    """`side` once it ended; fails the test if it is still blocked after `timeout` s."""
    assert side.join(timeout), f"{side.thread.name} still blocked after {timeout} s"
    return side


# A side in its own process, so that it can be SIGKILLed mid-broadcast without a word:
# `trainer` sends version 1 and kills itself after KILL_AT tensors; `explorer` is a bare group
# member (an explorer process) that kills itself after KILL_AT received buckets.
_PEER = r"""
import os, signal, sys, time
import torch
from safetensors.torch import load_file
from rl_engine.config import CollectiveConfig
from rl_engine.board import Board
from rl_engine.sync.collective import ADDRESS_KEY, CollectiveReceiver, CollectiveSender, group_key
role, run_url, c_json, model_dir, kill_at = sys.argv[1:6]
board, c, kill_at = Board.at(run_url), CollectiveConfig.model_validate_json(c_json), int(kill_at)
if role == "trainer":
    s = CollectiveSender(c, board, 1, 1, torch.float32, 30)
    s.connect()
    s.prepare(1)
    def weights():
        for i, item in enumerate(load_file(os.path.join(model_dir, "model.safetensors")).items()):
            if i == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
            yield item
    s.send(weights(), 1)
else:
    from rl_engine.sync.buckets import broadcast_recv, join_group
    from rl_engine.sync.shm import SharedRegion
    addr = board.wait(ADDRESS_KEY, lambda m: True, what="address", timeout_s=60)
    board.post(group_key(0), {"host": addr["host"], "port": addr["port"]})
    region = SharedRegion.attach(addr["shm"]) if addr.get("shm") else None
    pg, region = join_group(addr["host"], addr["port"], 1, 2, "gloo", c.timeout_s, region=region)
    CollectiveReceiver(c, board, 0, 1, 1, 30).prepare(1)
    n = 0
    def load(params):
        global n
        n += 1
        if n == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    broadcast_recv(pg, torch.device("cpu"), load, region=region)
"""


def _peer(
    role: str, run_url: str, c: CollectiveConfig, model_dir: str, kill_at: int
) -> tuple[subprocess.Popen, dict[str, float]]:
    """Start a peer process; returns it and a dict that gets its death time ('died', monotonic)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, "-c", _PEER, role, run_url, c.model_dump_json(), model_dir, str(kill_at)], cwd=REPO, env=env
    )
    death: dict[str, float] = {}

    def watch() -> None:
        p.wait()
        death["died"] = time.monotonic()

    threading.Thread(target=watch, daemon=True).start()
    return p, death


def _slowly(
    items: list[tuple[str, torch.Tensor]], kill: Callable[[], None] | None = None, kill_at: int = -1
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights, one every 50 ms (a broadcast long enough to break in the middle);
    `kill()` runs before item `kill_at`."""
    for i, item in enumerate(items):
        if i == kill_at and kill is not None:
            kill()
        time.sleep(0.05)
        yield item


def _reap(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)


# ---------------------------------------------------------------- rendezvous waits (no engine)


def test_explorer_that_never_joins_fails_trainer_prepare_naming_it(tmp_path):
    board = Board.at(str(tmp_path))
    sender = CollectiveSender(_collective(), board, 2, 1, torch.float32, WAIT_S)
    joined = CollectiveReceiver(_collective(), board, 0, 2, 1, 30)  # explorer 0 comes; explorer 1 never does
    explorer0 = _Call(lambda: joined.prepare(1), "explorer-0")
    t0 = time.monotonic()
    trainer = _joined(_Call(lambda: sender.prepare(1), "trainer"), WAIT_S + MARGIN_S + 5)
    took = trainer.ended_at - t0
    print(f"explorer 1 never joins: trainer's prepare failed after {took:.2f} s (wait_timeout_s {WAIT_S})")
    assert isinstance(trainer.error, WaitTimeout), repr(trainer.error)
    assert "explorer 1 to join the broadcast of version 1" in str(trainer.error) and "explorer 0" not in str(
        trainer.error
    )
    assert WAIT_S <= took < WAIT_S + MARGIN_S
    # The explorer that did join is released by the trainer's abandon, not left waiting for a go.
    _joined(explorer0, MARGIN_S)
    assert isinstance(explorer0.error, Stopped) and "abandoned the broadcast of version 1" in str(explorer0.error)


def test_trainer_that_never_says_go_fails_waiting_explorer_naming_it(tmp_path):
    receiver = CollectiveReceiver(_collective(), Board.at(str(tmp_path)), 0, 1, 1, WAIT_S)
    t0 = time.monotonic()
    side = _joined(_Call(lambda: receiver.prepare(3), "explorer-0"), WAIT_S + MARGIN_S + 5)
    print(f"no trainer: explorer's prepare failed after {side.ended_at - t0:.2f} s")
    assert isinstance(side.error, WaitTimeout) and "the trainer to start broadcasting version 3" in str(side.error)
    assert WAIT_S <= side.ended_at - t0 < WAIT_S + MARGIN_S


def test_group_that_never_forms_names_the_missing_explorer(tmp_path):
    board, port, timeout_s = Board.at(str(tmp_path)), free_port(), 3.0
    board.post(group_key(0), {"host": "127.0.0.1", "port": port})  # explorer 0 came to join; explorer 1 never did
    sender = CollectiveSender(_collective(port=port, timeout_s=timeout_s), board, 2, 1, torch.float32, 30)
    import vllm.distributed.utils  # noqa: F401 - imported before the clock starts (seconds on a loaded machine)

    t0 = time.monotonic()
    side = _joined(_Call(sender.connect, "trainer"), timeout_s + MARGIN_S + 10)
    took = side.ended_at - t0
    print(
        f"group never forms: trainer's connect failed after {took:.2f} s (collective.timeout_s {timeout_s}): {side.error}"
    )
    assert isinstance(side.error, SyncError), repr(side.error)
    msg = str(side.error)
    assert "explorer 1 never came to join it" in msg and "explorer 0" not in msg and "collective.timeout_s = 3" in msg
    assert (
        "waited 3 s for explorer 1 to join the weight-sync group" in msg
    )  # on the board, where a stop request is seen too
    assert took < timeout_s + MARGIN_S


def test_a_stop_request_ends_the_wait_for_a_group_that_cannot_form(tmp_path):
    """An explorer that failed at start-up (say, vLLM refused its config) never joins; its stop
    request must end the trainer's wait at once, not after collective.timeout_s (issue 27)."""
    board, stop = Board.at(str(tmp_path)), threading.Event()
    sender = CollectiveSender(_collective(port=free_port(), timeout_s=120), board, 1, 1, torch.float32, 30)
    side = _Call(lambda: sender.connect(stop), "trainer")
    time.sleep(0.5)
    t0 = time.monotonic()
    stop.set()
    _joined(side, MARGIN_S)
    assert isinstance(side.error, Stopped) and "explorer 0 to join the weight-sync group" in str(side.error)
    print(f"stop request seen after {side.ended_at - t0:.2f} s")
    with socket.socket() as s:  # the group's port is free again
        s.bind(("127.0.0.1", board.get(ADDRESS_KEY)["port"]))


# ---------------------------------------------------------------- broken broadcasts


@pytest.mark.slow
def test_explorer_process_killed_mid_broadcast_fails_send_naming_it(tmp_path, tiny_model_dir):
    """An explorer process SIGKILLed while receiving says nothing: the trainer names it as the silent one."""
    board, c = Board.at(str(tmp_path)), _collective()
    sender = CollectiveSender(c, board, 1, 1, torch.float32, 30)
    p, death = _peer("explorer", str(tmp_path), c, tiny_model_dir, kill_at=2)
    try:
        sender.connect()
        sender.prepare(1)
        trainer = _joined(
            _Call(lambda: sender.send(_slowly(named_weights(load_hf(tiny_model_dir))), 1), "trainer"),
            BROKEN_BOUND_S + 10,
        )
        took = trainer.ended_at - death["died"]
        print(
            f"explorer process killed mid-broadcast: trainer's send failed {took:.2f} s after the death: {trainer.error}"
        )
        assert isinstance(trainer.error, SyncError), repr(trainer.error)
        assert "weight sync of version 1 failed: explorer 0 left the broadcast and said nothing" in str(trainer.error)
        assert took < BROKEN_BOUND_S
    finally:
        sender.close()
        _reap(p)


@pytest.fixture(scope="module")
def doomed_engine(tiny_model_dir):
    """A dedicated engine (explorer 0) for the tests that break it; closed at module end."""
    eng = build_rollout_engine(make_config(tiny_model_dir), explorer_id=0)
    try:
        yield eng
    finally:
        eng.close()


@pytest.mark.slow
def test_trainer_killed_mid_broadcast_fails_receiving_explorer_naming_it(tmp_path, tiny_model_dir, doomed_engine):
    board, c = Board.at(str(tmp_path)), _collective()
    receiver = CollectiveReceiver(c, board, 0, 1, 1, 30)
    p, death = _peer("trainer", str(tmp_path), c, tiny_model_dir, kill_at=6)
    try:
        receiver.connect(doomed_engine)
        receiver.prepare(1)
        explorer = _joined(_Call(lambda: receiver.receive(doomed_engine, 1), "explorer-0"), GROUP_TIMEOUT_S)
        took = explorer.ended_at - death["died"]
        print(f"trainer killed mid-broadcast: explorer's receive failed {took:.2f} s after the death: {explorer.error}")
        assert isinstance(explorer.error, SyncError), repr(explorer.error)
        msg = str(explorer.error)
        assert (
            "explorer 0: the weight-sync broadcast of version 1 broke off and the trainer" in msg
            and "the trainer is gone" in msg
        )
        assert took < BROKEN_BOUND_S
        assert doomed_engine.version == 0  # nothing acknowledged as loaded
    finally:
        _reap(p)


@pytest.mark.slow
def test_explorer_worker_killed_mid_broadcast_fails_send_naming_it(tmp_path, tiny_model_dir, doomed_engine):
    """Last in the module: it kills the dedicated engine's worker."""
    board, c = Board.at(str(tmp_path)), _collective()
    sender, receiver = CollectiveSender(c, board, 1, 1, torch.float32, 30), CollectiveReceiver(c, board, 0, 1, 1, 30)
    connecting = _Call(lambda: receiver.connect(doomed_engine), "explorer-0-connect")
    sender.connect()
    assert _joined(connecting, GROUP_TIMEOUT_S).error is None
    procs = doomed_engine._procs
    victim = procs.workers[0][0].pid if procs.workers else procs.cores[0].pid
    killed: dict[str, float] = {}

    def kill() -> None:
        os.kill(victim, signal.SIGKILL)
        killed["at"] = time.monotonic()

    weights = _slowly(named_weights(load_hf(tiny_model_dir)), kill, kill_at=4)

    try:
        explorer = _Call(lambda: (receiver.prepare(1), receiver.receive(doomed_engine, 1)), "explorer-0")
        trainer = _Call(lambda: (sender.prepare(1), sender.send(weights, 1)), "trainer")
        _joined(trainer, BROKEN_BOUND_S + 15)
        _joined(explorer, BROKEN_BOUND_S + 15)
        t_trainer, t_explorer = trainer.ended_at - killed["at"], explorer.ended_at - killed["at"]
        print(
            f"worker pid {victim} killed mid-broadcast: trainer failed after {t_trainer:.2f} s, explorer after {t_explorer:.2f} s\n  {trainer.error}"
        )
        assert isinstance(explorer.error, EngineDiedError) and "explorer 0 died" in str(explorer.error), repr(
            explorer.error
        )
        assert isinstance(trainer.error, SyncError), repr(trainer.error)
        msg = str(trainer.error)
        assert "weight sync of version 1 failed: explorer 0 left the broadcast" in msg and f"pid {victim}" in msg
        assert t_trainer < BROKEN_BOUND_S and t_explorer < BROKEN_BOUND_S
    finally:
        sender.close()


# ---------------------------------------------------------------- damaged checkpoint versions


@pytest.fixture
def restore_original(engine, tiny_model_dir, tmp_path):
    """Put the shared engine back to the original weights as version 0 after the test."""
    yield
    d = str(tmp_path / "restore")
    CheckpointSender(*open_storage(d, None), tiny_model_dir, torch.float32, Board.at(d), 1, 30).send(
        named_weights(load_hf(tiny_model_dir)), version=0
    )
    assert CheckpointReceiver(*open_storage(d, None), Board.at(d)).receive(engine, version=0) == 0


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_deleted_or_corrupted_checkpoint_is_refused_and_weights_kept(
    engine, tiny_model_dir, tmp_path, restore_original
):
    run = tmp_path / "run"
    board = Board.at(str(run))
    sender = CheckpointSender(
        *open_storage(str(run), None), tiny_model_dir, torch.float32, board, 1, 30, shard_bytes=200_000
    )
    receiver = CheckpointReceiver(*open_storage(str(run), None), board)
    trained = perturbed_hf(tiny_model_dir, seed=11)
    sender.send(named_weights(trained), version=1)
    assert receiver.receive(engine, version=1) == 1
    assert max_logprob_diff(trained, rollouts(engine), 1.0) < LOGPROB_TOL
    for v in (2, 3, 4, 5):
        sender.send(named_weights(perturbed_hf(tiny_model_dir, seed=11 + v)), version=v)
    ckpt = run / "checkpoints"
    shards = sorted(p.name for p in (ckpt / "version=2").glob("*.safetensors"))
    assert len(shards) > 1  # sharded: a half-load would be possible without the checks

    import shutil

    shutil.rmtree(ckpt / "version=2")  # the whole version deleted after its commit
    (ckpt / "version=3" / shards[-1]).unlink()  # one shard of it deleted
    with open(ckpt / "version=4" / shards[-1], "r+b") as f:  # truncated
        f.truncate(f.seek(0, 2) - 100)
    size = (ckpt / "version=5" / shards[-1]).stat().st_size
    _flip(ckpt / "version=5" / shards[-1], size - 50)  # one byte of tensor data flipped: still a valid safetensors file
    cases = {
        2: "checkpoint version 2 refused: it does not exist under",
        3: f"checkpoint version 3 refused: {ckpt}/version=3/{shards[-1]} is missing",
        4: f"checkpoint version 4 refused: {ckpt}/version=4/{shards[-1]} has {size - 100} bytes where its commit marker says {size}",
        5: f"checkpoint version 5 refused: {ckpt}/version=5/{shards[-1]} does not match the CRC-32 in its commit marker",
    }
    for v, want in cases.items():
        with pytest.raises(SyncError) as err:
            receiver.receive(engine, version=v)
        msg = str(err.value)
        print(msg)
        assert want in msg and "engine keeps version 1" in msg and "--resume" in msg, msg
    with pytest.raises(SyncError, match="version 5 refused"):
        receiver.receive(engine)  # the newest committed version is the flipped one
    # Nothing was loaded: the engine still samples exactly with version 1's weights.
    assert engine.version == 1
    after = rollouts(engine)
    assert all(r.version == 1 for g in after for r in g)
    assert max_logprob_diff(trained, after, 1.0) < LOGPROB_TOL
    assert (ckpt / "version=5" / COMMIT).exists()  # refusing changes nothing on storage

    # A version committed before CRC-32 (its marker carries SHA-256) is checked against that.
    import hashlib
    import json

    for v in (6, 7):
        sender.send(named_weights(perturbed_hf(tiny_model_dir, seed=11 + v)), version=v)
        marker = json.loads((ckpt / f"version={v}" / COMMIT).read_text())
        marker["files"] = {
            f: {"bytes": m["bytes"], "sha256": hashlib.sha256((ckpt / f"version={v}" / f).read_bytes()).hexdigest()}
            for f, m in marker["files"].items()
        }
        (ckpt / f"version={v}" / COMMIT).write_text(json.dumps(marker))
    _flip(ckpt / "version=6" / shards[-1], size - 50)
    with pytest.raises(SyncError, match=f"{shards[-1]} does not match the SHA-256 in its commit marker"):
        receiver.receive(engine, version=6)
    assert receiver.receive(engine, version=7) == 7 == engine.version
