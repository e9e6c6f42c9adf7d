"""Delta checkpoint sync (rl_engine/sync/delta.py): exact sparse deltas with a full checkpoint every k
versions (the format itself: test_delta_format.py), a chain applied bit for bit, format 1 deltas still read, an unknown format refused, a missing or damaged link falling back to the last full
version (and saying so), retention keeping every base a live chain needs, a publisher killed mid-chain.

The fast tests install into a stand-in engine that keeps what it loads (`Loaded`); the slow one
syncs a live vLLM engine and compares its logprobs with the trainer's model.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/rl_engine/sync/test_delta.py -x -q
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rl_engine.board import Board
from rl_engine.storage import open_storage
from rl_engine.sync import build_weight_receiver, build_weight_sender
from rl_engine.sync.base import post_loaded
from rl_engine.sync.checkpoint import COMMIT, CheckpointReceiver, CheckpointSender
from rl_engine.sync.delta import DELTA_FILE, DELTA_FILE_V1, DeltaCheckpointReceiver, DeltaCheckpointSender, with_bases
from tests.rl_engine.rollout.engines import load_hf, make_config, max_logprob_diff
from tests.rl_engine.sync.helpers import named_weights, rollouts

REPO = Path(__file__).resolve().parents[3]
LOGPROB_TOL = 1e-5


class Loaded:
    """A stand-in rollout engine: keeps the tensors of every checkpoint directory it is asked to load."""

    def __init__(self) -> None:
        self.version, self.weights, self.loads = 0, {}, 0

    def rpc(self, method: str, local_dir: str, version: int, timeout: float | None = None):
        assert method == "rft_load_checkpoint"
        self.weights = {
            k: v
            for f in sorted(os.listdir(local_dir))
            if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(local_dir, f)).items()
        }
        self.loads += 1
        return [(version, len(self.weights))]

    def mark_synced(self, version: int) -> None:
        self.version = version


def trainer_versions(
    n: int, seed: int = 0, start: dict[str, torch.Tensor] | None = None
) -> list[dict[str, torch.Tensor]]:
    """Versions 0..n-1 of a small 'model': each step changes a random 5% of the elements of most
    tensors (sparse path), every element of `dense` (dense path) and nothing of `frozen`."""
    g = torch.Generator().manual_seed(seed)
    w = start or {
        "embed": torch.randn(50, 16, generator=g),
        "layer.weight": torch.randn(16, 16, generator=g),
        "dense": torch.randn(8, generator=g),
        "frozen": torch.randn(4, generator=g),
        "count": torch.arange(3),
    }
    out = [{k: t.clone() for k, t in w.items()}]
    for _ in range(n - 1):
        w = {k: t.clone() for k, t in w.items()}
        for k in ("embed", "layer.weight"):
            hit = torch.rand(w[k].shape, generator=g) < 0.05
            w[k][hit] += 1e-3 * torch.randn(int(hit.sum()), generator=g)
        w["dense"] += 1e-3
        out.append(w)
    return out


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bits (NaN and -0.0 included)."""
    same = lambda x, y: (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    )  # noqa: E731
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def sides(
    run: Path, model_dir: str, full_every: int = 10, keep_last: int | None = None, dtype: torch.dtype = torch.float32
):
    board = Board.at(str(run))
    sender = DeltaCheckpointSender(
        CheckpointSender(*open_storage(str(run), None), model_dir, dtype, board, 1, 30, keep_last=keep_last), full_every
    )
    return sender, board


def receiver(run: Path, board: Board) -> DeltaCheckpointReceiver:
    return DeltaCheckpointReceiver(CheckpointReceiver(*open_storage(str(run), None), board, 0, timeout_s=30))


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if (p / COMMIT).exists())


# ---------------------------------------------------------------- chains


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltas_v1_to_v5_give_the_trainers_v5_bit_for_bit(tiny_model_dir, tmp_path, dtype):
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir, full_every=10, dtype=dtype)
    follower, late = receiver(run, board), receiver(run, board)
    eng, eng_late = Loaded(), Loaded()
    versions = trainer_versions(6)
    for v, w in enumerate(versions):
        sender.send(w.items(), v)
        assert sender.last.kind == ("full" if v == 0 else "delta")
        assert follower.receive(eng, v) == v == eng.version
        assert (
            follower.last_route["start"] == ("full" if v == 0 else "held") and follower.last_route["fallback"] is None
        )
    assert listing(run) == ["delta=1", "delta=2", "delta=3", "delta=4", "delta=5", "version=0"]
    want = {k: t.to(dtype) if t.is_floating_point() else t for k, t in versions[5].items()}
    assert bits_equal(eng.weights, want) and bits_equal(follower.held, want)
    # An explorer that holds nothing: full version 0 + deltas 1..5.
    assert late.receive(eng_late) == 5
    assert late.last_route == {"version": 5, "start": "full", "base": 0, "deltas": [1, 2, 3, 4, 5], "fallback": None}
    assert bits_equal(eng_late.weights, want)
    full = (run / "checkpoints" / "version=0" / "model.safetensors").stat().st_size
    for v in range(1, 6):
        assert (
            run / "checkpoints" / f"delta={v}" / DELTA_FILE
        ).stat().st_size < 0.3 * full  # 5% of two tensors changed


