"""Bucketed broadcast wire format over a real gloo group, ranks as threads (no vLLM engine; seconds).

.venv/bin/python -m pytest tests/rl_engine/sync/test_buckets.py -q
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.board import Board
from rl_engine.config import CollectiveConfig
from rl_engine.sync.base import SyncError
from rl_engine.sync.buckets import ALIGN, broadcast_recv, destroy_group, group_device, init_group, pack_buckets
from rl_engine.sync.collective import CollectiveSender, group_key
from rl_engine.trainer.dist import free_port
from tests.rl_engine.sync.helpers import run_concurrently


def _params() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("a.bias", torch.randn(5, generator=g)),
        ("big.weight", torch.randn(64, 64, generator=g)),  # 16 KiB > bucket: sent alone
        ("steps", torch.arange(7, dtype=torch.int64)),  # not floating: keeps its dtype
        ("b.weight", torch.randn(4, 4, generator=g).t()),  # non-contiguous
    ]


def test_pack_buckets_groups_and_sends_large_parameters_without_copy():
    params = _params()
    buckets = list(pack_buckets(params, bucket_bytes=4096, wire_dtype=torch.float32, device=torch.device("cpu")))
    assert [[p[0] for p in b.params] for b in buckets] == [
        ["a.weight", "a.bias"],
        ["big.weight"],
        ["steps", "b.weight"],
    ]
    assert [len(b.segs) for b in buckets] == [1, 1, 1]  # small ones packed into one segment
    assert buckets[1].segs[0].data_ptr() == params[2][1].data_ptr()  # the large one goes from its own memory
    for b in buckets:
        assert all(off % ALIGN == 0 for *_, off, _ in b.params)


def _joining(tmp_path, port: int, explorers: int) -> Board:
    """A board on which `explorers` receivers said they join the group on `port` (as CollectiveReceiver.connect does)."""
    board = Board.at(str(tmp_path))
    for i in range(explorers):
        board.post(group_key(i), {"host": "127.0.0.1", "port": port})
    return board


def _receiver(port: int, rank: int, world: int) -> tuple[int, dict[str, torch.Tensor], int]:
    pg = init_group("127.0.0.1", port, rank, world, "gloo", 30)
    got: dict[str, torch.Tensor] = {}
    calls = 0

    def load(batch):
        nonlocal calls
        calls += 1
        got.update({k: v.clone() for k, v in batch})

    version, n = broadcast_recv(pg, torch.device("cpu"), load)
    destroy_group(pg)
    assert n == len(got)
    return version, got, calls


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_broadcast_to_two_receivers(wire, tmp_path):
    port, params = free_port(), _params()
    cfg = CollectiveConfig(port=port, bucket_mb=4096 / 2**20, timeout_s=30)
    sender = CollectiveSender(
        cfg, _joining(tmp_path, port, 2), num_explorers=2, workers_per_engine=1, wire_dtype=wire, wait_timeout_s=30
    )

    def trainer():
        sender.connect()
        sender.send(iter(params), version=7)
        sender.close()
        return sender.last

    stats, (v1, got1, calls1), (v2, got2, _) = run_concurrently(
        trainer, lambda: _receiver(port, 1, 3), lambda: _receiver(port, 2, 3)
    )
    assert (v1, v2) == (7, 7)
    assert stats.version == 7 and stats.params == len(params)
    assert calls1 == 3  # one load per bucket
    for got in (got1, got2):
        assert list(got) == [n for n, _ in params]
        for name, t in params:
            want = t.to(wire) if t.is_floating_point() else t
            assert got[name].dtype == want.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], want)


def test_empty_stream_is_an_error_on_both_sides(tmp_path):
    port = free_port()
    sender = CollectiveSender(
        CollectiveConfig(port=port, timeout_s=30), _joining(tmp_path, port, 1), 1, 1, torch.float32, 30
    )

    def trainer():
        sender.connect()
        try:
            with pytest.raises(ValueError, match="no parameters"):
                sender.send(iter([]), version=3)
        finally:
            sender.close()

    _, (version, got, calls) = run_concurrently(trainer, lambda: _receiver(port, 1, 2))
    assert (version, got, calls) == (3, {}, 0)  # the receiver learns version 3 with nothing in it


def test_trainer_picks_and_publishes_a_free_port_or_names_a_taken_one(tmp_path):
    import socket

    from rl_engine.sync.collective import ADDRESS_KEY, listen

    sock = listen("127.0.0.1", None)  # what CollectiveSender.connect does with collective.port null
    try:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(
            RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}.*synchronizer.collective.port to null"
        ):
            listen("127.0.0.1", port)  # a second run asking for the same fixed port
    finally:
        sock.close()
    # The address receivers join: published on the run's board before the trainer waits in the group.
    board = Board.at(str(tmp_path))
    sender = CollectiveSender(CollectiveConfig(port=None, timeout_s=5), board, 1, 1, torch.float32, 5)
    with pytest.raises(SyncError, match="explorer 0"):
        sender.connect()  # nobody joins: the group times out after 5 s
    addr = board.get(ADDRESS_KEY)
    assert addr["host"] == "127.0.0.1" and addr["port"] > 0
    with socket.socket() as s:  # and the port is released again
        s.bind(("127.0.0.1", addr["port"]))


def test_the_group_device_is_the_trainers_not_the_sending_threads():
    """NCCL buckets go on the device the trainer's plan gave it (a decoupled send runs in a thread
    whose current CUDA device is 0); gloo's on the CPU whatever the trainer's device."""
    assert group_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert group_device("gloo", "cuda:1") == group_device("gloo") == torch.device("cpu")
