"""BufferReader selection rules: whole groups, staleness, corrupt and invalid files, late commits.

.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_reader.py
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rl_engine.buffer import BufferReader, BufferTimeout, BufferWriter, CorruptFileError, _files
from rl_engine.buffer.synthetic import make_batch
from rl_engine.config import BufferConfig
from rl_engine.experience import SCHEMA_VERSION_KEY, ExperienceBatch, version_runs
from rl_engine.storage import open_storage


def _ids(batch: ExperienceBatch) -> list[str]:
    return [str(x) for x in batch.column("experience_id")]


def test_whole_groups_never_split(tmp_path):
    run = str(tmp_path)
    w = BufferWriter(*open_storage(run, {}), 0)
    w.write(1, make_batch(6, group_size=3, explorer_step=1))  # groups g0, g1 of 3
    w.write(2, make_batch(4, group_size=2, explorer_step=2))  # groups g0, g1 of 2
    reader = BufferReader(*open_storage(run, {}), BufferConfig(whole_groups=True))
    # FIFO by group, skipping a group that does not fit: s1-g0 (3), s1-g1 (3 > 2 left) waits, s2-g0 (2).
    b = reader.read_batch(5, timeout_s=0)
    assert _ids(b) == ["e0-s1-0", "e0-s1-1", "e0-s1-2", "e0-s2-0", "e0-s2-1"]
    b = reader.read_batch(5, timeout_s=0)
    assert _ids(b) == ["e0-s1-3", "e0-s1-4", "e0-s1-5", "e0-s2-2", "e0-s2-3"]


def test_a_file_taken_whole_keeps_its_row_order_and_one_taken_in_parts_goes_group_by_group(tmp_path):
    run = str(tmp_path)
    w = BufferWriter(*open_storage(run, {}), 0)
    for step in (1, 2):  # rows 0..3 in groups g0 g1 g0 g1: interleaved, as no explorer writes them
        t = make_batch(4, group_size=2, explorer_step=step).to_table()
        w.write(
            step,
            ExperienceBatch(
                t.set_column(t.schema.get_field_index("group_id"), "group_id", pa.array(["g0", "g1", "g0", "g1"]))
            ),
        )
    reader = BufferReader(*open_storage(run, {}), BufferConfig(whole_groups=True))
    assert _ids(reader.read_batch(4, timeout_s=0)) == ["e0-s1-0", "e0-s1-1", "e0-s1-2", "e0-s1-3"]
    assert _ids(reader.read_batch(2, timeout_s=0)) == ["e0-s2-0", "e0-s2-2"]  # g0 whole, first appearing
    assert _ids(reader.read_batch(2, timeout_s=0)) == ["e0-s2-1", "e0-s2-3"]


def test_group_larger_than_batch_is_an_error(tmp_path):
    BufferWriter(*open_storage(str(tmp_path), {}), 0).write(1, make_batch(4, group_size=4))
    with pytest.raises(ValueError, match="group of 4 experiences does not fit a batch of 3"):
        BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(whole_groups=True)).read_batch(3, timeout_s=0)
    # Without whole groups the same rows split freely.
    assert (
        len(BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(whole_groups=False)).read_batch(3, timeout_s=0))
        == 3
    )


def test_stale_experiences_dropped_and_counted(tmp_path):
    run = str(tmp_path)
    w = BufferWriter(*open_storage(run, {}), 0)
    for step, version in [(1, 0), (2, 1), (3, 2), (4, 3)]:
        w.write(step, make_batch(4, explorer_step=step, version=version, group_size=2))
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    b = reader.read_batch(8, trainer_version=3, max_staleness=1, timeout_s=0)
    assert sorted(set(b.min_versions().tolist())) == [2, 3]
    assert reader.stats["dropped_stale"] == 8 and reader.stats["consumed"] == 8
    with pytest.raises(BufferTimeout, match=r"trainer version 3, max_staleness 1.*8 dropped as stale"):
        reader.read_batch(2, trainer_version=3, max_staleness=1, timeout_s=0)


def test_rows_dropped_while_waiting_are_reported_before_the_wait_ends(tmp_path):
    # The explorers make up for dropped rows only once they hear of them: a reader that told them
    # after its batch would wait for rows nobody makes (decoupled modes stop at the run's end).
    run = str(tmp_path)
    BufferWriter(*open_storage(run, {}), 0).write(1, make_batch(4, explorer_step=1, version=0, group_size=2))
    reader = BufferReader(*open_storage(run, {}), BufferConfig(poll_interval_s=0.05))
    seen: list[int] = []
    with pytest.raises(BufferTimeout):
        reader.read_batch(
            4,
            trainer_version=3,
            max_staleness=1,
            timeout_s=0.3,
            on_wait=lambda: seen.append(reader.stats["dropped_stale"]),
        )
    assert seen and seen[0] == 4  # the first pause already knows


def test_group_with_one_stale_member_dropped_whole(tmp_path):
    run = str(tmp_path)
    t = make_batch(4, group_size=2, version=5).to_table()
    versions = [[5] * 32, [1] + [5] * 31, [5] * 32, [5] * 32]
    t = t.set_column(
        t.schema.get_field_index("versions"), t.schema.field("versions"), pa.array(versions, pa.list_(pa.int32()))
    )
    segments = [version_runs(1, v) for v in versions]
    t = t.set_column(
        t.schema.get_field_index("segments"),
        t.schema.field("segments"),
        pa.array(segments, t.schema.field("segments").type),
    )
    t = t.set_column(
        t.schema.get_field_index("num_segments"),
        t.schema.field("num_segments"),
        pa.array([len(x) for x in segments], pa.int32()),
    )
    BufferWriter(*open_storage(run, {}), 0).write(1, ExperienceBatch.from_table(t))
    reader = BufferReader(*open_storage(run, {}), BufferConfig(whole_groups=True))
    assert _ids(reader.read_batch(2, trainer_version=5, max_staleness=2, timeout_s=0)) == ["e0-s1-2", "e0-s1-3"]
    assert reader.stats["dropped_stale"] == 2


def test_staleness_needs_the_trainer_version(tmp_path):
    with pytest.raises(ValueError, match="pass trainer_version too"):
        BufferReader(*open_storage(str(tmp_path), {})).read_batch(1, max_staleness=3)
    BufferWriter(*open_storage(str(tmp_path), {}), 0).write(1, make_batch(4, version=0))
    # A version without a bound filters nothing.
    assert len(BufferReader(*open_storage(str(tmp_path), {})).read_batch(4, trainer_version=100, timeout_s=0)) == 4


# --------------------------------------------------------------------------- corrupt / invalid files


def _three_files(run: str) -> list[str]:
    w = BufferWriter(*open_storage(run, {}), 0)
    return [w.write(s, make_batch(4, explorer_step=s)) for s in (1, 2, 3)]


def _local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of the column data: still parses
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [(_truncate, "truncated"), (_flip_byte, "checksum mismatch")])
def test_corrupt_file_fails_with_path(tmp_path, damage, reason):
    uris = _three_files(str(tmp_path))
    damage(_local(uris[1]))
    reader = BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(on_corrupt="fail"))
    assert len(reader.read_batch(4, timeout_s=0)) == 4  # the file before it is fine
    with pytest.raises(CorruptFileError, match=reason) as info:
        reader.read_batch(4, timeout_s=0)
    assert info.value.path == uris[1] and uris[1] in str(info.value)


@pytest.mark.parametrize("damage", [_truncate, _flip_byte])
def test_corrupt_file_skipped_and_reported(tmp_path, damage):
    uris = _three_files(str(tmp_path))
    damage(_local(uris[1]))
    reader = BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(on_corrupt="skip"))
    assert [x.explorer_step for x in reader.read_batch(8, timeout_s=0).experiences()] == [1] * 4 + [3] * 4
    assert reader.stats["skipped_corrupt"] == 1 and reader.stats["skipped_corrupt_rows"] == 4
    assert reader.stats["corrupt_files"] == [uris[1]]
    # The skip is part of the cursor: a restored reader does not re-report it.
    again = BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(on_corrupt="fail"))
    again.load_state_dict(reader.state_dict())
    assert again.stats["corrupt_files"] == [uris[1]]


def _committed_invalid(run: str, table: pa.Table) -> str:
    # ExperienceBatch(table) skips validation on purpose: a writer of another version wrote this.
    return BufferWriter(*open_storage(run, {}), 0).write(1, ExperienceBatch(table))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.replace_schema_metadata({SCHEMA_VERSION_KEY: b"9"}),
            r"experience schema version 9, this code reads versions 1 to 2",
        ),
        (lambda t: t.drop_columns(["logprobs"]), r"column 'logprobs': missing"),
        (
            lambda t: t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(np.zeros(4, np.float32))),
            r"column 'reward': has type float, expected double",
        ),
    ],
)
def test_invalid_committed_file_names_file_and_column(tmp_path, edit, message):
    uri = _committed_invalid(str(tmp_path), edit(make_batch(4).to_table()))
    with pytest.raises(CorruptFileError, match=message) as info:
        BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(on_corrupt="fail")).read_batch(4, timeout_s=0)
    assert str(info.value).startswith(uri)


# --------------------------------------------------------------------------- late commits


def test_late_commit_with_earlier_key_is_read_once(tmp_path, monkeypatch):
    """A record that shows up after later ones were consumed is still offered, exactly once."""
    import rl_engine.buffer.writer as writer_mod

    run = str(tmp_path)
    early, late = BufferWriter(*open_storage(run, {}), 0), BufferWriter(*open_storage(run, {}), 1)
    late.write(1, make_batch(4, explorer_id=1))
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    assert {x.explorer_id for x in reader.read_batch(4, timeout_s=0).experiences()} == {1}
    before_late = reader.state_dict()
    # explorer 0's commit carries a timestamp older than the one already consumed (slow PUT, lagging
    # listing), within buffer.commit_window_s (later ones: test_buffer_polling.py)
    consumed_stamp = _files.list_commits(reader.fs, reader.root)[0][0].time_ns
    monkeypatch.setattr(writer_mod, "time", types.SimpleNamespace(time_ns=lambda: consumed_stamp - 5 * 10**9))
    early.write(1, make_batch(4, explorer_id=0))
    assert {x.explorer_id for x in reader.read_batch(4, timeout_s=0).experiences()} == {0}
    with pytest.raises(BufferTimeout):
        reader.read_batch(1, timeout_s=0)
    # A trainer restored from before it appeared gets it; one restored from after does not.
    restored = BufferReader(*open_storage(run, {}), BufferConfig())
    restored.load_state_dict(before_late)
    assert {x.explorer_id for x in restored.read_batch(4, timeout_s=0).experiences()} == {0}
    with pytest.raises(BufferTimeout):
        restored.read_batch(1, timeout_s=0)


def test_blocks_until_enough_is_committed(tmp_path, monkeypatch):
    import threading

    import rl_engine.board as poll_mod  # read_batch waits in rl_engine.board.poll_until, on wait_news

    run = str(tmp_path)
    w = BufferWriter(*open_storage(run, {}), 0)
    w.write(1, make_batch(4, explorer_step=1))
    waiting = threading.Event()
    real_wait = poll_mod.wait_news

    def wait_news(*args, **kwargs):  # the reader's pause, with a hook telling us it is waiting
        waiting.set()
        real_wait(*args, **kwargs)

    monkeypatch.setattr(poll_mod, "wait_news", wait_news)
    writer = threading.Thread(target=lambda: (waiting.wait(30), w.write(2, make_batch(4, explorer_step=2))))
    writer.start()
    batch = BufferReader(*open_storage(run, {}), BufferConfig(poll_interval_s=0.01)).read_batch(8, timeout_s=60)
    writer.join()
    assert waiting.is_set() and [x.explorer_step for x in batch.experiences()] == [1] * 4 + [2] * 4


def test_crc32_records_of_format_1_still_verified(tmp_path):
    """Records written before XXH3 (format 1) carry CRC-32, which the reader still checks."""
    import json
    import zlib

    uris = _three_files(str(tmp_path))
    for record in (tmp_path / "buffer/_commits").rglob("*.json"):
        rec = json.loads(record.read_text())
        del rec["xxh3_64"]
        rec.update(format=1, crc32=zlib.crc32((tmp_path / "buffer" / rec["path"]).read_bytes()) & 0xFFFFFFFF)
        record.write_text(json.dumps(rec))
    assert [
        x.explorer_step
        for x in BufferReader(*open_storage(str(tmp_path), {})).read_batch(12, timeout_s=0).experiences()
    ] == [1] * 4 + [2] * 4 + [3] * 4
    _flip_byte(_local(uris[1]))
    reader = BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(on_corrupt="fail"))
    reader.read_batch(4, timeout_s=0)
    with pytest.raises(CorruptFileError, match="checksum mismatch"):
        reader.read_batch(4, timeout_s=0)


def test_rows_checked_when_the_checksum_is_not(tmp_path):
    """A verified file holds the bytes of a batch validated when it was built: its rows are not
    checked again. Unverified, they are (here a row whose logprobs miss a token)."""
    t = make_batch(4).to_table()
    short = [lp[:-1] if i == 2 else lp for i, lp in enumerate(t.column("logprobs").to_pylist())]
    uri = _committed_invalid(
        str(tmp_path),
        t.set_column(
            t.schema.get_field_index("logprobs"), t.schema.field("logprobs"), pa.array(short, pa.list_(pa.float32()))
        ),
    )
    with pytest.raises(CorruptFileError, match="column 'logprobs': row 2 has a different length") as info:
        BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(verify_checksums=False)).read_batch(4, timeout_s=0)
    assert str(info.value).startswith(uri)
    assert len(BufferReader(*open_storage(str(tmp_path), {})).read_batch(4, timeout_s=0)) == 4


def test_without_crc_check_size_and_structure_still_checked(tmp_path):
    uris = _three_files(str(tmp_path))
    _truncate(_local(uris[0]))
    with pytest.raises(CorruptFileError, match="truncated"):
        BufferReader(*open_storage(str(tmp_path), {}), BufferConfig(verify_checksums=False)).read_batch(4, timeout_s=0)


# --------------------------------------------------------------------------- batch order (decoupled modes)


def _commit(run: str, explorer: int, step: int, version: int) -> None:
    BufferWriter(*open_storage(run, {}), explorer).write(
        step, make_batch(4, explorer_id=explorer, explorer_step=step, version=version)
    )


def test_batch_order_waits_for_a_batch_committed_late(tmp_path):
    """Two explorers: batch 1 (explorer 0, step 1) commits after batch 2 (explorer 1, step 1). The
    trainer gets batch 1 first and waits for it; in commit order it would get batch 2 first."""
    run = str(tmp_path)
    _commit(run, 1, 1, 0)  # batch 2
    reader = BufferReader(*open_storage(run, {}), BufferConfig(), explorers=2)
    with pytest.raises(BufferTimeout, match="waiting for batch 1"):
        reader.read_batch(4, timeout_s=0)
    _commit(run, 0, 1, 0)  # batch 1, late
    _commit(run, 0, 2, 0)  # batch 3
    assert [_ids(reader.read_batch(4, timeout_s=0))[0] for _ in range(3)] == ["e0-s1-0", "e1-s1-0", "e0-s2-0"]
    assert [_ids(BufferReader(*open_storage(run, {}), BufferConfig()).read_batch(4, timeout_s=0))[0]] == [
        "e1-s1-0"
    ]  # commit order


def test_batch_order_trains_what_admission_admitted_within_the_bound(tmp_path):
    """max_staleness 1, one batch per trainer step: batch b may start at version b - 2 (admission).
    Batch 2 (explorer 1, version 0) commits after batches 3 and 4: in commit order the trainer
    would train 3 and 4 at versions 1, 2 and then drop batch 2 at version 3 (3 - 0 > 1); in batch
    order it trains batch 2 at version 1, nothing dropped."""
    run = str(tmp_path)
    _commit(run, 0, 1, 0)  # batch 1
    _commit(run, 0, 2, 1)  # batch 3
    _commit(run, 1, 2, 2)  # batch 4
    _commit(run, 1, 1, 0)  # batch 2, committed last
    for reader, dropped in (
        (BufferReader(*open_storage(run, {}), BufferConfig(), explorers=2), 0),
        (BufferReader(*open_storage(run, {}), BufferConfig()), 4),
    ):
        got = []
        for t in range(4):
            try:
                got.append(_ids(reader.read_batch(4, trainer_version=t, max_staleness=1, timeout_s=0))[0])
            except BufferTimeout:
                break
        assert reader.stats["dropped_stale"] == dropped
        if not dropped:
            assert got == ["e0-s1-0", "e1-s1-0", "e0-s2-0", "e1-s2-0"]


def test_batch_order_cursor_round_trip(tmp_path):
    run = str(tmp_path)
    for e, s in ((0, 1), (1, 1), (0, 2), (1, 2)):
        _commit(run, e, s, 0)
    reader = BufferReader(*open_storage(run, {}), BufferConfig(), explorers=2)
    reader.read_batch(4, timeout_s=0)
    state = reader.state_dict()
    assert state["batch_order"] == {"next": 2, "finished": []}
    # Resumed from that cursor: batch 2, then 3.
    resumed = BufferReader(*open_storage(run, {}), BufferConfig(), explorers=2)
    resumed.load_state_dict(state)
    assert _ids(resumed.read_batch(4, trainer_version=5, max_staleness=10, timeout_s=0))[0] == "e1-s1-0"
    assert _ids(resumed.read_batch(4, timeout_s=0))[0] == "e0-s2-0"
    # A cursor saved in commit order (before batch order) keeps commit order for the rest of the run.
    legacy = BufferReader(*open_storage(run, {}), BufferConfig(), explorers=2)
    legacy.load_state_dict({k: v for k, v in state.items() if k != "batch_order"})
    assert _ids(legacy.read_batch(4, timeout_s=0))[0] == "e1-s1-0" and "batch_order" not in legacy.state_dict()


def test_batch_order_moves_past_a_batch_dropped_as_stale_while_waiting(tmp_path):
    run = str(tmp_path)
    _commit(run, 0, 1, 0)  # batch 1
    _commit(run, 0, 2, 0)  # batch 3, stale at version 5
    reader = BufferReader(*open_storage(run, {}), BufferConfig(), explorers=2)
    assert _ids(reader.read_batch(4, timeout_s=0))[0] == "e0-s1-0"
    _commit(run, 1, 1, 0)  # batch 2 arrives, stale too
    _commit(run, 1, 2, 5)  # batch 4, fresh
    assert _ids(reader.read_batch(4, trainer_version=5, max_staleness=1, timeout_s=0))[0] == "e1-s2-0"
    assert reader.stats["dropped_stale"] == 8 and reader.state_dict()["batch_order"] == {"next": 5, "finished": []}