def test_a_chain_through_object_storage(tiny_model_dir):
    """Off one machine (here memory://): every link is copied next to the explorer and checked there."""
    url = f"memory://delta-{os.getpid()}/run"
    board = Board.at(url)
    sender = DeltaCheckpointSender(
        CheckpointSender(*open_storage(url, None), tiny_model_dir, torch.float32, board, 1, 30), full_every=10
    )
    r, eng = DeltaCheckpointReceiver(CheckpointReceiver(*open_storage(url, None), board, 0, timeout_s=30)), Loaded()
    versions = trainer_versions(4)
    for v, w in enumerate(versions):
        sender.send(w.items(), v)
    assert r.receive(eng, 3) == 3 and r.last_route["deltas"] == [1, 2, 3] and bits_equal(eng.weights, versions[3])


def test_a_full_checkpoint_every_k_versions(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir, full_every=3)
    r, eng = receiver(run, board), Loaded()
    for v, w in enumerate(trainer_versions(7)):
        sender.send(w.items(), 2 * v)  # versions need not be consecutive (sync_interval 2)
    assert listing(run) == ["delta=10", "delta=2", "delta=4", "delta=8", "version=0", "version=12", "version=6"]
    assert r.receive(eng, 10) == 10 and r.last_route["base"] == 6 and r.last_route["deltas"] == [8, 10]
    assert r.committed_versions() == [0, 2, 4, 6, 8, 10, 12] and r.latest_committed() == 12


def test_a_step_that_moves_every_element_is_published_in_full(tiny_model_dir, tmp_path):
    """float32 after an Adam step: a delta would be as large as the checkpoint, so the version goes out full (a new chain)."""
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir)
    r, eng = receiver(run, board), Loaded()
    w = trainer_versions(2)
    everything = {k: t + 1e-3 if t.is_floating_point() else t for k, t in w[1].items()}
    after = {k: t.clone() for k, t in everything.items()}
    after["embed"][0, 0] = 0.0
    for v, x in enumerate((w[0], w[1], everything, after)):
        sender.send(x.items(), v)
        assert r.receive(eng, v) == v and bits_equal(eng.weights, x)
    assert listing(run) == ["delta=1", "delta=3", "version=0", "version=2"]
    assert r.last_route == {"version": 3, "start": "held", "base": 2, "deltas": [3], "fallback": None}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_missing_or_damaged_delta_falls_back_to_the_last_full_version_and_says_so(tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rl_engine.sync.delta")
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir, full_every=6)
    versions = trainer_versions(7)
    for v, w in enumerate(versions[:6]):
        sender.send(w.items(), v)
    ckpt = run / "checkpoints"
    whole = (ckpt / "delta=3" / DELTA_FILE).read_bytes()
    _flip(ckpt / "delta=3" / DELTA_FILE)  # its (compressed) bytes changed after the commit: the CRC-32 covers them
    late, eng = receiver(run, board), Loaded()
    assert late.receive(eng, 5) == 2 == eng.version  # full 0 + the intact deltas 1, 2
    assert bits_equal(eng.weights, versions[2])
    assert (
        late.last_route["fallback"].startswith("delta version 3: ")
        and "does not match the CRC-32" in late.last_route["fallback"]
    )
    said = caplog.text
    assert (
        "version 5 not reachable (delta version 3" in said
        and "fell back to the last full version 0: holds version 2" in said
    )
    assert "deltas [1, 2]" in said

    # An explorer that holds version 4 and finds delta 5 gone keeps version 4 (nothing to load).
    follower, eng4 = receiver(run, board), Loaded()
    (ckpt / "delta=3" / DELTA_FILE).write_bytes(whole)  # repaired
    assert follower.receive(eng4, 4) == 4 and follower.last_route["deltas"] == [1, 2, 3, 4]
    shutil.rmtree(ckpt / "delta=5")
    loads = eng4.loads
    assert follower.receive(eng4, 5) == 4 and eng4.loads == loads
    assert "neither a full checkpoint nor a delta of version 5 is committed" in follower.last_route["fallback"]
    # A committed delta whose file is gone, on the way from the full version.
    (ckpt / "delta=2" / DELTA_FILE).unlink()
    assert receiver(run, board).receive(Loaded(), 4) == 1
    # The trainer publishes on: the next full version (full_every 6) heals the chain.
    sender.send(versions[6].items(), 6)
    assert sender.last.kind == "full"
    assert follower.receive(eng4, 6) == 6 and bits_equal(eng4.weights, versions[6])


