"""`rft buffer stats RUN` (rl_engine.buffer.stats.main) and reading the buffer with plain Arrow.

.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_stats.py
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from rl_engine.buffer import BufferReader, BufferWriter, ContinuationStore, _files, save_cursor
from rl_engine.buffer.stats import committed_files, main
from rl_engine.buffer.synthetic import make_batch
from rl_engine.experience import SCHEMA_VERSION_KEY, Experience, ExperienceBatch
from rl_engine.storage import open_storage


def _run(tmp_path: Path) -> str:
    run = str(tmp_path / "run")
    for e in (0, 1):
        w = BufferWriter(*open_storage(run, {}), e)
        for s in (1, 2, 3):
            w.write(s, make_batch(4 * (e + 1), explorer_id=e, explorer_step=s, version=s - 1, response_len=10 + e))
    fs, root = open_storage(run)
    _files.write_data(
        fs, f"{root}/buffer/explorer=0/step=4/part-orphan.arrow", make_batch(2, explorer_step=4).to_table()
    )
    reader = BufferReader(*open_storage(run, {}))
    reader.read_batch(8, timeout_s=0)
    save_cursor(*open_storage(run, {}), 1, reader.state_dict())
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
    assert s["num_segments"] == {"1": 36} and s["continuations"] == []  # no partial rollouts: no store
    assert s["buffer_cursor"] == {
        "trainer_step": 1,
        "consumed": 8,
        "dropped_stale": 0,
        "skipped_corrupt": 0,
        "unread": 28,
    }
    assert s["trainer_state"] is None  # no trainer ran: nothing under trainer_state/


def test_stats_reads_the_newest_committed_trainer_state_beside_a_buffer_cursor(tmp_path, capsys):
    """The trainer keeps its cursor in trainer_state/step=<t>/state.json (`extra.cursor`, written
    by DeepSpeedTrainer.save_state); stats reads the newest state with COMMITTED, as a resume
    does, and shows a buffer/cursor/ one as well, each labelled with where it came from. A real
    run's: tests/flows/test_operations.py::test_buffer_stats_reports_the_finished_runs_trainer_state."""
    run = _run(tmp_path)  # its buffer/cursor/ holds step 1: 8 consumed
    reader = BufferReader(*open_storage(run, {}))
    reader.read_batch(12, timeout_s=0)
    for step, committed in ((2, True), (3, False)):  # step 3's save did not finish: not loaded
        d = Path(run, "trainer_state", f"step={step}")
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"version": step, "extra": {"cursor": reader.state_dict()}}))
        if committed:
            (d / "COMMITTED").write_text(json.dumps({"version": step}))
    assert main([run, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["trainer_state"] == {
        "trainer_step": 2,
        "version": 2,
        "path": "trainer_state/step=2",
        "consumed": 12,
        "dropped_stale": 0,
        "skipped_corrupt": 0,
        "unread": 24,
    }
    assert s["buffer_cursor"]["trainer_step"] == 1 and s["buffer_cursor"]["consumed"] == 8
    assert main([run]) == 0
    out = capsys.readouterr().out
    assert (
        "trainer state:    trainer_state/step=2 (version 2): 12 consumed, 0 dropped as stale, 0 corrupt files skipped;"
        " 24 committed experiences not read yet" in out
    )
    assert "buffer cursor:    buffer/cursor/ step 1: 8 consumed" in out and "none committed" not in out


def test_stats_text_and_corrupt(tmp_path, capsys):
    run = _run(tmp_path)
    victim = Path(committed_files(*open_storage(run))[0])
    victim.write_bytes(victim.read_bytes()[:-1])
    assert main([run]) == 0
    out = capsys.readouterr().out
    assert "32 experiences in 6 committed files (1 corrupt, 1 written but not committed)" in out
    assert f"corrupt: file://{victim}: size" in out
    assert "reward:" in out and "finish reasons:   length 16 (50%)  stop 16 (50%)" in out
    assert (
        "trainer state:    none committed yet" in out and "buffer cursor:    buffer/cursor/ step 1: 8 consumed" in out
    )
    assert "num segments:     1: 32 (100%)" in out and "continuations:    none (no partial rollouts pending)" in out


def test_stats_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main([str(tmp_path), "--storage-options", "[1]"]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_committed_files_open_with_pyarrow_dataset(tmp_path):
    run = _run(tmp_path)
    files = committed_files(*open_storage(run))
    assert len(files) == 6 and not any("orphan" in f for f in files)
    assert ds.dataset(files, format="arrow").count_rows() == 36
    # The whole-directory recipe sees every complete file, the uncommitted orphan included.
    assert (
        ds.dataset(
            f"{run}/buffer", format="arrow", partitioning="hive", ignore_prefixes=[".", "_", "cursor"]
        ).count_rows()
        == 38
    )


# --------------------------------------------------------------------------- partial rollouts

_ids = itertools.count()


def _exp(
    group: str, finish: str, steps: list[int], *, step: int | None = None, explorer_id: int = 0, tokens: int = 2
) -> Experience:
    """A row whose segments were generated in explorer steps `steps` (2 tokens each, version step - 1)."""
    segments = [
        {"explorer_step": s, "version": s - 1, "start": i * tokens, "end": (i + 1) * tokens}
        for i, s in enumerate(steps)
    ]
    versions = [s - 1 for s in steps for _ in range(tokens)]
    n = len(versions)
    return Experience(
        experience_id=f"{group}-{next(_ids)}",
        task_id=group,
        group_id=group,
        explorer_id=explorer_id,
        explorer_step=step if step is not None else steps[-1],
        prompt_ids=[1, 2],
        response_ids=list(range(3, 3 + n)),
        logprobs=[-0.5] * n,
        versions=versions,
        loss_mask=[1] * n,
        reward=1.0,
        finish_reason=finish,
        segments=segments,
    )


def _partial_run(tmp_path: Path) -> str:
    """Explorer 0 crashed between stage and commit of step 3; explorer 1 between commit and retire of step 2."""
    run = str(tmp_path / "run")
    w0 = BufferWriter(*open_storage(run, {}), 0)
    w0.write(1, ExperienceBatch.from_experiences([_exp("a", "stop", [1]), _exp("a", "stop", [1])]))
    w0.write(
        2,
        ExperienceBatch.from_experiences(
            [_exp("b", "repeat", [1, 2], step=2), _exp("b", "truncated", [1, 2, 2], step=2)]
        ),
    )
    # A file written before partial rollouts (schema 1, no segments): two version runs -> 2 segments on read.
    old = ExperienceBatch.from_experiences([_exp("c", "stop", [2, 3], step=2)]).to_table().drop_columns(["segments"])
    w0.write(2, ExperienceBatch(old.replace_schema_metadata({SCHEMA_VERSION_KEY: b"1"})))
    store0 = ContinuationStore(*open_storage(run, {}), 0, fsync=False)
    store0.save(
        ExperienceBatch.from_experiences([_exp("old", "length", [1])]), explorer_step=1
    )  # retired by the stage below
    outbox = ExperienceBatch.from_experiences([_exp("d", "stop", [3], step=3), _exp("d", "stop", [2, 3], step=3)])
    pending = ExperienceBatch.from_experiences(
        [
            _exp("e", "length", [1, 2, 3]),  # cut: 6 tokens, oldest segment from step 1
            _exp("e", "stop", [2]),  # finished, waiting for its group
            _exp("f", "length", [3]),
        ]
    )
    store0.commit([(outbox, "outbox"), (pending, "pending")], explorer_step=3, retire=[store0.list()[0].id])
    w1 = BufferWriter(*open_storage(run, {}), 1)
    for e in (1, 2):
        batch = ExperienceBatch.from_experiences([_exp(f"x{e}", "stop", [e], explorer_id=1)])
        ContinuationStore(*open_storage(run, {}), 1, fsync=False).commit([(batch, "outbox")], explorer_step=e)
        w1.write(e, batch)
    store1 = ContinuationStore(*open_storage(run, {}), 1, fsync=False)
    store1.retire([store1.list()[0].id])  # step 1's outbox retired; step 2's stays
    return run


def _listing(run: str) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(Path(run).rglob("*")) if p.is_file()}


def test_stats_pending_continuations_and_segment_mix_json(tmp_path, capsys):
    run = _partial_run(tmp_path)
    before = _listing(run)
    assert main([run, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert _listing(run) == before  # read only
    assert s["experiences"] == 7
    assert s["finish_reasons"] == {"repeat": 1, "stop": 5, "truncated": 1}
    assert s["num_segments"] == {"1": 4, "2": 2, "3": 1}  # the version-1 row counts 2
    c0, c1 = s["continuations"]
    manifest0 = f"file://{tmp_path}/run/continuations/explorer=0/_manifest.json"
    assert c0 == {
        "explorer": 0,
        "manifest": manifest0,
        "pending_groups": 2,
        "pending_generations": 3,
        "cut_generations": 2,
        "finished_waiting": 1,
        "tokens": 6 + 2 + 2,
        "oldest_segment_step": 1,
        "outbox": [{"explorer_step": 3, "experiences": 2, "status": "staged"}],
        "last_committed_step": 2,
    }
    assert c1["explorer"] == 1 and c1["pending_generations"] == 0 and c1["oldest_segment_step"] is None
    assert c1["outbox"] == [{"explorer_step": 2, "experiences": 1, "status": "committed"}]


def test_stats_pending_continuations_text(tmp_path, capsys):
    run = _partial_run(tmp_path)
    assert main([run]) == 0
    out = capsys.readouterr().out
    assert "finish reasons:   repeat 1 (14%)  stop 5 (71%)  truncated 1 (14%)" in out
    assert "num segments:     1: 4 (57%)  2: 2 (29%)  3: 1 (14%)" in out
    assert (
        "  explorer 0: 2 groups, 3 generations (2 cut, 1 finished and waiting for their group), 10 tokens so far, oldest pending segment from step 1\n"
        f"    manifest: file://{tmp_path}/run/continuations/explorer=0/_manifest.json\n"
        "    outbox: step 3 (2 experiences) staged, not committed to the buffer (a write in progress, or a crash between stage and commit; a resume writes it as step 3)\n"
        "  explorer 1: nothing pending\n"
    ) in out
    assert "    outbox: step 2 (1 experiences) committed to the buffer, outbox not retired yet" in out


def test_stats_names_an_unreadable_continuation_manifest(tmp_path, capsys):
    run = _partial_run(tmp_path)
    (tmp_path / "run/continuations/explorer=1/_manifest.json").write_text("{not json")
    assert main([run, "--json"]) == 0
    c0, c1 = json.loads(capsys.readouterr().out)["continuations"]
    assert (
        c0["pending_groups"] == 2
        and "unreadable continuation manifest" in c1["error"]
        and c1["manifest"].endswith("explorer=1/_manifest.json")
    )


def test_stats_outbox_ahead_of_the_buffer(tmp_path, capsys):
    # A staged step 2 with no step 1 committed: the store and the buffer disagree, as a resume would say.
    run = str(tmp_path / "run")
    ContinuationStore(*open_storage(run, {}), 3, fsync=False).commit(
        [(ExperienceBatch.from_experiences([_exp("z", "stop", [2], explorer_id=3)]), "outbox")], explorer_step=2
    )
    assert main([run]) == 0
    out = capsys.readouterr().out
    assert "0 experiences in 0 committed files" in out
    assert (
        "    outbox: step 2 (1 experiences) staged, but the buffer's last committed step of this explorer is 0: a resume refuses"
        in out
    )


@pytest.mark.slow
def test_stats_module_entry_point_on_s3(s3_bucket):
    url, options = s3_bucket
    run = f"{url}/r"
    BufferWriter(*open_storage(run, options), 0).write(1, make_batch(4))
    ContinuationStore(*open_storage(run, options), 2).save(
        ExperienceBatch.from_experiences([_exp("p", "length", [1, 2])]), explorer_step=2
    )
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-m", "rl_engine.buffer.stats", run, "--storage-options", json.dumps(options)],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "4 experiences in 1 committed files" in proc.stdout
    assert (
        "  explorer 2: 1 groups, 1 generations (1 cut, 0 finished and waiting for their group), 4 tokens so far, oldest pending segment from step 1"
        in proc.stdout
    )
    assert f"    manifest: {run}/continuations/explorer=2/_manifest.json" in proc.stdout
