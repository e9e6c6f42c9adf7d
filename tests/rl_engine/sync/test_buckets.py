"""Bucketed broadcast wire format over a real gloo group, ranks as threads (no vLLM engine; seconds).

.venv/bin/python -m pytest tests/rl_engine/sync/test_buckets.py -q
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from rl_engine.board import Board
from rl_engine.config import CollectiveConfig
from rl_engine.sync import shm
from rl_engine.sync.base import SyncError
from rl_engine.sync.buckets import ALIGN, broadcast_recv, destroy_group, group_device, join_group, pack_buckets
from rl_engine.sync.collective import ADDRESS_KEY, CollectiveSender, group_key
from rl_engine.sync.shm import SharedRegion
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


def _receiver(
    board: Board, port: int, rank: int, world: int, shm: bool = True, syncs: int = 1
) -> tuple[int, dict[str, torch.Tensor], int, bool]:
    """A bare group member (an inference worker without the engine): maps the trainer's shared-memory
    file if `shm`, joins, receives `syncs` streams; (last version, what it got, loads, whether every
    tensor it loaded was a view of the shared file)."""
    addr = board.wait(ADDRESS_KEY, lambda m: m.get("port") == port, what="address", timeout_s=30)
    region = SharedRegion.attach(addr["shm"]) if shm and addr.get("shm") else None
    pg, region = join_group("127.0.0.1", port, rank, world, "gloo", 30, region=region)
    got: dict[str, torch.Tensor] = {}
    calls, shared = 0, True

    def load(batch):
        nonlocal calls, shared
        calls += 1
        shared = shared and region is not None and all(_in_region(region, t) for _, t in batch)
        got.update({k: v.clone() for k, v in batch})

    try:
        for _ in range(syncs):
            version, n = broadcast_recv(pg, torch.device("cpu"), load, region=region)
    finally:
        destroy_group(pg)
    assert n == len(got)
    return version, got, calls, shared and calls > 0


def _in_region(region: SharedRegion, t: torch.Tensor) -> bool:
    base = region.views([0], [1])[0].data_ptr()
    return base <= t.data_ptr() < base + region.size


def _sender(tmp_path, port: int, explorers: int, wire=torch.float32, bucket_bytes=4096, **c) -> CollectiveSender:
    cfg = CollectiveConfig(port=port, bucket_mb=bucket_bytes / 2**20, timeout_s=30, **c)
    return CollectiveSender(
        cfg, _joining(tmp_path, port, explorers), explorers, workers_per_engine=1, wire_dtype=wire, wait_timeout_s=30
    )


def _expect(got: dict[str, torch.Tensor], params: list[tuple[str, torch.Tensor]], wire: torch.dtype) -> None:
    assert list(got) == [n for n, _ in params]
    for name, t in params:
        want = t.to(wire) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], want)


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "stream"])
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_broadcast_to_two_receivers(wire, shm, tmp_path):
    port, params = free_port(), _params()
    sender = _sender(tmp_path, port, 2, wire, shared_memory=shm)

    def trainer():
        sender.connect()
        transport = sender.transport
        sender.send(iter(params), version=7)
        sender.close()
        return sender.last, transport

    (stats, transport), (v1, got1, calls1, shared1), (v2, got2, _, shared2) = run_concurrently(
        trainer, lambda: _receiver(sender.board, port, 1, 3), lambda: _receiver(sender.board, port, 2, 3)
    )
    assert transport == ("shared_memory" if shm else "stream")
    assert (shared1, shared2) == (shm, shm)  # loaded from views of the file, or from received buffers
    assert (v1, v2) == (7, 7)
    assert stats.version == 7 and stats.params == len(params)
    assert calls1 == 3  # one load per bucket
    _expect(got1, params, wire)
    _expect(got2, params, wire)


def test_one_member_without_the_file_makes_the_group_stream(tmp_path):
    """A receiver on another host cannot open the trainer's file: the whole group agrees on the stream."""
    port, params = free_port(), _params()
    sender = _sender(tmp_path, port, 2)

    def trainer():
        sender.connect()
        transport = sender.transport
        sender.send(iter(params), version=1)
        sender.close()
        return transport

    transport, (_, got1, _, shared1), (_, got2, _, shared2) = run_concurrently(
        trainer, lambda: _receiver(sender.board, port, 1, 3), lambda: _receiver(sender.board, port, 2, 3, shm=False)
    )
    assert transport == "stream" and not shared1 and not shared2
    _expect(got1, params, torch.float32)
    _expect(got2, params, torch.float32)


def test_shared_file_is_unlinked_once_the_group_formed_and_reused_by_the_next_version(tmp_path):
    """Nothing is left in /dev/shm by a run (killed or not) once its group formed; version 2's bytes
    replace version 1's in the same file and arrive whole."""
    port, params = free_port(), _params()
    second = [(n, t + 1 if t.is_floating_point() else t * 2) for n, t in params]
    sender = _sender(tmp_path, port, 1)

    def trainer():
        sender.connect()
        path = sender.board.get(ADDRESS_KEY)["shm"]
        assert path.startswith("/dev/shm/") and not os.path.exists(path)
        sender.send(iter(params), version=1)
        sender.send(iter(second), version=2)
        sender.close()

    _, (version, got, calls, shared) = run_concurrently(trainer, lambda: _receiver(sender.board, port, 1, 2, syncs=2))
    assert version == 2 and shared and calls == 6
    _expect(got, second, torch.float32)


def test_buckets_the_shared_file_cannot_hold_are_streamed(tmp_path, monkeypatch):
    """/dev/shm full (a container's 64 MiB default): reserving space for bucket 2 fails, and the
    rest of the version, and later versions, go over the stream whole."""
    port, params = free_port(), _params()
    real, calls = os.posix_fallocate, []

    def fallocate(fd, offset, length):
        calls.append(length)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(shm.os, "posix_fallocate", fallocate)
    monkeypatch.setattr(shm, "_GROW", 4096)  # the file grows per bucket, so the second one needs more
    sender = _sender(tmp_path, port, 1)

    def trainer():
        sender.connect()
        sender.send(iter(params), version=1)
        sender.send(iter(params), version=2)
        sender.close()

    _, (version, got, _, shared) = run_concurrently(trainer, lambda: _receiver(sender.board, port, 1, 2, syncs=2))
    assert version == 2 and not shared and len(calls) == 2  # tried once more, then never again
    _expect(got, params, torch.float32)


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

    _, (version, got, calls, _) = run_concurrently(trainer, lambda: _receiver(sender.board, port, 1, 2))
    assert (version, got, calls) == (3, {}, 0)  # the receiver learns version 3 with nothing in it


def test_trainer_picks_and_publishes_a_free_port_or_names_a_taken_one(tmp_path):
    import socket

    from rl_engine.sync.collective import listen

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
