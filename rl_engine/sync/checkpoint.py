"""Checkpoint weight sync: the trainer publishes committed weight checkpoints; explorers load them live.

Layout under the run's directory (any fsspec storage, see `rl_engine.storage`; the sender and
receiver take its filesystem and path, the board's: `build_weight_sender`):

    checkpoints/version=<v>/model.safetensors            (or model-00001.safetensors ... + model.safetensors.index.json)
    checkpoints/version=<v>/config.json                  the policy's HF config (the directory loads with transformers)
    checkpoints/version=<v>/adapter_model.safetensors    under model.lora, instead: the adapter only,
    checkpoints/version=<v>/adapter_config.json          in peft's layout (loads with PeftModel or vLLM)
    checkpoints/version=<v>/_COMMITTED                   JSON marker, written last and atomically:
                                                         {version, tensors, bytes, time, files: {name: {bytes, crc32}}}

Readers only ever look at versions with a marker, so a trainer that dies mid-write leaves
nothing visible. Before anything is loaded, every weight file the marker lists is checked
against its size and CRC-32 (after the copy, for object storage; markers written before CRC-32
carry SHA-256, which is checked instead; CRC-32 catches the same damage, truncation and
overwritten bytes, at 3x the speed, which the sync pays on both sides): a version deleted or
damaged after its commit is refused with an error naming the version and the file, and the
engine keeps the weights it has (a half-loaded checkpoint would be worse than none).
Explorers load into their live engine (no restart); from object storage the version is first
copied to a local temp directory next to the inference workers.

The sender owns retention of what it writes: after each publish it deletes committed versions
beyond the newest `synchronizer.keep_last_checkpoints` (null: keep all; rules and marker-first
delete: `rl_engine.pruning`), never one an explorer may still load: the version just published,
and every committed one newer than the oldest version an explorer acknowledged loading (its
`loaded` ack on the board, `rl_engine.sync.base`; no ack yet counts as nothing loaded). At a
rendezvous this is exactly the published version (the schedule makes an explorer load the version
the trainer just sent, never an older one; a resumed one loads `resume_catch_up`, which the
trainer sends anew); in the decoupled modes an explorer loads whatever `published` it last read,
never older than what it holds. Nor the version a lineage's latest.json points at (`pinned`).

    # trainer thread                                    # explorer thread
    s = build_weight_sender(cfg, board)                 r = build_weight_receiver(cfg, board, x)
    s.send(trainer.named_weights(), version=t)          if (r.latest_committed() or 0) > engine.version:
                                                            r.receive(engine)      # newest committed
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from rl_engine import storage
from rl_engine.adapter import CONFIG_FILE, WEIGHTS_FILE
from rl_engine.board import Board, StopSignal, WaitTimeout, poll_until
from rl_engine.pruning import Kind, committed, prune
from rl_engine.rollout.engine import EngineDiedError
from rl_engine.sync.base import SyncError, loaded_key, post_loaded, wait_loaded
from rl_engine.sync.collective import SyncStats

COMMIT = "_COMMITTED"
CHECKPOINTS = Kind("checkpoints", "version=", COMMIT)
DEFAULT_SHARD_BYTES = 2 << 30
_FIX = (
    "Resume the run (`rft run CONFIG --resume RUN`) so that the trainer publishes its weights again, and check what "
    "else writes or deletes under the run's checkpoints/ (checkpoint retention, a disk or copy error)"
)


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _crc32_file(path: str, chunk_bytes: int = 16 << 20) -> int:
    """CRC-32 of a file, read in chunks into one buffer (no memory per chunk)."""
    buf, crc = bytearray(chunk_bytes), 0
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc


_CHECKSUMS = {
    "crc32": ("CRC-32", _crc32_file),
    "sha256": ("SHA-256", _sha256_file),
}  # marker key -> (name, file checksum)


def needed_checkpoints(committed: Iterable[int], published: int, loaded: Iterable[int | None]) -> set[int]:
    """Checkpoint versions an explorer may still load: `published` (just sent) and every committed
    version newer than the oldest one acknowledged in `loaded` (one entry per explorer; None: no
    ack yet, so any version may still be loaded)."""
    oldest = min((-1 if v is None else v for v in loaded), default=-1)
    return {published} | {v for v in committed if v > oldest}


class CheckpointSender:
    """Trainer side: writes `checkpoints/version=<v>/` then its commit marker."""

    method = "checkpoint"

    def __init__(
        self,
        fs: Any,
        root: str,
        model_dir: str,
        dtype: torch.dtype | None,
        board: Board,
        num_explorers: int,
        wait_timeout_s: float,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        keep_last: int | None = None,
        pinned: Callable[[], int | None] | None = None,
        adapter_config: dict[str, Any] | None = None,
    ):
        """Writes under `root` (the run's directory) of filesystem `fs`. `keep_last`:
        synchronizer.keep_last_checkpoints (None keeps every version); `pinned`: returns the
        version a lineage's model points at (None: none of this run's), which is kept.
        `adapter_config` (a LoRA run's, rl_engine.adapter.peft_config): the tensors are an adapter,
        written in peft's layout with this config."""
        self.fs, self.root = fs, root
        self.adapter_config = adapter_config
        self.keep_last, self.pinned = keep_last, pinned
        self.model_dir = model_dir
        self.dtype = dtype
        self.board, self.num_explorers, self.wait_timeout_s = board, num_explorers, wait_timeout_s
        self.shard_bytes = shard_bytes
        self.last: SyncStats | None = None

    def connect(self, stop: StopSignal | None = None) -> None:
        """Nothing to join: storage is the rendezvous."""

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Nothing to wait for: explorers load committed versions whenever they are ready."""

    def wait_loaded(self, version: int, stop: StopSignal | None = None) -> None:
        wait_loaded(self.board, self.num_explorers, version, self.wait_timeout_s, stop)

    def version_dir(self, version: int) -> str:
        return CHECKPOINTS.dir(self.root, version)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write every (HF name, full tensor) pair as safetensors shards, config.json, then commit; then prune older versions."""
        t0 = time.perf_counter()
        n, nbytes = self.write_full(named_tensors, version)
        self.last = SyncStats(version, n, nbytes, time.perf_counter() - t0)
        self.prune(version)

    def uncommit(self, d: str) -> None:
        """Re-publishing a version (resumed trainer): its old marker goes first."""
        marker = storage.join(d, COMMIT)
        if self.fs.exists(marker):
            self.fs.rm(marker)
        self.fs.makedirs(d, exist_ok=True)

    def write_full(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        marker_extra: dict[str, Any] | None = None,
    ) -> tuple[int, int]:
        """Write `checkpoints/version=<version>/` and commit it (its marker gets `marker_extra` too);
        returns (tensors, tensor bytes)."""
        d = self.version_dir(version)
        marker = storage.join(d, COMMIT)
        self.uncommit(d)
        shards: list[dict[str, torch.Tensor]] = []
        weight_map: dict[str, str] = {}
        files: dict[str, dict[str, Any]] = {}  # name -> {bytes, sha256}: what a reader verifies before loading
        cur: dict[str, torch.Tensor] = {}
        size = n = nbytes = 0
        for name, t in named_tensors:
            t = self.prepare_tensor(t, cur)
            cur[name] = t
            size += t.numel() * t.element_size()
            n += 1
            if size >= self.shard_bytes:
                self._write_shard(d, len(shards) + 1, cur, weight_map, files)
                shards.append({})
                nbytes += size
                cur, size = {}, 0
        if n == 0:
            raise ValueError(f"checkpoint of version {version}: the trainer gave no parameters")
        if cur or not shards:
            if not shards:  # one shard: the plain HF single-file layout, or peft's
                self.write_file(d, WEIGHTS_FILE if self.adapter_config else "model.safetensors", cur, files)
            else:
                self._write_shard(d, len(shards) + 1, cur, weight_map, files)
            nbytes += size
        if weight_map:
            storage.write_json(
                self.fs,
                storage.join(d, "model.safetensors.index.json"),
                {"metadata": {"total_size": nbytes}, "weight_map": weight_map},
            )
        if self.adapter_config is not None:
            storage.write_json(self.fs, storage.join(d, CONFIG_FILE), self.adapter_config)
        else:
            with open(os.path.join(self.model_dir, "config.json"), "rb") as f:
                storage.write_bytes_atomic(self.fs, storage.join(d, "config.json"), f.read())
        # Written last: until it exists no reader sees this version.
        storage.write_json(
            self.fs,
            marker,
            {
                "version": version,
                "tensors": n,
                "bytes": nbytes,
                "time": time.time(),
                "files": files,
                **(marker_extra or {}),
            },
        )
        return n, nbytes

    def prune(self, published: int) -> list[int]:
        """After `published` was committed: delete versions beyond `keep_last` that no explorer may
        still load and no lineage points at. Returns the versions deleted."""

        return prune(
            self.fs, self.root, CHECKPOINTS, self.keep_last, lambda committed: self.protected(committed, published)
        )

    def protected(self, committed: list[int], published: int) -> set[int]:
        """Of the `committed` versions, those an explorer may still load (`needed_checkpoints`) and the one a lineage points at."""
        loaded = [(self.board.get(loaded_key(i)) or {}).get("version") for i in range(self.num_explorers)]
        pinned = self.pinned() if self.pinned else None
        return needed_checkpoints(committed, published, loaded) | ({pinned} if pinned is not None else set())

    def prepare_tensor(self, t: torch.Tensor, shard: dict[str, torch.Tensor]) -> torch.Tensor:
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        t = t.to("cpu").contiguous()
        # safetensors refuses two names on one storage (tied embeddings): give the second a copy.
        ptr = t.untyped_storage().data_ptr()
        if any(x.untyped_storage().data_ptr() == ptr for x in shard.values()):
            t = t.clone()
        return t

    def _write_shard(
        self,
        d: str,
        index: int,
        tensors: dict[str, torch.Tensor],
        weight_map: dict[str, str],
        files: dict[str, dict[str, Any]],
    ) -> None:
        fname = f"model-{index:05d}.safetensors"
        self.write_file(d, fname, tensors, files)
        weight_map.update({k: fname for k in tensors})

    def write_file(
        self, d: str, fname: str, tensors: dict[str, torch.Tensor], files: dict[str, dict[str, Any]]
    ) -> None:
        """Write one safetensors file and record its size and CRC-32 in `files`."""
        from safetensors.torch import save, save_file

        path = storage.join(d, fname)
        if storage.is_local(self.fs):
            save_file(tensors, path, metadata={"format": "pt"})  # no in-memory copy of the shard
            files[fname] = {"bytes": os.path.getsize(path), "crc32": _crc32_file(path)}  # read back from the page cache
        else:
            data = save(tensors, metadata={"format": "pt"})
            files[fname] = {"bytes": len(data), "crc32": zlib.crc32(data)}
            self.fs.pipe_file(path, data)

    def close(self) -> None:
        """Nothing to release."""


def version_to_load(version: int | None, latest_committed: Callable[[], int | None], held: int) -> int | None:
    """What a receive loads: `version` when given, else the newest committed version if it is
    newer than the `held` one; None: nothing to load."""
    if version is not None:
        return version
    latest = latest_committed()
    return latest if latest is not None and latest > held else None


class Damaged(Exception):
    """A committed version that cannot be used: gone, uncommitted, or its files not what its marker says."""


class CheckpointReceiver:
    """Explorer side: finds committed versions and loads one into a live engine."""

    method = "checkpoint"
    joins_every_version = False

    def __init__(self, fs: Any, root: str, board: Board, explorer_id: int = 0, timeout_s: float = 600.0):
        """Loads from under `root` (the run's directory) of filesystem `fs`."""
        self.fs, self.root = fs, root
        self.board, self.explorer_id = board, explorer_id
        self.timeout_s = timeout_s

    def connect(self, engine: Any, stop: StopSignal | None = None) -> None:
        """Nothing to join: storage is the rendezvous."""

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Wait until `version` is committed (the trainer announces a version before its write ends)."""
        self.wait_committed(version, [CHECKPOINTS], stop)

    def wait_committed(self, version: int, kinds: list[Kind], stop: StopSignal | None = None) -> None:
        """Wait until a directory of `version` of any of `kinds` is committed."""
        markers = [storage.join(kind.dir(self.root, version), COMMIT) for kind in kinds]
        what = f"checkpoint version {version} to be committed"

        def timed_out() -> WaitTimeout:
            return WaitTimeout(
                f"waited {self.timeout_s:.0f} s for {what} under {self.root}/checkpoints (synchronizer.wait_timeout_s)"
            )

        interval = storage.poll_interval(self.fs)
        poll_until(
            lambda: any(storage.file_exists(self.fs, m) for m in markers),
            what=what,
            timeout_s=self.timeout_s,
            interval_s=interval,
            stop=stop,
            timeout_error=timed_out,
            between=self.fs.invalidate_cache,
        )

    def committed_versions(self) -> list[int]:
        """Every version with a commit marker, ascending."""
        return committed(self.fs, self.root, CHECKPOINTS)

    def latest_committed(self) -> int | None:
        """The newest committed version, or None if the trainer has published none yet."""
        versions = self.committed_versions()
        return versions[-1] if versions else None

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Load `version` (default: the newest committed one) into `engine`; returns the installed version.

        With version=None and nothing newer than the engine's version committed, nothing is
        loaded and the engine's version is returned. An uncommitted version is never loaded.
        """
        target = version_to_load(version, self.latest_committed, engine.version)
        return engine.version if target is None else self.install(engine, target)

    def install(self, engine: Any, version: int) -> int:
        """Load committed `version` into `engine` and acknowledge it; returns the version installed."""
        try:
            with self.fetched(CHECKPOINTS.dir(self.root, version), version) as (local, _):
                got = self.load_dir(engine, local, version)
        except Damaged as e:
            raise self._refused(version, engine, str(e)) from None
        self.acknowledge(engine, got)
        return got

    def acknowledge(self, engine: Any, version: int) -> None:
        engine.mark_synced(version)
        post_loaded(self.board, self.explorer_id, version)

    def _refused(self, version: int, engine: Any, problem: str) -> SyncError:
        return SyncError(
            f"checkpoint version {version} refused: {problem}. Nothing was loaded: explorer {self.explorer_id}'s engine keeps version {engine.version}. {_FIX}"
        )

    @contextlib.contextmanager
    def fetched(self, d: str, version: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """(a local directory holding the weight files of committed directory `d`, its marker),
        every file checked against the marker; raises Damaged. From object storage the files are
        copied to a temporary directory, removed afterwards."""
        marker, files = self._committed_files(d, version)
        if storage.is_local(self.fs):
            self._verify(d, d, files)
            yield d, marker
            return
        tmp = tempfile.mkdtemp(prefix=f"rft-ckpt-v{version}-")
        try:
            for fname in files:
                try:
                    self.fs.get_file(storage.join(d, fname), os.path.join(tmp, fname))
                except FileNotFoundError:
                    pass  # _verify names it
            self._verify(tmp, d, files)
            yield tmp, marker
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _committed_files(self, d: str, version: int) -> tuple[dict[str, Any], dict[str, dict[str, Any] | None]]:
        """The marker of committed `d` and the weight files it lists with what it says about each
        (None: a marker from before checksums, whose files are only opened); raises Damaged for
        a directory that is gone or uncommitted."""
        self.fs.invalidate_cache()
        try:
            marker = storage.read_json(self.fs, storage.join(d, COMMIT))
        except FileNotFoundError:
            where = f"under {self.root}/checkpoints"
            if self.fs.exists(d):
                raise SyncError(
                    f"checkpoint version {version} {where} is not committed; committed: {self.committed_versions()}"
                ) from None
            raise Damaged(
                f"it does not exist {where} (deleted after it was committed, or never written); committed now: {self.committed_versions()}"
            ) from None
        except ValueError as e:
            raise Damaged(f"its commit marker {storage.join(d, COMMIT)} is unreadable ({e})") from e
        if "files" in marker:
            return marker, marker["files"]
        return marker, {p.rsplit("/", 1)[-1]: None for p in self.fs.glob(storage.join(d, "*.safetensors"))}

    def _verify(self, local_dir: str, shown_dir: str, files: dict[str, dict[str, Any] | None]) -> None:
        """Every listed file is there with the size and checksum its commit marker recorded; raises Damaged."""
        if not files:
            raise Damaged(f"{shown_dir} holds no weight files")
        for fname, want in files.items():
            path, shown = os.path.join(local_dir, fname), storage.join(shown_dir, fname)
            if not os.path.exists(path):
                raise Damaged(f"{shown} is missing (deleted after the trainer committed it)")
            if want is None:
                continue
            size = os.path.getsize(path)
            if size != want["bytes"]:
                raise Damaged(
                    f"{shown} has {size} bytes where its commit marker says {want['bytes']} (truncated or overwritten)"
                )
            key = "crc32" if "crc32" in want else "sha256"  # markers written before CRC-32 carry SHA-256
            what, checksum = _CHECKSUMS[key]
            if checksum(path) != want[key]:
                raise Damaged(
                    f"{shown} does not match the {what} in its commit marker (its bytes changed after the commit)"
                )

    def load_dir(self, engine: Any, local_dir: str, version: int) -> int:
        try:
            results = engine.rpc("rft_load_checkpoint", local_dir, version, timeout=self.timeout_s)
        except EngineDiedError:
            raise
        except Exception as e:
            raise SyncError(
                f"checkpoint version {version}: explorer {self.explorer_id}'s workers failed to load {local_dir}: {type(e).__name__}: {e}. {_FIX}"
            ) from e
        if any(n == 0 for _, n in results):
            raise RuntimeError(f"checkpoint version {version}: a worker loaded no tensors from {local_dir}")
        return version

    def close(self) -> None:
        """Nothing to release."""
