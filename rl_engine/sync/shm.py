"""Same-host bytes of the collective weight sync: one shared-memory file the trainer writes and its receivers map.

On CPU the gloo stream costs both ends a core (each byte is copied into the kernel's socket
buffers and out again) while the engine's in-place reload needs one too; on a 2-core machine the
three cannot overlap. When every receiver of the group runs on the trainer's host, the trainer
copies each bucket once into this file and the group carries only the bucket headers
(`buckets.py`: a header's `at` lists its segments' offsets); the receivers load straight from
their mapping of the file. Which transport a group uses is agreed once, when it forms
(`buckets.join_group`): shared memory only if every member mapped the file, else the stream.

The file lives in /dev/shm (tmpfs), is created by the trainer with a random name, opened by every
receiver while it joins, and unlinked by the trainer as soon as the group formed: the open
descriptors and mappings keep it alive, and nothing is left behind when a side is killed after it
formed; the name of a trainer killed before is removed by the next trainer on the host. Space
is reserved with posix_fallocate before a byte is written (a write into an unbacked tmpfs page
would be a SIGBUS), and a bucket that does not fit goes over the stream instead. The file grows
during the first version; after it each side maps all of it once more, populated (`settle`).

Reuse across syncs: version v+1's bytes overwrite version v's. The collective handshake makes that
safe: the trainer writes only after every explorer asked for v+1 (`CollectiveSender.prepare`),
which an explorer does only once it loaded v.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid

import psutil
import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "rft-weights-"  # then the creating process's pid, a dash, a random hex id
_GROW = 64 << 20  # the file grows in steps of this many bytes (tmpfs pages are reserved as it grows)


class SharedRegion:
    """A shared-memory file mapped into this process; `put` (the trainer) and `views` (a receiver)."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd
        self._map: mmap.mmap | None = None
        self._settled = 0  # the file's size when `settle` last mapped all of it
        self.full = False  # a reservation failed: later puts return None (the stream carries the rest)

    @classmethod
    def create(cls, directory: str = SHM_DIR) -> SharedRegion | None:
        """A new empty file in `directory` (None where it cannot be made: no tmpfs there), after
        removing the files of trainers that are gone (`remove_orphans`)."""
        remove_orphans(directory)
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            log.info("weight sync: no shared-memory file in %s (%s); the group streams the weights", directory, e)
            return None
        return cls(path, fd)

    @classmethod
    def attach(cls, path: str) -> SharedRegion | None:
        """The trainer's file at `path` (None where this process cannot open it: another host)."""
        try:
            return cls(path, os.open(path, os.O_RDWR))
        except OSError:
            return None

    @property
    def size(self) -> int:
        """Bytes the file holds now (reserved space)."""
        return os.fstat(self._fd).st_size

    def _mapped(self, end: int) -> mmap.mmap | None:
        """A mapping of the whole file that covers bytes [0, end). Earlier mappings stay valid while
        views of them live (mmap keeps itself open for exported buffers)."""
        if end == 0:
            return self._map
        if self._map is None or len(self._map) < end:
            size = self.size
            if size < end:
                raise ValueError(f"shared weights file {self.path} holds {size} bytes, a header asks for {end}")
            self._map = mmap.mmap(self._fd, size)
        return self._map

    def put(self, segs: list[torch.Tensor], offset: int, align: int) -> tuple[list[int], int] | None:
        """Copy uint8 segments into the file from `offset` (each at an `align`-byte boundary);
        returns their offsets and the next free offset, or None when the file cannot grow to hold them."""
        if self.full:
            return None
        at, end = [], offset
        for s in segs:
            at.append(end)
            end = (end + s.numel() + align - 1) // align * align
        size = self.size
        if size < end:
            try:
                grown = (end + _GROW - 1) // _GROW * _GROW
                os.posix_fallocate(self._fd, size, grown - size)
            except OSError as e:
                self.full = True
                log.warning(
                    "weight sync: shared memory %s cannot grow to %.0f MiB (%s); the rest goes over the gloo stream",
                    self.path,
                    end / 2**20,
                    e.strerror or e,
                )
                return None
        mapped = self._mapped(end)
        for s, off in zip(segs, at, strict=True):
            _view(mapped, off, s.numel()).copy_(s)
        return at, end

    def settle(self) -> None:
        """Once a version is through: if the file grew during it, map all of it again with every page
        mapped in at once (MAP_POPULATE). The version went in through mappings of the file as it grew;
        without this the next one, through the newest mapping, takes a page fault on each page an
        older mapping reached, on both sides: in a SmolLM2 run on a 2-core VM that made the second
        sync about 0.5 s slower than the later ones."""
        size = self.size if self._fd >= 0 else 0
        if size in (0, self._settled):
            return
        self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._settled = size

    def views(self, at: list[int], sizes: list[int]) -> list[torch.Tensor]:
        """uint8 views [bytes] of the segments at these offsets (no copy)."""
        mapped = self._mapped(max((o + n for o, n in zip(at, sizes, strict=True)), default=0))
        return [_view(mapped, o, n) for o, n in zip(at, sizes, strict=True)]

    def unlink(self) -> None:
        """Remove the file's name; members that opened it keep it until they close."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this process's descriptor and mapping (views still alive keep theirs)."""
        self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_orphans(directory: str) -> list[str]:
    """Remove the weight files in `directory` whose creating process no longer runs; returns their
    paths. A trainer unlinks its file once its group formed, so a file outlives its trainer only
    when the trainer was killed while it waited for the explorers to join (the file is still
    empty then, but its name stays until the next boot)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if not pid.isdigit() or psutil.pid_exists(int(pid)):  # another user's process counts as running
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:  # another user's file, or a trainer beside us removed it first
            continue
    if removed:
        log.info("weight sync: removed %d shared-memory file(s) of trainers that are gone", len(removed))
    return removed


def _view(mapped: mmap.mmap | None, offset: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of the mapping at `offset` (torch.frombuffer refuses an empty count)."""
    if nbytes == 0 or mapped is None:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
