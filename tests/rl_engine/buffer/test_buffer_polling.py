"""Polling cost of BufferReader: a poll lists the last commit_window_s of commits, not the whole run.

The property is counted, not timed: names a poll lists (local disk, memory) and ListObjectsV2
requests and keys (S3, moto on loopback), with 10 vs a few hundred older commits. Records
that show up later than the window, or stamped ahead of the reader's clock, are found by the
full listing; records of the flat layout (runs written before buckets) are still read.
Timings: `python -m bench.buffer` (poll_s_at_10k_over_10).

    .venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_polling.py
"""

from __future__ import annotations

import logging
import os
import time
import types
import uuid

import pytest

import rl_engine.buffer.reader as reader_mod
import rl_engine.buffer.writer as writer_mod
from rl_engine.buffer import BufferReader, BufferTimeout, BufferWriter, _files
from rl_engine.buffer.stats import committed_files
from rl_engine.buffer.synthetic import make_batch
from rl_engine.config import BufferConfig
from rl_engine.storage import open_storage

S = 10**9


def _stamped(monkeypatch, writer: BufferWriter, stamps_ns: list[int], explorer_id: int = 0) -> None:
    """One 1-row commit per stamp, the writer's clock set to it (a writer elsewhere in time)."""
    for i, t in enumerate(stamps_ns):
        monkeypatch.setattr(writer_mod, "time", types.SimpleNamespace(time_ns=lambda t=t: t))
        writer.write(i + 1, make_batch(1, explorer_id=explorer_id, explorer_step=i + 1, id_prefix=f"old{i}"))
    monkeypatch.setattr(writer_mod, "time", time)


def _old_run(monkeypatch, url: str, options: dict, n: int) -> BufferReader:
    """A run with `n` commits one second apart, the newest two minutes old, all consumed."""
    now = time.time_ns()
    _stamped(monkeypatch, BufferWriter(*open_storage(url, options), 0), [now - (120 + n - i) * S for i in range(n)])
    reader = BufferReader(*open_storage(url, options), BufferConfig())
    assert len(reader.read_batch(n, timeout_s=0)) == n  # the first poll lists everything
    return reader


def _count_local_listing(monkeypatch) -> list[int]:
    """Names returned by each directory listing of the buffer (local disk, memory)."""
    counts: list[int] = []
    real = _files.list_names

    def spy(fs, directory):
        names = real(fs, directory)
        counts.append(len(names))
        return names

    monkeypatch.setattr(_files, "list_names", spy)
    return counts


@pytest.mark.parametrize("protocol", ["local", "memory"])
def test_poll_lists_the_window_not_the_run(tmp_path, monkeypatch, protocol):
    listed: dict[int, int] = {}
    for n in (10, 300):
        url = str(tmp_path / f"run{n}") if protocol == "local" else f"memory://poll-{uuid.uuid4().hex[:8]}"
        reader = _old_run(monkeypatch, url, {}, n)
        fresh = BufferWriter(*open_storage(url, {}), 1)
        counts = _count_local_listing(monkeypatch)
        for step in (1, 2, 3):
            fresh.write(step, make_batch(4, explorer_id=1, explorer_step=step))
            assert len(reader.read_batch(4, timeout_s=0)) == 4
            assert reader.poll() == 0
        monkeypatch.undo()
        listed[n] = sum(counts)
        if protocol == "memory":
            reader.fs.rm(reader.root, recursive=True)
    # each poll lists the new commits of the window so far (two polls after each write), nothing older
    assert listed[10] == listed[300] == 2 * (1 + 2 + 3)


def test_window_poll_parses_only_new_names_and_a_rewind_sees_them_again(tmp_path, monkeypatch):
    run = str(tmp_path)
    writer = BufferWriter(*open_storage(run, {}), 0)
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    reader.poll()  # the full listing at start
    writer.write(1, make_batch(4, explorer_step=1))
    before = reader.state_dict()
    assert len(reader.read_batch(4, timeout_s=0)) == 4
    parsed: list[str] = []
    real = _files.parse_record_paths

    def spy(paths):
        paths = list(paths)
        parsed.extend(paths)
        return real(paths)

    monkeypatch.setattr(_files, "parse_record_paths", spy)
    writer.write(2, make_batch(4, explorer_step=2))
    assert len(reader.read_batch(4, timeout_s=0)) == 4
    assert reader.poll() == 0
    assert (
        len(parsed) == 1
    )  # the new record only: the consumed one and the second look at the new one are not parsed again
    reader.load_state_dict(before)  # the same reader rewound: both records are offered again
    assert sorted(x.explorer_step for x in reader.read_batch(8, timeout_s=0).experiences()) == [1] * 4 + [2] * 4


def _count_s3_listing(reader: BufferReader, polls) -> list[list[int]]:
    """Keys returned by each ListObjectsV2 request, per poll (real requests, counted by botocore's event hook)."""
    per_poll: list[list[int]] = []
    hook = lambda parsed, **_: per_poll[-1].append(len(parsed.get("Contents", [])))  # noqa: E731
    events = reader.fs.s3.meta.events
    events.register("after-call.s3.ListObjectsV2", hook)
    try:
        for poll in polls:
            per_poll.append([])
            poll()
    finally:
        events.unregister("after-call.s3.ListObjectsV2", hook)
    return per_poll


