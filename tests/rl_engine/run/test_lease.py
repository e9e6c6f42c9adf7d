"""The lease (rl_engine/run/lease.py): processes racing for it, exactly one wins, on local disk and on
S3 (moto); a holder that lost it commits nothing; a killed holder's lease is free at once on its
machine and never elsewhere before its ttl (tests/rl_engine/roles/test_entry.py covers a live holder
and the ttl itself).

    .venv/bin/python -m pytest tests/rl_engine/run/test_lease.py -m "slow or not slow"
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench._lease_race import race
from rl_engine.buffer import BufferReader, BufferWriter
from rl_engine.buffer.stats import commit_records
from rl_engine.buffer.synthetic import make_batch
from rl_engine.errors import UserError
from rl_engine.run.lease import LEASE_DIR, Fence, LeaseLost, RunLease, read_lease
from rl_engine.storage import create_exclusive, open_storage

HOLDER = """
import sys, time
from rl_engine.run.lease import RunLease
from rl_engine.storage import open_storage
RunLease(*open_storage(sys.argv[1]), ttl_s=60).acquire()
print("held", flush=True)
time.sleep(120)
"""


# --------------------------------------------------------------------------- exclusive create


def test_create_exclusive_creates_once(tmp_path):
    fs, root = open_storage(str(tmp_path))
    assert create_exclusive(fs, f"{root}/a/x.json", b"first")
    assert not create_exclusive(fs, f"{root}/a/x.json", b"second")
    assert (tmp_path / "a" / "x.json").read_bytes() == b"first"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["x.json"]  # no temp file left


@pytest.mark.slow
def test_create_exclusive_on_s3_is_a_conditional_put(s3_bucket):
    url, opts = s3_bucket
    fs, root = open_storage(url, opts)
    assert create_exclusive(fs, f"{root}/x.json", b"first")
    assert not create_exclusive(fs, f"{root}/x.json", b"second")
    assert fs.cat_file(f"{root}/x.json") == b"first"


@pytest.mark.slow
def test_racing_conditional_puts_on_s3_create_once(s3_bucket, monkeypatch):
    """S3 applies `If-None-Match: *` atomically; moto looks the key up and stores it in two steps,
    so the test server serializes its writes (harness/s3_server.py). With 50 ms between moto's
    look-up and its write, the window two racers need: still exactly one of four racing creates wins each round
    (without the serialization all four did)."""
    import threading

    from moto.s3.models import S3Backend

    look_up = S3Backend.get_object

    def slow_look_up(self, *args, **kwargs):
        found = look_up(self, *args, **kwargs)
        time.sleep(0.05)  # between the look-up and the write: where a second PUT can pass its look-up too
        return found

    monkeypatch.setattr(S3Backend, "get_object", slow_look_up)
    url, opts = s3_bucket
    fs, root = open_storage(url, opts)
    for r in range(5):
        start, won = threading.Barrier(4, timeout=30), []

        def create(i: int, r: int = r, start: threading.Barrier = start, won: list = won) -> None:
            start.wait()
            if create_exclusive(fs, f"{root}/race-{r}.json", f"racer {i}".encode()):
                won.append(i)

        racers = [threading.Thread(target=create, args=(i,)) for i in range(4)]
        for t in racers:
            t.start()
        for t in racers:
            t.join(60)
        assert len(won) == 1, f"round {r}: {len(won)} racers created the same key"
        assert fs.cat_file(f"{root}/race-{r}.json") == f"racer {won[0]}".encode()


# --------------------------------------------------------------------------- races


def test_racing_processes_one_wins_every_time_local(tmp_path):
    wins = race(str(tmp_path), {}, processes=4, rounds=200)
    assert wins == [1] * 200


@pytest.mark.slow
def test_racing_processes_one_wins_every_time_with_slow_writes(tmp_path):
    """Writes that land up to 0.3 s late (a slow disk, a paused process): a lease that writes and
    reads back after 0.2 s gave 2 winners in 2 of 30 such rounds (main before issue 27)."""
    wins = race(str(tmp_path), {}, processes=4, rounds=40, slow_s=0.3)
    assert wins == [1] * 40


@pytest.mark.slow
def test_racing_processes_one_wins_every_time_s3(s3_bucket):
    url, opts = s3_bucket
    wins = race(url, opts, processes=3, rounds=200)
    assert wins == [1] * 200


# --------------------------------------------------------------------------- fencing


def _taken_over(url: str, opts: dict) -> tuple[RunLease, RunLease]:
    """A holder that stopped renewing (paused past its ttl), and the one that took over."""
    old = RunLease(*open_storage(url, opts), ttl_s=0.5).acquire()
    old._done.set()  # paused: no renewals
    old._thread.join(5)
    time.sleep(0.6)
    new = RunLease(*open_storage(url, opts), ttl_s=60).acquire()
    return old, new


def _a_holder_that_lost_its_lease_commits_nothing(url: str, opts: dict) -> None:
    old, new = _taken_over(url, opts)
    try:
        assert (old.generation, new.generation) == (1, 2)
        new.check()
        with pytest.raises(
            LeaseLost, match=r"held lease generation 1, which generation 2 \(pid \d+ on .*\) has taken over"
        ):
            old.check()
        # A role of the old driver got its generation in the start marker: its buffer commits are refused.
        writer = BufferWriter(
            *open_storage(url, opts), 0, before_commit=Fence(*open_storage(url, opts), old.generation).check
        )
        with pytest.raises(LeaseLost):
            writer.write(1, make_batch(8, explorer_id=0, explorer_step=1))
        fresh = BufferWriter(*open_storage(url, opts), 0, before_commit=new.fence().check)
        fresh.write(1, make_batch(8, explorer_id=0, explorer_step=1))
        assert [r["num_rows"] for _, r in commit_records(*open_storage(url, opts))] == [8]
        assert len(BufferReader(*open_storage(url, opts)).read_batch(8, timeout_s=0)) == 8
        old.release()  # marks nothing: the lease is the new holder's
        assert read_lease(*open_storage(url, opts))["holder"] == new.me["holder"] and not read_lease(
            *open_storage(url, opts)
        ).get("released")
    finally:
        new.release()
    assert read_lease(*open_storage(url, opts))["released"]


def test_a_holder_that_lost_its_lease_commits_nothing_local(tmp_path):
    _a_holder_that_lost_its_lease_commits_nothing(str(tmp_path), {})


@pytest.mark.slow
def test_a_holder_that_lost_its_lease_commits_nothing_s3(s3_bucket):
    _a_holder_that_lost_its_lease_commits_nothing(*s3_bucket)


def test_no_lease_no_fence():
    Fence(*open_storage("/nowhere", None), None).check()  # roles driven without a driver (tests, benches) check nothing


def test_older_generations_are_removed(tmp_path):
    for _ in range(3):
        RunLease(*open_storage(str(tmp_path)), ttl_s=60).acquire().release()
    assert sorted(p.name for p in (tmp_path / LEASE_DIR).iterdir()) == ["gen=00000003.json"]


# --------------------------------------------------------------------------- a killed holder


@pytest.fixture
def killed_holder(tmp_path):
    """The lease of a process that held it (ttl 60 s) and was SIGKILLed a moment ago."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"is being run by pid {proc.pid} "):
            RunLease(*open_storage(str(tmp_path)), ttl_s=60).acquire()
    finally:
        proc.kill()
        proc.wait(10)
    return tmp_path


def test_a_killed_holders_lease_is_free_at_once_on_its_machine(killed_holder):
    lease = RunLease(*open_storage(str(killed_holder)), ttl_s=60).acquire()
    try:
        assert read_lease(*open_storage(str(killed_holder)))["holder"] == lease.me["holder"]
    finally:
        lease.release()


def test_a_lease_from_another_machine_waits_for_its_ttl(killed_holder):
    (path,) = (killed_holder / LEASE_DIR).iterdir()
    for field, value in (("boot", 1.0), ("host", "elsewhere")):  # its pid means nothing here
        path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
        with pytest.raises(UserError, match="is being run by pid .* retry in [56]\\d s"):
            RunLease(*open_storage(str(killed_holder)), ttl_s=60).acquire()
