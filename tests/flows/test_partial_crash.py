"""A SIGKILL injected between a partial step's continuation save and its buffer commit, or between
the buffer commit and retiring the staged copy (rl_engine/proc/failpoints.py), then `rft run --resume`:
every group is written and trained exactly once, and the continuations go on.

    .venv/bin/python -m pytest tests/flows/test_partial_crash.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from fsspec.implementations.local import LocalFileSystem

from harness.runs import partial_config, stored_rows, write_config
from rl_engine.buffer import ContinuationStore, _files
from rl_engine.buffer.sweep import uncommitted_files
from rl_engine.buffer.synthetic import make_batch
from rl_engine.proc.failpoints import ENV
from rl_engine.run.context import last_committed_steps, open_run

pytestmark = pytest.mark.slow

RFT = str(Path(sys.executable).with_name("rft"))  # the running venv's, as harness/kill_resume.py
TOTAL, CRASH_STEP = 6, 3
TIMEOUT_S = 420


def rft_run(args: list[str], root: Path, failpoint: str | None = None) -> subprocess.CompletedProcess:
    """`rft run ...` as a user's shell runs it: its own ephemeral Prefect server and Prefect home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != ENV}
    env |= {
        "PREFECT_HOME": str(root / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    if failpoint:
        env[ENV] = failpoint
    return subprocess.run(
        [RFT, "run", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=TIMEOUT_S,
        start_new_session=True,
    )


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
# explorer.after_stage (killed before the commit) passes too; the unit tests cover that point
# (tests/rl_engine/roles/test_partial.py), this one is the point the buffer and the store disagree on.
@pytest.mark.release
@pytest.mark.parametrize("point", ["explorer.after_commit"])
def test_killed_between_continuation_save_and_buffer_commit(point, tiny_model_dir, task_file, tmp_path):
    data = partial_config(
        tiny_model_dir,
        task_file,
        str(tmp_path),
        name="crash",
        mode="one_step_off_policy",
        sync_offset=1,
        total_steps=TOTAL,
        checkpoint_interval=2,
    )
    data["synchronizer"]["collective"].pop("port")
    data["monitor"]["artifacts"] = False
    config = write_config(tmp_path / "crash.yaml", data)

    killed = rft_run([config], tmp_path, f"{point}@{CRASH_STEP}")
    assert killed.returncode == -9, (
        f"the failpoint did not kill the run (exit {killed.returncode}):\n{killed.stdout[-3000:]}{killed.stderr[-3000:]}"
    )
    run = open_run(str(tmp_path / "crash"))
    store = ContinuationStore(*run.fs(), 0)
    staged = [e for e in store.list() if e.kind == "outbox"]
    assert [e.explorer_step for e in staged] == [CRASH_STEP]  # the kill left step 3's batch staged
    committed = last_committed_steps(run)[0]
    assert committed == (CRASH_STEP if point == "explorer.after_commit" else CRASH_STEP - 1)
    staged_groups = {str(g) for g in store.load([staged[0].id]).column("group_id")}
    before = {r["experience_id"] for r in stored_rows(run.url)}
    # What a writer killed between its data file and its commit record leaves (failpoint
    # buffer.after_data; tests/rl_engine/buffer/test_buffer_sweep.py kills one there).
    orphan = f"{run.url}/buffer/explorer=0/step={CRASH_STEP + 1}/part-killed.arrow"
    _files.write_data(LocalFileSystem(), orphan, make_batch(4, explorer_step=CRASH_STEP + 1).to_table())

    resumed = rft_run([config, "--resume", run.url], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # Once the resumed attempt ended, the buffer directory holds only committed files: plain Arrow
    # tools (the README's recipe) read each experience once.
    assert not os.path.exists(orphan) and uncommitted_files(*run.fs()) == []
    plain = ds.dataset(
        f"{run.url}/buffer", format="arrow", partitioning="hive", ignore_prefixes=[".", "_", "cursor"]
    ).to_table()
    assert sorted(plain["experience_id"].to_pylist()) == sorted(r["experience_id"] for r in stored_rows(run.url))
    rows = stored_rows(run.url)
    ids = Counter(r["experience_id"] for r in rows)
    assert max(ids.values()) == 1 and before <= set(ids)  # nothing written twice, nothing lost
    assert sorted({r["explorer_step"] for r in rows}) == list(range(1, TOTAL + 1)) and len(rows) == TOTAL * 4
    groups = Counter(r["group_id"] for r in rows)
    assert set(groups.values()) == {2}  # every group whole, once
    # The staged batch went into the buffer once, as step 3, whichever side of the commit the kill fell.
    assert {r["group_id"] for r in rows if r["explorer_step"] == CRASH_STEP} == staged_groups
    assert not [e for e in ContinuationStore(*run.fs(), 0).list() if e.kind == "outbox"]
    # The final model was trained on each explorer step once.
    metrics = [json.loads(line) for line in Path(run.url, "report", "metrics.jsonl").read_text().splitlines()]
    by_step = {
        m["step"]: m for m in metrics if "explorer_steps" in m
    }  # a step trained again after a resume replaces the lost one
    assert sorted(s for t in sorted(by_step) for s in by_step[t]["explorer_steps"]) == list(range(1, TOTAL + 1))
