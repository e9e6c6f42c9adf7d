"""Collective weight sync: trainer rank 0 broadcasts parameters to the inference workers of explorers.

One extra process group (gloo on CPU, NCCL on GPU) holds trainer rank 0 (rank 0) and the
inference workers of every explorer: worker w of explorer x is rank 1 + x * W + w, with W the
workers per engine (tensor_parallel_size). The trainer and each explorer run in their own
thread (or process, or machine); both sides `connect()` concurrently, then each sync is one
`send` on the trainer side meeting one `receive` per explorer. Wire format: `buckets.py`.

The run's board carries the rest of the protocol (its keys are defined here and nowhere else):
- `sync-address`: the trainer picks the group's port (collective.port, or a free one) and posts
  host and port; receivers wait for it before joining, so runs sharing a host never collide.
- A broadcast needs every rank, so joining it is a handshake: each explorer posts
  `explorer-<i>-joining` {version} and waits for the trainer's `sync` {go: v} (all joined) or
  {abandon: v} (the trainer is stopping); only after "go" does anyone enter the broadcast.
  Nobody is ever left blocked in it. Closing the sender abandons every later version.

    # trainer thread                                     # explorer thread x
    s = build_weight_sender(cfg, board); s.connect()     r = build_weight_receiver(cfg, board, x); r.connect(engine)
    s.prepare(t); s.send(trainer.named_weights(), t)     r.prepare(t); v = r.receive(engine, t)   # -> t
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.config import CollectiveConfig
from rl_engine.control import Board, Stopped, StopSignal
from rl_engine.sync.base import post_loaded, wait_loaded
from rl_engine.sync.buckets import broadcast_send, destroy_group, group_device, init_group, raw_broadcast, resolve_backend


ADDRESS_KEY = "sync-address"
GO_KEY = "sync"
_NO_MORE = 1 << 62  # "abandon" this: the trainer sends nothing more


def joining_key(explorer_id: int) -> str:
    return f"explorer-{explorer_id}-joining"


def listen(host: str, port: int | None) -> socket.socket:
    """The socket the group's store will serve on, bound and listening: on `port`, or on a free
    one the OS picks (no window in which another process could take it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port or 0))
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"weight-sync group: cannot listen on {host}:{port} ({e.strerror}); another run may hold it: "
            "set synchronizer.collective.port to null to let the trainer pick a free port"
        ) from e
    sock.listen()
    return sock


@dataclass
class SyncStats:
    """What the last send moved and how long it took (from the sender's side)."""

    version: int
    params: int
    bytes: int
    seconds: float


class CollectiveSender:
    """Trainer side: rank 0 of the weight-sync group."""

    method = "collective"

    def __init__(self, c: CollectiveConfig, board: Board, num_explorers: int, workers_per_engine: int, wire_dtype: torch.dtype | None, wait_timeout_s: float):
        self.c, self.board = c, board
        self.backend = resolve_backend(c.backend)
        self.num_explorers = num_explorers
        self.world_size = 1 + num_explorers * workers_per_engine
        self.wire_dtype = wire_dtype
        self.bucket_bytes = max(1, int(c.bucket_mb * (1 << 20)))
        self.wait_timeout_s = wait_timeout_s
        self._pg: Any = None
        self.last: SyncStats | None = None

    def connect(self, stop: StopSignal | None = None) -> None:
        """Publish the group's address, host the group and wait until every explorer's workers
        joined (up to collective.timeout_s)."""
        if self._pg is None:
            sock = listen(self.c.host, self.c.port)
            port = sock.getsockname()[1]
            self.board.post(ADDRESS_KEY, {"host": self.c.host, "port": port})
            self._pg = init_group(self.c.host, port, 0, self.world_size, self.backend, self.c.timeout_s, listen_socket=sock)

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Wait until every explorer posted that it joins the broadcast of `version`, then say go."""
        try:
            for i in range(self.num_explorers):
                what = f"explorer {i} to join the broadcast of version {version}"
                self.board.wait(joining_key(i), lambda m: m["version"] >= version, what=what, timeout_s=self.wait_timeout_s, stop=stop)
        except BaseException:
            self.board.post(GO_KEY, {"abandon": version})
            raise
        self.board.post(GO_KEY, {"go": version})

    def wait_loaded(self, version: int, stop: StopSignal | None = None) -> None:
        wait_loaded(self.board, self.num_explorers, version, self.wait_timeout_s, stop)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast (HF name, full tensor) pairs as `version`; returns once every receiver has the bytes."""
        if self._pg is None:
            raise RuntimeError("CollectiveSender.send before connect(): call connect() first (it waits for the explorers)")
        t0 = time.perf_counter()
        n, nbytes = broadcast_send(self._pg, named_tensors, version, self.bucket_bytes, self.wire_dtype, group_device(self.backend))
        self.last = SyncStats(version, n, nbytes, time.perf_counter() - t0)
        if n == 0:
            raise ValueError(f"weight sync of version {version}: the trainer gave no parameters")

    def send_raw(self, sizes: list[int]) -> None:
        """Benchmark floor: plain broadcasts of these byte sizes on the same group, from reused buffers."""
        if getattr(self, "_raw_sizes", None) != sizes:
            self._raw_sizes, self._raw_bufs = list(sizes), [torch.zeros(n, dtype=torch.uint8, device=group_device(self.backend)) for n in sizes]
        raw_broadcast(self._pg, self._raw_bufs)

    def close(self) -> None:
        self.board.post(GO_KEY, {"abandon": _NO_MORE})  # explorers waiting to join are released
        if self._pg is not None:
            pg, self._pg = self._pg, None
            destroy_group(pg)


