"""The shared-memory file of the collective weight sync, alone in one process (no group; seconds).

.venv/bin/python -m pytest tests/rl_engine/sync/test_shm.py -q
"""

from __future__ import annotations

import os
import resource

import pytest
import torch

from rl_engine.sync import shm
from rl_engine.sync.shm import SharedRegion

PAGE = resource.getpagesize()
MIB = 1 << 20


def _faults(fn) -> int:
    """Minor page faults this thread takes while `fn` runs (on this thread only: torch's pool is kept out)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        fn()
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    finally:
        torch.set_num_threads(threads)


def _version(trainer: SharedRegion, worker: SharedRegion, segs: list[torch.Tensor], settle: bool) -> int:
    """One version through the file, as broadcast_send and broadcast_recv move it: the trainer puts
    each bucket, the worker reads a byte of each page of it through its views (a reduction over
    all of it would fault on its own temporaries); returns what the worker read."""
    offset, total = 0, 0
    for s in segs:
        at, offset = trainer.put([s], offset, 64)
        total += int(worker.views(at, [s.numel()])[0][::PAGE].sum())
    if settle:
        trainer.settle()
        worker.settle()
    return total


@pytest.mark.parametrize("settle", [True, False], ids=["settled", "not-settled"])
def test_a_settled_file_takes_the_next_version_without_page_faults(settle, monkeypatch):
    """The first version grows the file bucket by bucket, each side mapping it again as it grows.
    Settled after it, both sides have one mapping with every page mapped in, and the next version
    costs neither side a page fault (on a 2-core VM they cost about half of a reload); without
    settling, the next version faults on the pages the older mappings reached."""
    monkeypatch.setattr(shm, "_GROW", MIB)  # the 8 MiB version grows the file 8 times
    segs = [torch.full((MIB,), i, dtype=torch.uint8) for i in range(8)]  # 8 buckets of 1 MiB
    trainer = SharedRegion.create()
    if trainer is None:
        pytest.skip(f"no tmpfs at {shm.SHM_DIR} on this machine")
    worker = SharedRegion.attach(trainer.path)
    try:
        _version(trainer, worker, segs, settle)
        checksum = []
        faults = _faults(lambda: checksum.append(_version(trainer, worker, segs, settle=False)))
    finally:
        worker.close()
        trainer.unlink()
        trainer.close()
    assert checksum == [sum(i * MIB // PAGE for i in range(8))]  # the worker reads version 2's bytes
    pages = 8 * MIB // PAGE
    if settle:
        assert faults < 8, f"{faults} page faults for a version through settled mappings of {pages} pages"
    else:  # the trainer writes 7 of 8 buckets through a mapping that never reached them
        assert faults > pages // 4, f"only {faults} page faults through unsettled mappings: the test shows nothing"


def test_a_new_file_removes_the_files_of_trainers_that_are_gone(tmp_path):
    """A trainer killed while its explorers joined leaves its file's name behind (it unlinks the
    file once the group formed). The next trainer on the host removes the files whose creating
    process is gone, and leaves the live ones and every other file alone."""
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead = int(gone.stdout)
    orphan = tmp_path / f"{shm.PREFIX}{dead}-0123456789ab"
    live = tmp_path / f"{shm.PREFIX}1-0123456789ab"  # pid 1 always runs
    other = tmp_path / "rft-weights-notapid-x"
    for path in (orphan, live, other):
        path.write_bytes(b"")
    region = SharedRegion.create(str(tmp_path))
    try:
        assert not orphan.exists()
        assert live.exists() and other.exists() and region is not None and os.path.exists(region.path)
    finally:
        region.unlink()
        region.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
