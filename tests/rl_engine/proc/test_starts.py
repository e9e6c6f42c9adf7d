"""The tally of expensive starts: every process that inherits RFT_COUNT_STARTS appends to one file."""

from __future__ import annotations

import subprocess
import sys

from rl_engine.proc.starts import ENV, count_start, read_counts


def test_starts_from_this_process_and_a_child_add_up(tmp_path, monkeypatch):
    tally = tmp_path / "starts.txt"
    monkeypatch.setenv(ENV, str(tally))
    count_start("vllm_engine")
    code = "from rl_engine.proc.starts import count_start\nfor _ in range(3): count_start('deepspeed_init')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    count_start("vllm_engine")
    assert read_counts(str(tally)) == {"vllm_engine": 2, "deepspeed_init": 3}


def test_nothing_is_written_when_unset(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    count_start("vllm_engine")
    assert list(tmp_path.iterdir()) == []
    assert read_counts(str(tmp_path / "absent.txt")) == {}
