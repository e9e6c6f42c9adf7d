"""Buffer writer + reader round trips on local disk, memory:// and S3 (moto on loopback).

.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_io.py          # -m "not slow" skips S3
"""

from __future__ import annotations

import uuid
import zlib

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import xxhash

from rl_engine.buffer import BufferReader, BufferTimeout, BufferWriter, _files
from rl_engine.buffer.synthetic import make_batch, make_experiences
from rl_engine.config import BufferConfig
from rl_engine.experience import ExperienceBatch
from rl_engine.storage import open_storage


def _round_trip(run_url: str, options: dict) -> None:
    written = {}
    for explorer in (0, 1):
        w = BufferWriter(*open_storage(run_url, options), explorer_id=explorer)
        for step in (1, 2):
            exps = make_experiences(10, explorer_id=explorer, explorer_step=step, seed=explorer * 10 + step)
            uri = w.write(step, ExperienceBatch.from_experiences(exps))
            assert f"explorer={explorer}/step={step}/part-" in uri and uri.endswith(".arrow")
            written.update({x.experience_id: x for x in exps})
    reader = BufferReader(*open_storage(run_url, options), BufferConfig(whole_groups=False))
    got = reader.read_batch(40, timeout_s=0).experiences()
    assert {x.experience_id: x for x in got} == written  # every column, every row, once
    assert len(got) == 40
    with pytest.raises(BufferTimeout, match=r"waited 0 s for 1 experiences; only 0 usable"):
        reader.read_batch(1, timeout_s=0)


def test_round_trip_local(tmp_path):
    _round_trip(str(tmp_path / "run"), {})


def test_round_trip_memory():
    _round_trip(f"memory://t-{uuid.uuid4().hex}/run", {})


@pytest.mark.slow
def test_round_trip_s3(s3_bucket):
    url, options = s3_bucket
    _round_trip(f"{url}/runs/r1", options)


def test_fifo_across_writers(tmp_path):
    run = str(tmp_path)
    w0, w1 = BufferWriter(*open_storage(run, {}), 0), BufferWriter(*open_storage(run, {}), 1)
    order = [(w0, 0, 1), (w1, 1, 1), (w0, 0, 2), (w1, 1, 2)]
    for w, e, s in order:
        w.write(s, make_batch(4, explorer_id=e, explorer_step=s))
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    steps = [(x.explorer_id, x.explorer_step) for x in reader.read_batch(16, timeout_s=0).experiences()]
    assert steps == [(e, s) for _, e, s in order for _ in range(4)]


def test_writer_checks_ids(tmp_path):
    w = BufferWriter(*open_storage(str(tmp_path), {}), explorer_id=1)
    with pytest.raises(ValueError, match=r"explorer_id \[0\].*must match"):
        w.write(1, make_batch(2, explorer_id=0, explorer_step=1))
    with pytest.raises(ValueError, match=r"explorer_step \[1\]"):
        w.write(2, make_batch(2, explorer_id=1, explorer_step=1))


def test_uncommitted_files_are_invisible(tmp_path):
    run = str(tmp_path)
    fs, root = open_storage(run)
    # A complete data file with no commit record (writer died before committing) and a temp file.
    _files.write_data(fs, f"{root}/buffer/explorer=0/step=1/part-orphan.arrow", make_batch(4).to_table())
    (tmp_path / "buffer/explorer=0/step=1/.tmp-dead").write_bytes(b"ARROW1 half")
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    with pytest.raises(BufferTimeout):
        reader.read_batch(1, timeout_s=0)
    BufferWriter(*open_storage(run, {}), 0).write(2, make_batch(4, explorer_step=2))
    assert {x.explorer_step for x in reader.read_batch(4, timeout_s=0).experiences()} == {2}


def test_failed_commit_rotates_writer_and_loses_nothing(tmp_path, monkeypatch):
    run = str(tmp_path)
    w = BufferWriter(*open_storage(run, {}), 0)
    w.write(1, make_batch(4, explorer_step=1))
    first_id = w._writer
    real = _files.put_json
    monkeypatch.setattr(_files, "put_json", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        w.write(2, make_batch(4, explorer_step=2))
    monkeypatch.setattr(_files, "put_json", real)
    w.write(3, make_batch(4, explorer_step=3))
    assert w._writer != first_id  # the failed seq's gap belongs to a retired writer id
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    assert [x.explorer_step for x in reader.read_batch(8, timeout_s=0).experiences()] == [1] * 4 + [3] * 4
    assert all(s["upto"] == 1 and not s["done"] for s in reader.state_dict()["consumed"].values())


def test_files_are_plain_arrow(tmp_path):
    """Arrow tools read the buffer without this project: pyarrow.dataset with hive partitions."""
    run = str(tmp_path)
    for e in (0, 1):
        w = BufferWriter(*open_storage(run, {}), e)
        for s in (1, 2):
            w.write(s, make_batch(3, explorer_id=e, explorer_step=s))
    from rl_engine.buffer import save_cursor

    save_cursor(*open_storage(run, {}), 1, {"x": 1})  # JSON under buffer/cursor must not confuse the recipe
    dataset = ds.dataset(f"{run}/buffer", format="arrow", partitioning="hive", ignore_prefixes=[".", "_", "cursor"])
    table = dataset.to_table()
    assert table.num_rows == 12
    assert table.group_by(["explorer", "step"]).aggregate([("reward", "count")]).num_rows == 4
    assert (pa.compute.equal(table["explorer"], table["explorer_id"])).to_pylist() == [True] * 12
    # A single file opens with the plain IPC reader too.
    path = next((tmp_path / "buffer/explorer=1/step=2").glob("part-*.arrow"))
    with pa.ipc.open_file(str(path)) as f:
        assert f.read_all().num_rows == 3


@pytest.mark.parametrize("url", ["local", "memory"])
def test_the_record_holds_size_and_checksum_of_the_bytes_written(tmp_path, url):
    """Local disk streams the file through a checksumming sink, other stores PUT it whole: both
    write pyarrow's own IPC file, and record its size and XXH3 (CRC-32 for format-1 writers)."""
    run = str(tmp_path / "run") if url == "local" else f"memory://t-{uuid.uuid4().hex}/run"
    fs, root = open_storage(run, {})
    table = make_batch(64, response_len=300).to_table()
    expected = _files.table_to_ipc(table).to_pybytes()
    for kind, value in (("xxh3_64", xxhash.xxh3_64_intdigest(expected)), ("crc32", zlib.crc32(expected))):
        path = f"{root}/{kind}.arrow"
        info = _files.write_data(fs, path, table, fsync=False, checksum=kind)
        assert fs.cat_file(path) == expected
        assert info == {"size": len(expected), kind: value}
        assert (
            _files.read_data(fs, path, size=info["size"], checksum=(kind, info[kind]), uri=path)
            .to_table()
            .equals(table)
        )
