"""Delta checkpoint sync (`synchronizer.delta`): publish only what changed since the previous version.

Layout under the run URL, beside the full checkpoints of `rl_engine.sync.checkpoint`:

    checkpoints/version=<v>/         a full checkpoint, as without deltas; its marker adds `chain`
    checkpoints/delta=<v>/delta.safetensors.zst
    checkpoints/delta=<v>/_COMMITTED JSON, written last: {version, base, chain, kind: "delta", format: 2, tensors,
                                     changed, bytes, payload_bytes, time, files: {name: {bytes, crc32, raw_bytes}}}

A delta is exact: per tensor, the elements whose bits differ from the previous published version
(`base`), as the differences of their bit patterns (int8 where a step moves them a few ulps) at
int32 positions or a packed mask, or the whole tensor, whichever is smallest; unchanged tensors
are absent (`rl_engine.sync.delta_format`). The entries (`payload_bytes`) are one safetensors file
(`raw_bytes`) compressed with zstd (`bytes`: what is written; the CRC-32 covers it). Format 1
deltas (`delta.safetensors`, the new values, no `format`) are still read; an unknown format is a
broken link (below). Applying a chain gives the trainer's tensors bit for bit. Every
`full_every` versions the trainer writes a full checkpoint, and whenever the compressed delta
would be more than half its size (float32: one Adam step moves every element with a gradient),
starting a new chain (a random `chain` id carried by the full and each delta built on it); after
a restart it starts with a full one (it no longer holds the tensors to diff against).

An explorer reaches version v by walking back from v over the deltas' `base` until it meets the
version its engine holds (same chain: nothing but the deltas is read) or a full checkpoint (read,
then the deltas applied). Every link must be committed, of the same chain, and match the size and
CRC-32 its marker records. If one is missing or damaged, the explorer falls back to the newest
full version <= v and applies the intact deltas after it, logs which version it could not reach
and why, and reports the version it installed (lower than v). The explorer keeps the tensors it
installed on the CPU (one model in the model's dtype) to apply the next deltas to; the engine
loads them through the same in-place reload as a full checkpoint (a local temporary safetensors
file), since vLLM's layerwise reload needs every tensor of a layer it reloads.

Retention (the sender's, after each publish): versions (full or delta) beyond the newest
`keep_last_checkpoints` go, except those an explorer may still load (as for full checkpoints) and
every version those need: their deltas back to their full checkpoint. `rft eval` of a run sees
the full versions only (a delta is no model directory).

Cost: the trainer keeps one CPU copy of the weights in the model's dtype, each explorer one more.
One step of the demo (float32) changes every element (Adam moves each one with a gradient by
about lr, thousands of float32 ulps: int16 or int32 differences that zstd hardly shrinks: the
delta's file would be 86% of a full checkpoint), so it is published in full (delta_bytes_ratio
1.0). In bfloat16 most small updates round away and the rest move an ulp or two: the demo's step
moves 12% of the elements and its delta is 7.5% of a full checkpoint (delta_bytes_ratio_bf16;
format 1: 19%). 100M bfloat16 elements, 4% of them moved (lr 1e-6): encode 0.27 s, zstd 0.07 s,
unzstd 0.03 s, apply 0.1 s; 15% moved: 0.6, 0.25, 0.05 and 0.5 s (numpy, best of 5 on 2 shared
cores; format 1 encoded and applied in 0.23 and 0.19 s, 0.43 and 0.39 s).

    s = build_weight_sender(cfg, board)                 # synchronizer.delta.enabled: DeltaCheckpointSender
    s.send(trainer.named_weights(), version=t)          # full or delta, then prune
    r = build_weight_receiver(cfg, board, x)            # DeltaCheckpointReceiver
    r.receive(engine, t); r.last_route                  # {"start": "held" | "full", "base", "deltas", "fallback"}
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from rl_engine import storage
from rl_engine.board import StopSignal
from rl_engine.proc.failpoints import failpoint
from rl_engine.pruning import Kind, committed, delete, list_dirs, to_delete
from rl_engine.sync.base import SyncError
from rl_engine.sync.checkpoint import (
    CHECKPOINTS,
    COMMIT,
    CheckpointReceiver,
    CheckpointSender,
    Damaged,
    version_to_load,
)
from rl_engine.sync.collective import SyncStats
from rl_engine.sync.delta_format import FORMAT, SEP, apply, diff, pack, payload_bytes, unpack

log = logging.getLogger(__name__)

DELTAS = Kind("checkpoints", "delta=", COMMIT)
DELTA_FILE = "delta.safetensors.zst"  # format 2 (delta_format.pack)
DELTA_FILE_V1 = "delta.safetensors"  # format 1: the entries uncompressed
FAILPOINT = "sync.delta_before_commit"  # RFT_FAILPOINT=sync.delta_before_commit@<v>: killed between a delta's file and its marker


# ---------------------------------------------------------------- trainer side


class DeltaCheckpointSender:
    """Trainer side: a delta against the previous version it published, or a full checkpoint every
    `full_every` versions (and first) through `full`, the full-checkpoint sender whose layout,
    commit and retention rules it shares. Holds the last published tensors on the CPU."""

    method = "checkpoint"

    def __init__(self, full: CheckpointSender, full_every: int):
        self.full, self.full_every = full, full_every
        self.fs, self.root = full.fs, full.root
        self.base: dict[str, torch.Tensor] | None = None  # the last published tensors (private CPU copies)
        self.base_version, self.chain, self.links = -1, "", 0  # links: deltas since the last full checkpoint
        self._bases: dict[int, int] = {}  # delta version -> its base (retention), as written or read
        self.last: SyncStats | None = None

    def connect(self, stop: StopSignal | None = None) -> None:
        self.full.connect(stop)

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        self.full.prepare(version, stop)

    def wait_loaded(self, version: int, stop: StopSignal | None = None) -> None:
        self.full.wait_loaded(version, stop)

    def version_dir(self, version: int) -> str:
        return self.full.version_dir(version)

    def close(self) -> None:
        self.full.close()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish `version` as a delta against the last published one, or in full; then prune."""
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for name, t in named_tensors:
            p = self.full.prepare_tensor(t, tensors)
            tensors[name] = (
                p.clone() if p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else p
            )  # never the trainer's live storage
        if not tensors:
            raise ValueError(f"checkpoint of version {version}: the trainer gave no parameters")
        delta, full = None, payload_bytes(tensors.values())
        if self.base is not None and version > self.base_version and self.links + 1 < self.full_every:
            entries = diff(self.base, tensors)
            if (
                entries is not None and payload_bytes(entries.values()) < full
            ):  # not every tensor whole (float32 steps), which hardly compresses
                delta = (entries, *pack(entries))
            if delta is not None and 2 * len(delta[1]) > full:
                delta = None  # it would save less than half: a full checkpoint (loaded straight, and a fresh chain) costs less
        if delta is None:
            self.chain, self.links = uuid.uuid4().hex, 0
            delete(self.fs, self.root, DELTAS, [version])  # a delta of this version from before a restart
            _, nbytes = self.full.write_full(tensors.items(), version, {"chain": self.chain})
        else:
            delete(self.fs, self.root, CHECKPOINTS, [version])  # a full one of this version from before a restart
            nbytes = self._write_delta(delta, version, len(tensors))
            self.links += 1
        self.base, self.base_version = tensors, version
        self.last = SyncStats(
            version, len(tensors), nbytes, time.perf_counter() - t0, "full" if delta is None else "delta"
        )
        self.prune(version)

    def _write_delta(self, delta: tuple[dict[str, torch.Tensor], bytes, int], version: int, tensors: int) -> int:
        """Write the packed delta (entries, compressed file, its uncompressed size) and commit it; returns the bytes written."""
        entries, data, raw = delta
        d = DELTAS.dir(self.root, version)
        self.full.uncommit(d)
        storage.write_bytes_atomic(
            self.fs, storage.join(d, DELTA_FILE), data, fsync=False
        )  # as full checkpoints: the CRC catches a torn file
        files = {
            DELTA_FILE: {"bytes": len(data), "crc32": zlib.crc32(data), "raw_bytes": raw}
        }  # the CRC covers the compressed bytes
        failpoint(FAILPOINT, version)
        changed = sum(int(t.numel()) for k, t in entries.items() if k.endswith((f"{SEP}dbits", f"{SEP}all")))
        marker = {
            "version": version,
            "base": self.base_version,
            "chain": self.chain,
            "kind": "delta",
            "format": FORMAT,
            "tensors": tensors,
            "changed": changed,
            "bytes": len(data),
            "payload_bytes": payload_bytes(entries.values()),
            "time": time.time(),
            "files": files,
        }
        storage.write_json(self.fs, storage.join(d, COMMIT), marker)  # written last: until then no reader sees it
        self._bases[version] = self.base_version
        return len(data)

    def prune(self, published: int) -> list[int]:
        """After `published` was committed: delete versions (full or delta) beyond `keep_last` that no
        explorer may still load, no lineage points at, and no kept version's chain needs. Returns them."""
        keep_last = self.full.keep_last
        if keep_last is None:
            return []
        fulls, fulls_open = list_dirs(self.fs, self.root, CHECKPOINTS)
        deltas, deltas_open = list_dirs(self.fs, self.root, DELTAS)
        versions = sorted(set(fulls) | set(deltas))
        keep = set(versions[-keep_last:] if keep_last else []) | self.full.protected(versions, published)
        keep = with_bases(keep, set(fulls), set(deltas), self._base_of)
        doomed_deltas, doomed_fulls = to_delete(deltas, deltas_open, 0, keep), to_delete(fulls, fulls_open, 0, keep)
        delete(self.fs, self.root, DELTAS, doomed_deltas)
        delete(self.fs, self.root, CHECKPOINTS, doomed_fulls)
        for v in doomed_deltas:
            self._bases.pop(v, None)
        return sorted(set(doomed_deltas) | set(doomed_fulls))

    def _base_of(self, version: int) -> int | None:
        if version not in self._bases:
            try:
                self._bases[version] = int(
                    storage.read_json(self.fs, storage.join(DELTAS.dir(self.root, version), COMMIT))["base"]
                )
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                return None
        return self._bases[version]


