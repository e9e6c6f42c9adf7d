"""A writer SIGKILLed between its data file and its commit record (failpoint buffer.after_data)
leaves a file that plain Arrow tools count; `remove_uncommitted` removes it and nothing else.

    .venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_sweep.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from rl_engine.buffer import BufferReader, BufferWriter
from rl_engine.buffer.sweep import remove_uncommitted, uncommitted_files
from rl_engine.buffer.synthetic import make_batch
from rl_engine.config import BufferConfig
from rl_engine.proc.failpoints import ENV
from rl_engine.storage import open_storage

WRITE_STEPS = """
import sys
from rl_engine.buffer import BufferWriter
from rl_engine.buffer.synthetic import make_batch
from rl_engine.storage import open_storage
w = BufferWriter(*open_storage(sys.argv[1], {}), 0)
for step in (1, 2, 3):
    w.write(step, make_batch(4, explorer_step=step, seed=step))
"""


def plain_arrow_rows(run: str) -> list[tuple[int, str]]:
    """(step, experience id) of every row as the README's pyarrow recipe reads buffer/."""
    table = ds.dataset(
        f"{run}/buffer", format="arrow", partitioning="hive", ignore_prefixes=[".", "_", "cursor"]
    ).to_table()
    return sorted(zip(table["explorer_step"].to_pylist(), table["experience_id"].to_pylist()))


def test_killed_writer_leaves_an_orphan_that_the_sweep_removes(tmp_path):
    run = str(tmp_path / "run")
    root = Path(__file__).resolve().parents[3]
    killed = subprocess.run(
        [sys.executable, "-c", WRITE_STEPS, run],
        cwd=root,
        env={"PATH": "", ENV: "buffer.after_data@3"},
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    (tmp_path / "run/buffer/explorer=0/step=1/.tmp-0123").write_bytes(
        b"ARROW1 half a file"
    )  # a write killed midway (local disk)
    orphans = uncommitted_files(*open_storage(run))
    assert [u.rsplit("/", 2)[-2] for u in orphans] == ["step=1", "step=3"]
    assert {s for s, _ in plain_arrow_rows(run)} == {1, 2, 3}  # the orphan's rows look like data

    # The resumed writer writes step 3 again; the orphan is still there until the sweep.
    BufferWriter(*open_storage(run, {}), 0).write(3, make_batch(4, explorer_step=3, seed=3))
    assert len(plain_arrow_rows(run)) == 16
    assert remove_uncommitted(*open_storage(run)) == orphans
    rows = plain_arrow_rows(run)
    assert [s for s, _ in rows] == [1] * 4 + [2] * 4 + [3] * 4 and len({i for _, i in rows}) == 12
    assert uncommitted_files(*open_storage(run)) == [] and remove_uncommitted(*open_storage(run)) == []
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    assert [x.explorer_step for x in reader.read_batch(12, timeout_s=0).experiences()] == [1] * 4 + [2] * 4 + [3] * 4


def test_a_run_without_buffer_files_has_nothing_to_remove(tmp_path):
    assert uncommitted_files(*open_storage(str(tmp_path / "new-run"))) == []
    assert remove_uncommitted(*open_storage(str(tmp_path / "new-run"))) == []


@pytest.mark.slow
def test_sweep_on_s3(s3_bucket):
    from rl_engine.buffer import _files

    url, options = s3_bucket
    run = f"{url}/runs/r1"
    w = BufferWriter(*open_storage(run, options), 1)
    w.write(1, make_batch(4, explorer_id=1, explorer_step=1))
    fs, root = open_storage(run, options)
    _files.write_data(
        fs,
        f"{root}/buffer/explorer=1/step=2/part-orphan.arrow",
        make_batch(4, explorer_id=1, explorer_step=2).to_table(),
    )
    assert uncommitted_files(*open_storage(run, options)) == [f"s3://{root}/buffer/explorer=1/step=2/part-orphan.arrow"]
    assert len(remove_uncommitted(*open_storage(run, options))) == 1
    assert uncommitted_files(*open_storage(run, options)) == []
    assert len(BufferReader(*open_storage(run, options), BufferConfig()).read_batch(4, timeout_s=0)) == 4