@pytest.mark.slow
def test_s3_poll_lists_the_window_not_the_run(s3_bucket, monkeypatch):
    url, options = s3_bucket
    listed: dict[int, list[list[int]]] = {}
    for n in (10, 150):
        run = f"{url}/run{n}"
        reader = _old_run(monkeypatch, run, options, n)
        fresh = BufferWriter(*open_storage(run, options), 1)
        read_new = lambda: (fresh.write(1, make_batch(4, explorer_id=1)), reader.read_batch(4, timeout_s=0))  # noqa: E731
        listed[n] = _count_s3_listing(reader, [reader.poll, read_new, reader.poll])
        assert all(1 <= len(requests) <= 2 for requests in listed[n])  # one listing, two at a prefix boundary
    assert [sum(r) for r in listed[10]] == [sum(r) for r in listed[150]] == [0, 1, 1]  # keys: the window's only
    # what every poll cost before: a listing of everything, growing with the run
    fresh_reader = BufferReader(*open_storage(f"{url}/run150", options), BufferConfig())
    assert [sum(r) for r in _count_s3_listing(fresh_reader, [fresh_reader.poll])] == [151]


@pytest.mark.parametrize("offset_s", [-3600, 3600], ids=["late", "ahead"])
def test_record_outside_the_window_is_found_by_the_full_listing(tmp_path, monkeypatch, caplog, offset_s):
    clock = [0.0]  # the reader's monotonic clock, moved by hand
    monkeypatch.setattr(reader_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    run = str(tmp_path)
    reader = BufferReader(*open_storage(run, {}), BufferConfig(full_listing_interval_s=600))
    reader.poll()  # the full listing at start
    odd = BufferWriter(*open_storage(run, {}), 1)
    _stamped(monkeypatch, odd, [time.time_ns() + offset_s * S], explorer_id=1)
    BufferWriter(*open_storage(run, {}), 0).write(1, make_batch(4))
    before = reader.state_dict()
    assert {x.explorer_id for x in reader.read_batch(4, timeout_s=0).experiences()} == {0}
    with pytest.raises(BufferTimeout):  # outside commit_window_s: not seen by a window's poll
        reader.read_batch(1, timeout_s=0)
    clock[0] += 600
    with caplog.at_level(logging.WARNING, logger="rl_engine.buffer"):
        batch = reader.read_batch(1, timeout_s=0)
    assert [x.explorer_id for x in batch.experiences()] == [1]
    [record] = [p for k, p in _files.list_commits(reader.fs, reader.root) if k.explorer_id == 1]
    assert any(record in r.getMessage() and "commit_window_s" in r.getMessage() for r in caplog.records)
    clock[0] += 600
    with pytest.raises(BufferTimeout):  # exactly once, also after the next full listing
        reader.read_batch(1, timeout_s=0)
    # a reader restored from before lists everything at start: both records, in stamp order
    restored = BufferReader(*open_storage(run, {}), BufferConfig())
    restored.load_state_dict(before)
    order = [x.explorer_id for x in restored.read_batch(5, timeout_s=0).experiences()]
    assert order == ([1] + [0] * 4 if offset_s < 0 else [0] * 4 + [1])


def test_fifo_across_buckets(tmp_path, monkeypatch):
    run = str(tmp_path)
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    reader.poll()
    now = time.time_ns()
    stamps = [now - 35 * S, now - 50 * S, now - 5 * S, now + 20 * S]  # four 10-second buckets, out of order
    _stamped(monkeypatch, BufferWriter(*open_storage(run, {}), 0), stamps)
    assert len({_files.bucket_of(t) for t in stamps}) == 4
    steps = [x.explorer_step for x in reader.read_batch(4, timeout_s=0).experiences()]
    assert steps == [2, 1, 3, 4]


def test_records_of_the_flat_layout_are_read(tmp_path):
    """A run written before buckets (records directly in _commits/) reads and counts as before."""
    run = str(tmp_path)
    w = BufferWriter(*open_storage(run, {}), 0)
    for step in (1, 2):
        w.write(step, make_batch(4, explorer_step=step))
    reader = BufferReader(*open_storage(run, {}), BufferConfig())
    for key, path in _files.list_commits(reader.fs, reader.root)[:1]:
        os.replace(path, os.path.join(_files.commits_dir(reader.root), key.name + ".json"))
    w.write(3, make_batch(4, explorer_step=3))
    assert next(p.rsplit("/", 2)[-2] for _, p in _files.list_commits(reader.fs, reader.root)) == "_commits"
    assert [x.explorer_step for x in reader.read_batch(12, timeout_s=0).experiences()] == [1] * 4 + [2] * 4 + [3] * 4
    assert len(committed_files(*open_storage(run, {}))) == 3