def with_bases(keep: set[int], fulls: set[int], deltas: set[int], base_of: Any) -> set[int]:
    """`keep` and every version a kept one needs: a delta's base, back to a full checkpoint (a
    version that has one needs nothing; a base that cannot be read ends the walk)."""
    out = set(keep)
    for v in keep:
        while v not in fulls and v in deltas and (b := base_of(v)) is not None and b < v:
            out.add(b)
            v = b
    return out


# ---------------------------------------------------------------- explorer side


class BrokenLink(Exception):
    """Delta (or full, `what`) `version` cannot be applied: `problem` says why."""

    def __init__(self, version: int, problem: str, what: str = "delta"):
        super().__init__(f"{what} version {version}: {problem}")
        self.version, self.problem = version, problem


class DeltaCheckpointReceiver:
    """Explorer side: reaches a version through deltas (see the module docstring), reading and
    loading files through `full`, the full-checkpoint receiver (its checks, loads and
    acknowledgements); keeps the installed tensors on the CPU. `last_route` says how the last
    receive got its version."""

    method = "checkpoint"
    joins_every_version = False  # a skipped version's delta stays in the chain the next receive applies

    def __init__(self, full: CheckpointReceiver):
        self.full = full
        self.fs, self.root, self.explorer_id = full.fs, full.root, full.explorer_id
        self.held: dict[str, torch.Tensor] | None = None
        self.held_version, self.held_chain, self._held_engine = -1, "", None
        self.last_route: dict[str, Any] | None = None

    def connect(self, engine: Any, stop: StopSignal | None = None) -> None:
        self.full.connect(engine, stop)

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Wait until `version` is committed, as a full checkpoint or a delta."""
        self.full.wait_committed(version, [CHECKPOINTS, DELTAS], stop)

    def committed_versions(self) -> list[int]:
        """Every version with a committed full checkpoint or delta, ascending."""
        return sorted(set(committed(self.fs, self.root, CHECKPOINTS)) | set(committed(self.fs, self.root, DELTAS)))

    def latest_committed(self) -> int | None:
        versions = self.committed_versions()
        return versions[-1] if versions else None

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Install `version` (default: the newest committed one, if newer than the engine's); returns the version installed."""
        target = version_to_load(version, self.latest_committed, engine.version)
        return engine.version if target is None else self.install(engine, target)

    def close(self) -> None:
        self.full.close()

    def _holds(self, engine: Any) -> bool:
        """Whether the held tensors are what `engine` runs (not after another load into it)."""
        return self.held is not None and self._held_engine is engine and engine.version == self.held_version

    def install(self, engine: Any, version: int) -> int:
        """Reach `version` (the held one + deltas, or a full one + deltas); on a missing or damaged
        link fall back to the newest full version <= `version` and the intact deltas after it."""
        try:
            start, links = self._route(engine, version)
            base = self.held_version if start is None else start[0]
            got = self._apply_chain(engine, start, links, version)
            self.last_route = {
                "version": got,
                "start": "held" if start is None else "full",
                "base": base,
                "deltas": [v for v, _ in links],
                "fallback": None,
            }
            log.info(
                "explorer %d: version %d from %s version %d + deltas %s",
                self.explorer_id,
                got,
                self.last_route["start"],
                base,
                self.last_route["deltas"],
            )
        except BrokenLink as broken:
            got = self._fall_back(engine, version, broken)
        self.full.acknowledge(engine, got)
        return got

    # ---- reading storage

    def _marker(self, kind: Kind, version: int) -> dict[str, Any] | None:
        """The commit marker of `version`'s `kind` directory; None if it is not committed or unreadable."""
        try:
            m = storage.read_json(self.fs, storage.join(kind.dir(self.root, version), COMMIT))
        except (FileNotFoundError, ValueError):
            return None
        return m if isinstance(m, dict) else None

    def _route(
        self, engine: Any, version: int
    ) -> tuple[tuple[int, dict[str, Any]] | None, list[tuple[int, dict[str, Any]]]]:
        """(start, deltas oldest first): start None for the held tensors, else (full version, its
        marker). Walks back from `version`; raises BrokenLink where the chain breaks."""
        self.fs.invalidate_cache()
        links: list[tuple[int, dict[str, Any]]] = []
        cur, chain = version, None
        while True:
            if self._holds(engine) and cur == self.held_version and chain in (None, self.held_chain):
                return None, links[::-1]
            full = self._marker(CHECKPOINTS, cur)
            if full is not None:
                if chain is not None and full.get("chain") != chain:
                    raise BrokenLink(
                        links[-1][0],
                        f"its base, full version {cur}, is of another chain (written by a trainer that restarted)",
                    )
                return (cur, full), links[::-1]
            m = self._marker(DELTAS, cur)
            if m is None:
                what = (
                    f"neither a full checkpoint nor a delta of version {cur} is committed under {self.root}/checkpoints"
                )
                raise BrokenLink(cur, what if not links else f"{what} (the base of delta version {links[-1][0]})")
            if chain is not None and m.get("chain") != chain:
                raise BrokenLink(
                    links[-1][0],
                    f"its base, delta version {cur}, is of another chain (written by a trainer that restarted)",
                )
            if not isinstance(m.get("base"), int) or m["base"] >= cur:
                raise BrokenLink(cur, f"its commit marker names base {m.get('base')!r}")
            links.append((cur, m))
            cur, chain = m["base"], m.get("chain")

    def _read_full(self, version: int, engine: Any = None) -> dict[str, torch.Tensor]:
        """Full version `version`'s tensors, its files checked against its marker (raises Damaged);
        with `engine`, loaded into it too, straight from the checked files."""
        from safetensors.torch import load_file

        with self.full.fetched(CHECKPOINTS.dir(self.root, version), version) as (local, _):
            if engine is not None:
                self.full.load_dir(engine, local, version)
            return {
                k: v
                for f in sorted(os.listdir(local))
                if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(local, f)).items()
            }

    def _read_delta(self, version: int) -> dict[str, torch.Tensor]:
        """Delta `version`'s entries, its file checked against its marker (format 1 or 2); raises BrokenLink."""
        from safetensors.torch import load_file

        try:
            with self.full.fetched(DELTAS.dir(self.root, version), version) as (local, marker):
                fmt = marker.get("format", 1)
                if fmt == 1:
                    return load_file(os.path.join(local, DELTA_FILE_V1))
                if fmt != FORMAT:
                    raise BrokenLink(
                        version,
                        f"its format {fmt!r} is unknown to this rl_engine, which reads formats 1 and {FORMAT} (written by a newer trainer?)",
                    )
                with open(os.path.join(local, DELTA_FILE), "rb") as f:
                    return unpack(f.read(), int(marker["files"][DELTA_FILE]["raw_bytes"]))
        except BrokenLink:
            raise
        except (Damaged, SyncError) as e:
            raise BrokenLink(version, str(e)) from None
        except Exception as e:  # noqa: BLE001 - an unreadable file whose marker carries no checksum
            raise BrokenLink(version, f"{type(e).__name__}: {e}") from None

    # ---- installing

    def _apply_chain(
        self,
        engine: Any,
        start: tuple[int, dict[str, Any]] | None,
        links: list[tuple[int, dict[str, Any]]],
        version: int,
    ) -> int:
        if start is None:
            if not links:
                return version
            tensors, chain = self.held, self.held_chain
        else:
            chain = start[1].get("chain", "")
            try:
                tensors = self._read_full(start[0], engine if not links else None)
            except Damaged as e:
                raise BrokenLink(start[0], str(e), what="full") from None
            if not links:  # a full version: the engine loaded its files
                self.held, self.held_version, self.held_chain, self._held_engine = tensors, version, chain, engine
                return version
        assert tensors is not None
        if start is None:
            self.held_version = -1  # the held tensors change below: they are no engine's until loaded
        for v, _ in links:
            delta = self._read_delta(v)
            try:
                apply(tensors, delta)
            except (ValueError, RuntimeError, IndexError) as e:
                raise BrokenLink(v, f"it does not fit the tensors of its base: {e}") from None
        self._load_held(engine, tensors, chain, version)
        return version

    def _load_held(self, engine: Any, tensors: dict[str, torch.Tensor], chain: str, version: int) -> None:
        """Load the reconstructed tensors into the engine (through a local safetensors file) and hold them."""
        from safetensors.torch import save_file

        tmp = tempfile.mkdtemp(prefix=f"rft-delta-v{version}-")
        try:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            self.full.load_dir(engine, tmp, version)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.held, self.held_version, self.held_chain, self._held_engine = tensors, version, chain, engine

    def _fall_back(self, engine: Any, version: int, broken: BrokenLink) -> int:
        """The newest intact full version <= `version` (or the held version, if it continues that
        full one's chain), plus the intact deltas that continue it up to `version`; returns the version installed."""
        for full in reversed([f for f in committed(self.fs, self.root, CHECKPOINTS) if f <= version]):
            chain = (self._marker(CHECKPOINTS, full) or {}).get("chain", "")
            tensors: dict[str, torch.Tensor] | None = None
            if self._holds(engine) and self.held_chain == chain and self.held_version >= full:
                cur, start = self.held_version, f"held version {self.held_version}"
            else:
                try:
                    tensors = self._read_full(full)
                except Damaged as e:
                    log.warning(
                        "explorer %d: full version %d is damaged too (%s); trying an older one",
                        self.explorer_id,
                        full,
                        e,
                    )
                    continue
                cur, start = full, f"full version {full}"
            applied: list[int] = []
            for v in committed(self.fs, self.root, DELTAS):
                m = self._marker(DELTAS, v) or {}
                if not cur < v <= version or m.get("base") != cur or m.get("chain") != chain:
                    continue
                try:
                    delta = self._read_delta(v)
                    if tensors is None:
                        tensors = {
                            k: t.clone() for k, t in (self.held or {}).items()
                        }  # the held copy stays whole if a link fails
                    apply(tensors, delta)
                except (BrokenLink, ValueError, RuntimeError, IndexError) as e:
                    log.warning("explorer %d: %s", self.explorer_id, e)
                    break
                cur = v
                applied.append(v)
            if tensors is not None:
                self._load_held(engine, tensors, chain, cur)
            log.warning(
                "explorer %d: version %d not reachable (%s); fell back to the last full version %d: holds version %d (%s + deltas %s)",
                self.explorer_id,
                version,
                broken,
                full,
                cur,
                start,
                applied,
            )
            self.last_route = {
                "version": cur,
                "start": "full",
                "base": full,
                "deltas": applied,
                "fallback": str(broken),
            }
            return cur
        raise SyncError(
            f"checkpoint version {version} refused: {broken}, and no intact full checkpoint <= {version} is committed under {self.root}/checkpoints. "
            f"Nothing was loaded: explorer {self.explorer_id}'s engine keeps version {engine.version}. Resume the run (`rft run CONFIG --resume RUN`) "
            "so that the trainer publishes a full checkpoint"
        )
