"""`rft buffer stats RUN` (rl_engine.buffer.stats.main) and reading the buffer with plain Arrow.

    .venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_stats.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from rl_engine.buffer import BufferReader, BufferWriter, _files, save_cursor
from rl_engine.buffer.stats import committed_files, main
from rl_engine.buffer.synthetic import make_batch
from rl_engine.storage import open_storage


def _run(tmp_path: Path) -> str:
    run = str(tmp_path / "run")
    for e in (0, 1):
        w = BufferWriter(run, {}, e)
        for s in (1, 2, 3):
            w.write(s, make_batch(4 * (e + 1), explorer_id=e, explorer_step=s, version=s - 1, response_len=10 + e))
    fs, root = open_storage(run)
    _files.write_data(fs, f"{root}/buffer/explorer=0/step=4/part-orphan.arrow", make_batch(2, explorer_step=4).to_table())
    reader = BufferReader(run, {})
    reader.read_batch(8, timeout_s=0)
    save_cursor(run, {}, 1, reader.state_dict())
    return run


def test_stats_json(tmp_path, capsys):
    run = _run(tmp_path)
    assert main([run, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["committed_files"] == 6 and s["experiences"] == 36 and s["uncommitted_files"] == 1
    assert s["per_explorer"] == [
        {"explorer": 0, "experiences": 12, "steps": 3, "first_step": 1, "last_step": 3},
        {"explorer": 1, "experiences": 24, "steps": 3, "first_step": 1, "last_step": 3},
    ]
    assert {(p["explorer"], p["step"]): p["experiences"] for p in s["per_step"]}[(1, 2)] == 8
    assert s["per_version"] == {"0": 12, "1": 12, "2": 12}
    assert s["response_tokens"]["min"] == 10 and s["response_tokens"]["max"] == 11
    assert s["finish_reasons"] == {"length": 18, "stop": 18}
    assert s["trainer_cursor"] == {"trainer_step": 1, "consumed": 8, "dropped_stale": 0, "skipped_corrupt": 0}


def test_stats_text_and_corrupt(tmp_path, capsys):
    run = _run(tmp_path)
    victim = Path(committed_files(run)[0])
    victim.write_bytes(victim.read_bytes()[:-1])
    assert main([run]) == 0
    out = capsys.readouterr().out
    assert "32 experiences in 6 committed files (1 corrupt, 1 written but not committed)" in out
    assert f"corrupt: file://{victim}: size" in out
    assert "reward:" in out and "finish reasons:   length 16 (50%)  stop 16 (50%)" in out
    assert "trainer cursor:   step 1: 8 consumed" in out


def test_stats_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main([str(tmp_path), "--storage-options", "[1]"]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_committed_files_open_with_pyarrow_dataset(tmp_path):
    run = _run(tmp_path)
    files = committed_files(run)
    assert len(files) == 6 and not any("orphan" in f for f in files)
    assert ds.dataset(files, format="arrow").count_rows() == 36
    # The whole-directory recipe sees every complete file, the uncommitted orphan included.
    assert ds.dataset(f"{run}/buffer", format="arrow", partitioning="hive", ignore_prefixes=[".", "_", "cursor"]).count_rows() == 38


@pytest.mark.slow
def test_stats_module_entry_point_on_s3(s3_bucket):
    url, options = s3_bucket
    run = f"{url}/r"
    BufferWriter(run, options, 0).write(1, make_batch(4))
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-m", "rl_engine.buffer.stats", run, "--storage-options", json.dumps(options)],
        capture_output=True, text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "4 experiences in 1 committed files" in proc.stdout
