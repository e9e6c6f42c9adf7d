"""Several writers at once (threads, processes), and writers killed mid-write.

.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_concurrency.py     # slow ones: processes, S3
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from rl_engine.buffer import BufferReader, BufferTimeout, BufferWriter
from rl_engine.buffer.synthetic import make_batch
from rl_engine.config import BufferConfig
from rl_engine.storage import open_storage

REPO = Path(__file__).resolve().parents[3]
WRITERS, STEPS, ROWS = 4, 20, 100  # 4 writers x 2,000 experiences

WRITER_CHILD = r"""
import json, sys
from rl_engine.buffer import BufferWriter
from rl_engine.buffer.synthetic import make_batch
from rl_engine.storage import open_storage
run, opts, explorer, steps, rows = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:6])
w = BufferWriter(*open_storage(run, opts), explorer)
for s in range(1, steps + 1):
    w.write(s, make_batch(rows, explorer_id=explorer, explorer_step=s, prompt_len=8, response_len=8))
"""


def _write_all(run: str, options: dict, explorer: int) -> None:
    w = BufferWriter(*open_storage(run, options), explorer)
    for s in range(1, STEPS + 1):
        w.write(s, make_batch(ROWS, explorer_id=explorer, explorer_step=s, prompt_len=8, response_len=8))


def _read_all(run: str, options: dict, writers_alive) -> list[str]:
    """Consume batches while the writers run; returns every experience id handed out."""
    reader = BufferReader(*open_storage(run, options), BufferConfig(whole_groups=True, poll_interval_s=0.01))
    ids: list[str] = []
    while len(ids) < WRITERS * STEPS * ROWS:
        if not writers_alive():
            batch = reader.read_batch(WRITERS * STEPS * ROWS - len(ids), timeout_s=0)
        else:
            try:
                batch = reader.read_batch(100, timeout_s=1)
            except BufferTimeout:
                continue
        ids += [str(x) for x in batch.column("experience_id")]
    return ids


def _expected() -> set[str]:
    return {f"e{e}-s{s}-{i}" for e in range(WRITERS) for s in range(1, STEPS + 1) for i in range(ROWS)}


def _threads(run: str, options: dict) -> None:
    threads = [threading.Thread(target=_write_all, args=(run, options, e)) for e in range(WRITERS)]
    for t in threads:
        t.start()
    ids = _read_all(run, options, lambda: any(t.is_alive() for t in threads))
    for t in threads:
        t.join()
    assert len(ids) == len(set(ids)) == 8000 and set(ids) == _expected()


def test_four_thread_writers_local(tmp_path):
    _threads(str(tmp_path), {})


def test_four_thread_writers_memory():
    _threads(f"memory://t-{uuid.uuid4().hex}/run", {})


def test_one_writer_shared_by_threads(tmp_path):
    w = BufferWriter(*open_storage(str(tmp_path), {}), 0)
    threads = [threading.Thread(target=w.write, args=(s, make_batch(10, explorer_step=s))) for s in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = BufferReader(*open_storage(str(tmp_path), {}))
    assert len({str(x) for x in reader.read_batch(80, timeout_s=0).column("experience_id")}) == 80
    assert reader.state_dict()["consumed"][w._writer] == {"upto": 8, "done": [], "partial": {}}


def _processes(run: str, options: dict) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER_CHILD, run, json.dumps(options), str(e), str(STEPS), str(ROWS)],
            env=env,
            cwd=REPO,
        )
        for e in range(WRITERS)
    ]
    ids = _read_all(run, options, lambda: any(p.poll() is None for p in procs))
    assert [p.wait() for p in procs] == [0] * WRITERS
    assert len(ids) == len(set(ids)) == 8000 and set(ids) == _expected()


@pytest.mark.slow
def test_four_process_writers_local(tmp_path):
    _processes(str(tmp_path), {})


@pytest.mark.slow
def test_four_process_writers_s3(s3_bucket):
    url, options = s3_bucket
    _processes(f"{url}/run", options)


# --------------------------------------------------------------------------- SIGKILL mid-write

KILLED_CHILD = r"""
import builtins, sys
from rl_engine.buffer import BufferWriter, _files
from rl_engine.buffer.synthetic import make_batch
from rl_engine.storage import open_storage

def wait_for_kill(*args, **kwargs):
    print("ready", flush=True)
    sys.stdin.read()  # the parent SIGKILLs us while we block here

class HalfThenBlock:
    # Wraps the temp file: writes half of the bytes, then blocks: a writer killed mid-file.
    def __init__(self, path, mode):
        self.f = builtins.open(path, mode)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        half = len(data) // 2
        self.f.write(data[:half]); self.f.flush()
        wait_for_kill()

if sys.argv[2] == "mid-file":
    import rl_engine.storage  # the atomic write lives there
    rl_engine.storage.open = HalfThenBlock
else:  # "before-commit": data file complete and renamed, commit record not yet written
    _files.put_json = wait_for_kill
BufferWriter(*open_storage(sys.argv[1], {}), 0).write(1, make_batch(64, explorer_step=1))
"""


@pytest.mark.slow
@pytest.mark.parametrize("phase, leftover", [("mid-file", ".tmp-*"), ("before-commit", "part-*.arrow")])
def test_writer_killed_leaves_nothing_visible(tmp_path, phase, leftover):
    run = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, run, phase],
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    step_dir = tmp_path / "buffer/explorer=0/step=1"
    assert len(list(step_dir.glob(leftover))) == 1  # the kill really happened at that point
    reader = BufferReader(*open_storage(run, {}), BufferConfig(on_corrupt="fail"))
    with pytest.raises(BufferTimeout, match="only 0 usable in 0 committed file"):
        reader.read_batch(1, timeout_s=0)
    if phase == "mid-file":  # Arrow tools skip the dot-file too
        assert (
            ds.dataset(
                f"{run}/buffer", format="arrow", partitioning="hive", ignore_prefixes=[".", "_", "cursor"]
            ).count_rows()
            == 0
        )
    BufferWriter(*open_storage(run, {}), 0).write(2, make_batch(4, explorer_step=2))
    assert {x.explorer_step for x in reader.read_batch(4, timeout_s=0).experiences()} == {2}