class CollectiveReceiver:
    """Explorer side: puts this explorer's inference workers into the group and loads what arrives."""

    method = "collective"

    def __init__(self, c: CollectiveConfig, board: Board, explorer_id: int, num_explorers: int, workers_per_engine: int, wait_timeout_s: float):
        if not 0 <= explorer_id < num_explorers:
            raise ValueError(f"explorer_id {explorer_id} outside 0..{num_explorers - 1} (explorer.count = {num_explorers})")
        self.c, self.board = c, board
        self.wait_timeout_s = wait_timeout_s
        self.backend = resolve_backend(c.backend)
        self.explorer_id = explorer_id
        self.workers = workers_per_engine
        self.rank_offset = 1 + explorer_id * workers_per_engine
        self.world_size = 1 + num_explorers * workers_per_engine
        self._engine: Any = None

    def connect(self, engine: Any, stop: StopSignal | None = None) -> None:
        """Wait for the trainer's group address, join from every worker of `engine`; blocks until the whole group formed."""
        what = "the trainer to publish the weight-sync address (is the trainer role running?)"
        addr = self.board.wait(ADDRESS_KEY, lambda m: True, what=what, timeout_s=self.c.timeout_s, stop=stop)
        ranks = engine.rpc("rft_join_group", addr["host"], addr["port"], self.rank_offset, self.world_size, self.backend, self.c.timeout_s, timeout=self.c.timeout_s + 10)
        expected = list(range(self.rank_offset, self.rank_offset + self.workers))
        if sorted(ranks) != expected:
            raise RuntimeError(f"explorer {self.explorer_id}: workers joined as ranks {ranks}, expected {expected} (tensor_parallel_size mismatch?)")
        self._engine = engine

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Post that this explorer joins the broadcast of `version`; wait for the trainer's go."""
        self.board.post(joining_key(self.explorer_id), {"version": version})
        what = f"the trainer to start broadcasting version {version}"
        m = self.board.wait(GO_KEY, lambda m: max(m.get("go", -1), m.get("abandon", -1)) >= version, what=what, timeout_s=self.wait_timeout_s, stop=stop)
        if m.get("go", -1) < version:
            raise Stopped(f"the trainer abandoned the broadcast of version {version}")

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Block until the trainer's next `send` is loaded into `engine`; returns the installed version."""
        if self._engine is not engine:
            raise RuntimeError(f"explorer {self.explorer_id}: receive() on an engine that did not connect(); call connect(engine) first")
        results = engine.rpc("rft_receive_broadcast", timeout=self.c.timeout_s)
        versions = {v for v, _ in results}
        if len(versions) != 1:
            raise RuntimeError(f"explorer {self.explorer_id}: workers installed different versions {sorted(versions)}")
        got = versions.pop()
        if any(n == 0 for _, n in results):
            raise RuntimeError(f"explorer {self.explorer_id}: version {got} arrived with no parameters; weights unchanged")
        if version is not None and got != version:
            raise RuntimeError(f"explorer {self.explorer_id}: expected version {version} from the trainer, received {got}")
        engine.mark_synced(got)
        post_loaded(self.board, self.explorer_id, got)
        return got

    def receive_raw(self, engine: Any, sizes: list[int]) -> None:
        """Benchmark baseline: receive plain broadcasts of these byte sizes, load nothing."""
        engine.rpc("rft_raw_receive", sizes, timeout=self.c.timeout_s)

    def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.rpc("rft_leave_group", timeout=30)