def test_a_format_1_delta_is_still_read_and_an_unknown_format_falls_back(tiny_model_dir, tmp_path):
    """Format 1 (before compression): delta.safetensors holding `::val` entries, no `format` in the
    marker. A format this rl_engine does not know is a broken link: the explorer falls back and says why."""
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir)
    versions = trainer_versions(3)
    for v, w in enumerate(versions):
        sender.send(w.items(), v)
    d1, d2 = run / "checkpoints" / "delta=1", run / "checkpoints" / "delta=2"
    old = {"embed::idx": torch.nonzero((versions[1]["embed"] != versions[0]["embed"]).reshape(-1)).reshape(-1).int()}
    old["embed::val"] = versions[1]["embed"].reshape(-1)[old["embed::idx"].long()]
    old["dense::all"] = versions[1]["dense"]
    old["layer.weight::mask"] = torch.from_numpy(
        np.packbits((versions[1]["layer.weight"] != versions[0]["layer.weight"]).reshape(-1).numpy())
    )
    old["layer.weight::val"] = versions[1]["layer.weight"][versions[1]["layer.weight"] != versions[0]["layer.weight"]]
    save_file(old, d1 / DELTA_FILE_V1)
    (d1 / DELTA_FILE).unlink()
    marker = json.loads((d1 / COMMIT).read_text())
    del marker["format"]
    marker["files"] = {
        DELTA_FILE_V1: {
            "bytes": (d1 / DELTA_FILE_V1).stat().st_size,
            "crc32": zlib.crc32((d1 / DELTA_FILE_V1).read_bytes()),
        }
    }
    (d1 / COMMIT).write_text(json.dumps(marker))
    r, eng = receiver(run, board), Loaded()
    assert r.receive(eng, 1) == 1 and r.last_route["deltas"] == [1] and bits_equal(eng.weights, versions[1])
    marker = json.loads((d2 / COMMIT).read_text())
    (d2 / COMMIT).write_text(json.dumps({**marker, "format": 99}))
    late = receiver(run, board)
    assert late.receive(Loaded(), 2) == 1  # full 0 + the format 1 delta
    assert (
        late.last_route["fallback"]
        == "delta version 2: its format 99 is unknown to this rl_engine, which reads formats 1 and 2 (written by a newer trainer?)"
    )


def test_no_intact_full_version_is_refused_naming_the_link(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir)
    for v, w in enumerate(trainer_versions(3)):
        sender.send(w.items(), v)
    _flip(run / "checkpoints" / "version=0" / "model.safetensors")
    eng = Loaded()
    with pytest.raises(
        Exception,
        match=r"checkpoint version 2 refused: full version 0: .*does not match the CRC-32.*no intact full checkpoint <= 2",
    ) as e:
        receiver(run, board).receive(eng, 2)
    assert "keeps version 0" in str(e.value) and eng.loads == 0


# ---------------------------------------------------------------- retention


def test_with_bases_walks_back_to_the_full_version():
    bases = {1: 0, 2: 1, 3: 2, 5: 4, 6: 5}
    assert with_bases({6}, {0, 4}, set(bases), bases.get) == {4, 5, 6}
    assert with_bases({3, 4}, {0, 4}, set(bases), bases.get) == {0, 1, 2, 3, 4}
    assert with_bases({2}, {0, 4}, {2}, lambda v: None) == {2}  # an unreadable base ends the walk


