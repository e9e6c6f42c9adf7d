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
- `explorer-<i>-group` {host, port}: explorer i is joining the group (a trainer whose group did
  not form names the explorers that never came).
- `<role>-sync-error` {version, cause, error}: a side whose broadcast broke says why (`cause`
  `engine`: its own vLLM engine died; `peer`: it lost the connection). A broken broadcast fails
  every side within seconds (the side that notices closes its group, so the others' sockets
  close too), and each side names who broke it from these reports, waiting up to
  SYNC_ERROR_GRACE_S for them: a side that said nothing by then is the one that is gone.

    # trainer thread                                     # explorer thread x
    s = build_weight_sender(cfg, board); s.connect()     r = build_weight_receiver(cfg, board, x); r.connect(engine)
    s.prepare(t); s.send(trainer.named_weights(), t)     r.prepare(t); v = r.receive(engine, t)   # -> t
"""

from __future__ import annotations

import logging
import socket
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.board import Board, Stopped, StopSignal, WaitTimeout
from rl_engine.config import CollectiveConfig
from rl_engine.rollout.engine import EngineDiedError
from rl_engine.sync.base import SyncError, post_loaded, wait_loaded
from rl_engine.sync.buckets import (
    broadcast_send,
    destroy_group,
    group_device,
    join_group,
    raw_broadcast,
    resolve_backend,
)
from rl_engine.sync.shm import SharedRegion

ADDRESS_KEY = "sync-address"
GO_KEY = "sync"
_NO_MORE = 1 << 62  # "abandon" this: the trainer sends nothing more
SYNC_ERROR_GRACE_S = (
    5.0  # after a broadcast broke: how long a side waits for its peers' reports before naming the silent ones
)
log = logging.getLogger(__name__)
_RPC_SLACK_S = 10.0  # the worker's own group timeout (collective.timeout_s) fires first; the RPC wait is the backstop


def joining_key(explorer_id: int) -> str:
    return f"explorer-{explorer_id}-joining"


def group_key(explorer_id: int) -> str:
    return f"explorer-{explorer_id}-group"


def sync_error_key(role: str) -> str:
    return f"{role}-sync-error"


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _reports(board: Board, roles: list[str], version: int | None, wait_s: float) -> dict[str, dict[str, Any]]:
    """The sync-error reports of `roles` about `version`, waiting up to `wait_s` s until all are in."""
    deadline = time.monotonic() + wait_s
    while True:
        got = {
            r: m
            for r in roles
            if (m := board.get(sync_error_key(r))) is not None and m.get("version") in (version, None)
        }
        if len(got) == len(roles) or time.monotonic() >= deadline:
            return got
        board.fs.invalidate_cache()
        time.sleep(board.poll_s)


def _release(pg: Any, error: BaseException) -> None:
    """Destroy a group a collective failed on. gloo keeps a rank's connections open while anything
    references its group (the pending works in the traceback's frames too); once they are closed
    every other rank's blocked send or receive fails at once instead of at collective.timeout_s."""
    traceback.clear_frames(error.__traceback__)
    destroy_group(pg)


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
    kind: str | None = None  # delta checkpoint sync: "full" or "delta" (rl_engine.sync.delta)


class CollectiveSender:
    """Trainer side: rank 0 of the weight-sync group."""

    method = "collective"

    def __init__(
        self,
        c: CollectiveConfig,
        board: Board,
        num_explorers: int,
        workers_per_engine: int,
        wire_dtype: torch.dtype | None,
        wait_timeout_s: float,
        device: str | None = None,
    ):
        self.c, self.board = c, board
        self.device = device  # the trainer's ('cuda:1'); None: the connecting thread's current CUDA device
        self.backend = resolve_backend(c.backend)
        self.num_explorers = num_explorers
        self.world_size = 1 + num_explorers * workers_per_engine
        self.wire_dtype = wire_dtype
        self.bucket_bytes = max(1, int(c.bucket_mb * (1 << 20)))
        self.wait_timeout_s = wait_timeout_s
        self._pg: Any = None
        self._device: torch.device | None = None
        self._region: SharedRegion | None = None  # the group agreed on shared memory (rl_engine.sync.shm)
        self.last: SyncStats | None = None

    @property
    def transport(self) -> str | None:
        """How the formed group moves the bytes: 'shared_memory' or 'stream' (None before connect)."""
        return None if self._pg is None else "shared_memory" if self._region is not None else "stream"

    def connect(self, stop: StopSignal | None = None) -> None:
        """Publish the group's address, wait until every explorer is joining (a stop request ends
        the wait: an explorer that failed at start-up never comes), then host the group until
        their workers joined (up to collective.timeout_s)."""
        if self._pg is None:
            sock = listen(self.c.host, self.c.port)
            port = sock.getsockname()[1]
            region = SharedRegion.create() if self.c.shared_memory and self.backend == "gloo" else None
            self.board.post(ADDRESS_KEY, {"host": self.c.host, "port": port, "shm": region and region.path})
            try:
                self._form(sock, port, region, stop)
            finally:
                if region is not None:
                    region.unlink()  # the members hold it open now; a killed run leaves nothing in /dev/shm
                    if self._region is None:  # no group, or one without it (join_group closed it then)
                        region.close()
            # Fixed here: a decoupled send runs in a thread of its own, whose current CUDA device is 0.
            self._device = group_device(self.backend, self.device)
            log.info(
                "weight-sync group of %d ranks formed on %s:%d (%s); the weights go %s",
                self.world_size,
                self.c.host,
                port,
                self.backend,
                "through shared memory" if self._region is not None else "over the group's stream",
            )

    def _form(self, sock: socket.socket, port: int, region: SharedRegion | None, stop: StopSignal | None) -> None:
        """Wait on the board for every explorer, then host the group and agree on its transport."""
        try:
            # Forming the group blocks in the store and cannot see the board: wait on the board first.
            for i in range(self.num_explorers):
                what = f"explorer {i} to join the weight-sync group on {self.c.host}:{port}"
                self.board.wait(
                    group_key(i), lambda m: m.get("port") == port, what=what, timeout_s=self.c.timeout_s, stop=stop
                )
        except BaseException as e:
            sock.close()
            if isinstance(e, WaitTimeout):
                raise SyncError(self._not_formed(port, e)) from e
            raise
        try:
            self._pg, self._region = join_group(
                self.c.host, port, 0, self.world_size, self.backend, self.c.timeout_s, sock, region
            )
        except Exception as e:
            raise SyncError(self._not_formed(port, e)) from e

    def _not_formed(self, port: int, e: BaseException) -> str:
        came = [
            i
            for i in range(self.num_explorers)
            if (m := self.board.get(group_key(i))) is not None and m.get("port") == port
        ]
        missing = [f"explorer {i}" for i in range(self.num_explorers) if i not in came]
        who = (
            f"{', '.join(missing)} never came to join it (is its role running? see its log)"
            if missing
            else "every explorer came, but not all their workers joined"
        )
        # vLLM's create_tcp_store then closes a socket the store already closed: the EBADF hides the store's timeout.
        shown = e.__context__ if isinstance(e, OSError) and e.__context__ is not None else e
        return f"weight-sync group on {self.c.host}:{port} did not form within synchronizer.collective.timeout_s = {self.c.timeout_s:g} s: {who}. Group error: {_first_line(shown)}"

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Wait until every explorer posted that it joins the broadcast of `version`, then say go."""
        try:
            for i in range(self.num_explorers):
                what = f"explorer {i} to join the broadcast of version {version} (is its role running? see its log)"
                self.board.wait(
                    joining_key(i),
                    lambda m: m["version"] >= version,
                    what=what,
                    timeout_s=self.wait_timeout_s,
                    stop=stop,
                )
        except BaseException:
            self.board.post(GO_KEY, {"abandon": version})
            raise
        self.board.post(GO_KEY, {"go": version})

    def wait_loaded(self, version: int, stop: StopSignal | None = None) -> None:
        wait_loaded(self.board, self.num_explorers, version, self.wait_timeout_s, stop)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast (HF name, full tensor) pairs as `version`; returns once every receiver has the bytes."""
        if self._pg is None:
            raise RuntimeError(
                "CollectiveSender.send before connect(): call connect() first (it waits for the explorers)"
            )
        t0 = time.perf_counter()
        source_error: list[BaseException] = []

        def source() -> Iterable[tuple[str, torch.Tensor]]:
            try:
                yield from named_tensors
            except BaseException as e:
                source_error.append(e)
                raise

        try:
            # self._pg, never a local: a frame of the raised error must not keep the group open.
            n, nbytes = broadcast_send(
                self._pg, source(), version, self.bucket_bytes, self.wire_dtype, self._device, self._region
            )
        except BaseException as e:
            pg, self._pg = self._pg, None
            self._drop_region()
            _release(pg, e)
            del pg
            if e in source_error or not isinstance(e, Exception):
                self._report(
                    version,
                    "trainer",
                    f"the trainer failed while producing the weights of version {version}: {_first_line(e)}",
                )
                raise
            raise SyncError(self._broken(version, e)) from e
        self.last = SyncStats(version, n, nbytes, time.perf_counter() - t0)
        if n == 0:
            raise ValueError(f"weight sync of version {version}: the trainer gave no parameters")

    def _report(self, version: int, cause: str, error: str) -> None:
        self.board.post(sync_error_key("trainer"), {"version": version, "cause": cause, "error": error})

    def _broken(self, version: int, e: BaseException) -> str:
        """Who broke the broadcast of `version`: an explorer whose engine died, else the ones that said nothing."""
        roles = [f"explorer-{i}" for i in range(self.num_explorers)]
        reports = _reports(self.board, roles, version, SYNC_ERROR_GRACE_S)
        died = [r for r in roles if reports.get(r, {}).get("cause") == "engine"]
        silent = [r for r in roles if r not in reports]
        head = f"weight sync of version {version} failed"
        if died:
            msg = f"{head}: {', '.join(r.replace('-', ' ') for r in died)} left the broadcast: " + "; ".join(
                reports[r]["error"] for r in died
            )
        elif silent:
            names = ", ".join(r.replace("-", " ") for r in silent)
            msg = f"{head}: {names} left the broadcast and said nothing within {SYNC_ERROR_GRACE_S:g} s (killed or crashed, or hung; see its log). Group error: {_first_line(e)}"
        else:
            msg = (
                f"{head}: every explorer lost the broadcast too ("
                + "; ".join(reports[r]["error"] for r in roles)
                + f"). Group error: {_first_line(e)}"
            )
        self._report(version, "peer", msg)
        return msg

    def send_raw(self, sizes: list[int]) -> None:
        """Benchmark floor: plain broadcasts of these byte sizes on the same group, from reused buffers."""
        if getattr(self, "_raw_sizes", None) != sizes:
            self._raw_sizes, self._raw_bufs = (
                list(sizes),
                [torch.zeros(n, dtype=torch.uint8, device=self._device) for n in sizes],
            )
        raw_broadcast(self._pg, self._raw_bufs)

    def close(self) -> None:
        self.board.post(GO_KEY, {"abandon": _NO_MORE})  # explorers waiting to join are released
        self._drop_region()
        if self._pg is not None:
            pg, self._pg = self._pg, None
            destroy_group(pg)

    def _drop_region(self) -> None:
        if self._region is not None:
            region, self._region = self._region, None
            region.close()


class CollectiveReceiver:
    """Explorer side: puts this explorer's inference workers into the group and loads what arrives."""

    method = "collective"
    joins_every_version = True

    def __init__(
        self,
        c: CollectiveConfig,
        board: Board,
        explorer_id: int,
        num_explorers: int,
        workers_per_engine: int,
        wait_timeout_s: float,
    ):
        if not 0 <= explorer_id < num_explorers:
            raise ValueError(
                f"explorer_id {explorer_id} outside 0..{num_explorers - 1} (explorer.count = {num_explorers})"
            )
        self.c, self.board = c, board
        self.wait_timeout_s = wait_timeout_s
        self.backend = resolve_backend(c.backend)
        self.explorer_id = explorer_id
        self.workers = workers_per_engine
        self.rank_offset = 1 + explorer_id * workers_per_engine
        self.world_size = 1 + num_explorers * workers_per_engine
        self._engine: Any = None
        self._prepared: int | None = None  # the version of the last prepare(): what receive() expects

    def connect(self, engine: Any, stop: StopSignal | None = None) -> None:
        """Wait for the trainer's group address, join from every worker of `engine`; blocks until the whole group formed."""
        what = "the trainer to publish the weight-sync address (is the trainer role running?)"
        addr = self.board.wait(ADDRESS_KEY, lambda m: True, what=what, timeout_s=self.c.timeout_s, stop=stop)
        self.board.post(group_key(self.explorer_id), {"host": addr["host"], "port": addr["port"]})
        try:
            ranks = engine.rpc(
                "rft_join_group",
                addr["host"],
                addr["port"],
                self.rank_offset,
                self.world_size,
                self.backend,
                self.c.timeout_s,
                addr.get("shm"),
                timeout=self.c.timeout_s + _RPC_SLACK_S,
            )
        except EngineDiedError:
            raise
        except Exception as e:
            raise SyncError(
                f"explorer {self.explorer_id}: the weight-sync group on {addr['host']}:{addr['port']} did not form within "
                f"synchronizer.collective.timeout_s = {self.c.timeout_s:g} s: the trainer (its host, rank 0) or another explorer did not join "
                f"(see their logs). Group error: {_first_line(e)}"
            ) from e
        expected = list(range(self.rank_offset, self.rank_offset + self.workers))
        if sorted(ranks) != expected:
            raise RuntimeError(
                f"explorer {self.explorer_id}: workers joined as ranks {ranks}, expected {expected} (tensor_parallel_size mismatch?)"
            )
        self._engine = engine

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Post that this explorer joins the broadcast of `version`; wait for the trainer's go."""
        self._prepared = version
        self.board.post(joining_key(self.explorer_id), {"version": version})
        what = f"the trainer to start broadcasting version {version}"
        m = self.board.wait(
            GO_KEY,
            lambda m: max(m.get("go", -1), m.get("abandon", -1)) >= version,
            what=what,
            timeout_s=self.wait_timeout_s,
            stop=stop,
        )
        if m.get("go", -1) < version:
            raise Stopped(f"the trainer abandoned the broadcast of version {version}")

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Block until the trainer's next `send` is loaded into `engine`; returns the installed version."""
        if self._engine is not engine:
            raise RuntimeError(
                f"explorer {self.explorer_id}: receive() on an engine that did not connect(); call connect(engine) first"
            )
        expected = version if version is not None else self._prepared
        try:
            results = engine.rpc("rft_receive_broadcast", timeout=self.c.timeout_s + _RPC_SLACK_S)
        except EngineDiedError as e:  # names this explorer already; the trainer learns it from the report
            self._report(expected, "engine", str(e))
            raise
        except Exception as e:
            self._report(expected, "peer", f"explorer {self.explorer_id} lost the broadcast: {_first_line(e)}")
            raise SyncError(self._broken(expected, e)) from e
        versions = {v for v, _ in results}
        if len(versions) != 1:
            raise RuntimeError(f"explorer {self.explorer_id}: workers installed different versions {sorted(versions)}")
        got = versions.pop()
        if any(n == 0 for _, n in results):
            raise RuntimeError(
                f"explorer {self.explorer_id}: version {got} arrived with no parameters; weights unchanged"
            )
        if version is not None and got != version:
            raise RuntimeError(
                f"explorer {self.explorer_id}: expected version {version} from the trainer, received {got}"
            )
        engine.mark_synced(got)
        post_loaded(self.board, self.explorer_id, got)
        return got

    def _report(self, version: int | None, cause: str, error: str) -> None:
        self.board.post(
            sync_error_key(f"explorer-{self.explorer_id}"), {"version": version, "cause": cause, "error": error}
        )

    def _broken(self, version: int | None, e: BaseException) -> str:
        """Why the broadcast of `version` broke, as the trainer reports it; a trainer that says nothing is gone."""
        head = f"explorer {self.explorer_id}: the weight-sync broadcast of version {version} broke off"
        partial = "this engine's weights may be partly updated: do not generate with them before a sync completes"
        trainer = _reports(self.board, ["trainer"], version, SYNC_ERROR_GRACE_S).get("trainer")
        if trainer is not None:
            return f"{head}; the trainer reports: {trainer['error']} ({partial})"
        return (
            f"{head} and the trainer (the sender, group rank 0) said nothing within {SYNC_ERROR_GRACE_S:g} s: "
            f"the trainer is gone (killed or crashed; see its log) or hung. Group error: {_first_line(e)} ({partial})"
        )

    def receive_raw(self, engine: Any, sizes: list[int]) -> None:
        """Benchmark baseline: receive plain broadcasts of these byte sizes, load nothing."""
        engine.rpc("rft_raw_receive", sizes, timeout=self.c.timeout_s)

    def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.rpc("rft_leave_group", timeout=30)