def test_retention_never_deletes_a_base_a_live_chain_needs(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    sender, board = sides(run, tiny_model_dir, full_every=4, keep_last=1)
    versions = trainer_versions(7)
    post_loaded(board, 0, 1)  # a slow explorer holds version 1: it may load any newer version
    for v, w in enumerate(versions[:6]):
        sender.send(w.items(), v)
    # 2..5 may still be loaded; 2 and 3 need 1 and the full version 0, 5 needs the full version 4.
    assert listing(run) == ["delta=1", "delta=2", "delta=3", "delta=5", "version=0", "version=4"]
    post_loaded(board, 0, 5)
    sender.send(versions[6].items(), 6)  # now only 6 (and 5, which it holds) may be loaded: 6 needs 5 and 4
    assert listing(run) == ["delta=5", "delta=6", "version=4"]
    r, eng = receiver(run, board), Loaded()
    assert r.receive(eng, 6) == 6 and bits_equal(eng.weights, versions[6])


# ---------------------------------------------------------------- a publisher killed mid-chain

_PUBLISHER = r"""
import sys, torch
from rl_engine.board import Board
from rl_engine.sync.checkpoint import CheckpointSender
from rl_engine.sync.delta import DeltaCheckpointSender
from tests.rl_engine.sync.test_delta import trainer_versions
run, model_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
board = Board.at(run)
sender = DeltaCheckpointSender(CheckpointSender(board.fs, board.run_root, model_dir, torch.float32, board, 1, 30, keep_last=None), full_every=10)
for v, w in enumerate(trainer_versions(n)):
    sender.send(w.items(), v)
"""


def test_kill_between_a_delta_and_its_commit_then_resume(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RFT_FAILPOINT": "sync.delta_before_commit@5"}
    p = subprocess.run(
        [sys.executable, "-c", _PUBLISHER, str(run), tiny_model_dir, "7"], cwd=REPO, env=env, timeout=120
    )
    assert p.returncode == -9  # SIGKILLed at the failpoint: delta 5's file written, not its marker
    ckpt = run / "checkpoints"
    assert (ckpt / "delta=5" / DELTA_FILE).exists() and not (ckpt / "delta=5" / COMMIT).exists()
    board = Board.at(str(run))
    r, eng = receiver(run, board), Loaded()
    assert r.latest_committed() == 4 and r.receive(eng) == 4  # the uncommitted delta is never read
    dead = trainer_versions(5)
    assert bits_equal(eng.weights, dead[4])

    # The trainer resumes from its state at step 2 and trains on differently: versions 3.. differ.
    resumed = trainer_versions(4, seed=9, start=dead[2])  # versions 2, 3', 4', 5'
    sender, _ = sides(run, tiny_model_dir, keep_last=2)
    sender.send(resumed[1].items(), 3)  # its first publish: a full version (it holds nothing to diff against)
    assert sender.last.kind == "full" and not (ckpt / "delta=3").exists()
    # The explorers restart with the run. Delta 4 of the dead run is still committed but built on the old version 3: not applied.
    r, eng = receiver(run, board), Loaded()
    assert r.receive(eng, 4) == 3 and "of another chain" in r.last_route["fallback"]
    assert bits_equal(eng.weights, resumed[1])
    for v in (4, 5):
        sender.send(resumed[v - 2].items(), v)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "delta=4",
        "delta=5",
        "version=3",
    ]  # the dead chain pruned (keep_last 2 + base)
    assert r.receive(eng, 5) == 5 and r.last_route["start"] == "held" and bits_equal(eng.weights, resumed[3])
    fresh = receiver(run, board)
    assert fresh.receive(Loaded(), 5) == 5 and fresh.last_route["deltas"] == [4, 5]


# ---------------------------------------------------------------- a live vLLM engine


@pytest.fixture
def restore_original(engine, tiny_model_dir, tmp_path):
    """Put the shared engine back to the original weights as version 0 after the test."""
    yield
    cfg = make_config(
        tiny_model_dir,
        name="restore",
        buffer={"storage": {"url": str(tmp_path / "restore")}},
        synchronizer={"sync_method": "checkpoint"},
    )
    build_weight_sender(cfg, Board.at(cfg.run_url)).send(named_weights(load_hf(tiny_model_dir)), version=0)
    assert build_weight_receiver(cfg, Board.at(cfg.run_url)).receive(engine, version=0) == 0


@pytest.mark.slow
def test_vllm_logprobs_match_after_delta_syncs(engine, tiny_model_dir, tmp_path, restore_original):
    cfg = make_config(
        tiny_model_dir,
        name="run",
        buffer={"storage": {"url": str(tmp_path)}},
        synchronizer={"sync_method": "checkpoint", "delta": {"enabled": True, "full_every": 10}},
    )
    board = Board.at(cfg.run_url)
    sender, r = build_weight_sender(cfg, board), build_weight_receiver(cfg, board)
    assert isinstance(sender, DeltaCheckpointSender) and isinstance(r, DeltaCheckpointReceiver)
    hf = load_hf(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    sender.send(named_weights(hf), 0)
    assert r.receive(engine, 0) == 0
    for v in range(1, 6):
        with torch.no_grad():  # a 'trainer step' that moves a tenth of every tensor's elements
            for p in hf.parameters():
                hit = torch.rand(p.shape, generator=g) < 0.1
                p[hit] += 0.05 * torch.randn(int(hit.sum()), generator=g)
        sender.send(named_weights(hf), v)
        assert sender.last.kind == "delta"
        assert r.receive(engine, v) == v == engine.version and r.last_route["start"] == "held"
    d = max_logprob_diff(hf, after := rollouts(engine), 1.0)
    print(f"after deltas 1..5: max |vLLM - trainer v5| logprob {d:.2e}")
    assert d < LOGPROB_TOL and all(x.version == 5 for grp in after for x in grp)
    assert max_logprob_diff(load_hf(tiny_model_dir), after, 1.0) > 1e-2  # the engine really moved
