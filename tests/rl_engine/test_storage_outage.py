"""Storage outages: S3 unreachable for a while (stalled or refusing) and a full local disk.

The S3 cases put harness/s3_outage.py's proxy between the buffer and the session's moto server:
a 20 s outage is waited out and every record is read exactly once; an outage past
buffer.storage.outage_timeout_s fails within the limit plus a small margin, naming the URL and
the operation; no object is ever visible half-written. The disk-full case writes the buffer on
a real 2 MiB tmpfs until ENOSPC.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter

import pytest

from harness.s3_outage import buffer_outage_trial
from rl_engine.buffer.reader import BufferReader
from rl_engine.buffer.synthetic import make_batch
from rl_engine.buffer.writer import BufferWriter
from rl_engine.config import BufferConfig, StorageConfig
from rl_engine.storage import StorageFullError, open_storage

OUTAGE_S = 20.0
SHORT_LIMIT_S = 5.0
MARGIN_S = 3.0  # one cut-off attempt and scheduling on a loaded 2-core machine


def test_outage_limit_reaches_the_filesystem():
    cfg = StorageConfig(
        url="s3://b/runs", options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}, outage_timeout_s=7
    )
    fs, root = open_storage(cfg.url, cfg.fs_options())
    assert (fs.outage_timeout_s, root) == (7.0, "b/runs")
    assert (
        open_storage(cfg.url, cfg.options)[0].outage_timeout_s == StorageConfig.model_fields["outage_timeout_s"].default
    )
    with pytest.raises(ValueError, match="set only buffer.storage.outage_timeout_s"):
        StorageConfig(url="s3://b", options={"outage_timeout_s": 3}, outage_timeout_s=7)


def test_checks_before_a_run_wait_seconds_the_run_keeps_its_limit(monkeypatch):
    """Preflight (and start_run's storage check) give a store that does not answer PREFLIGHT_OUTAGE_S,
    or the run's own limit if shorter; the options the run goes on with keep buffer.storage.outage_timeout_s
    (tests/rl_engine/run/test_bad_input.py: a refused endpoint fails preflight in about 5 s, not 2 x 120 s)."""
    import rl_engine.run.storage_checks as pf
    from rl_engine.storage import OUTAGE_KEY

    assert pf.PREFLIGHT_OUTAGE_S <= 10
    cfg = StorageConfig(url="s3://b/runs", options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})
    assert (
        pf._preflight_options(cfg.fs_options())[OUTAGE_KEY] == pf.PREFLIGHT_OUTAGE_S
        and cfg.fs_options()[OUTAGE_KEY] == 120
    )
    assert (
        pf._preflight_options({OUTAGE_KEY: 2.0})[OUTAGE_KEY] == 2.0
        and pf._preflight_options({})[OUTAGE_KEY] == pf.PREFLIGHT_OUTAGE_S
    )
    opened = []
    monkeypatch.setattr(
        pf, "open_for_checks", lambda url, options: opened.append(options[OUTAGE_KEY]) or open_storage(url, options)
    )
    pf.check_reachable("/tmp/rft-local-runs", cfg.fs_options())  # local disk: nothing to wait for
    assert opened == [pf.PREFLIGHT_OUTAGE_S]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stall", "refuse"])
def test_buffer_survives_20s_outage(s3_bucket, s3_server, kind):
    url, _ = s3_bucket
    t = buffer_outage_trial(f"{url}/run", s3_server[0], kind, OUTAGE_S, limit_s=60.0)
    assert t["survived"], t
    assert OUTAGE_S - 1 <= t["write_s"] <= OUTAGE_S + 30, t  # it waited the outage out, then went on
    assert t["read_s"] <= t["write_s"] + 5, t  # the reader, polling across the outage, got steps 2 and 3
    assert (t["lost"], t["duplicated"], t["unexpected"], t["extra_rows"]) == (0, 0, 0, 0), (
        t
    )  # each row read exactly once
    assert t["visible"] == {"steps": [1, 2, 3, 4], "not_whole": []}, t


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stall", "refuse"])
def test_outage_past_limit_fails_naming_url_and_operation(s3_bucket, s3_server, kind):
    url, _ = s3_bucket
    run = f"{url}/run"
    t = buffer_outage_trial(run, s3_server[0], kind, 120.0, limit_s=SHORT_LIMIT_S)
    assert not t["survived"]
    assert SHORT_LIMIT_S - 0.5 <= t["write_s"] <= SHORT_LIMIT_S + MARGIN_S, t
    assert SHORT_LIMIT_S - 0.5 <= t["read_s"] <= SHORT_LIMIT_S + MARGIN_S, t
    assert (
        f"could not write {run}/buffer/explorer=0/step=2/part-" in t["write_error"]
        and "(put_object)" in t["write_error"]
    ), t
    assert "buffer.storage.outage_timeout_s = 5" in t["write_error"] and "endpoint_url" in t["write_error"], t
    assert f"could not list {run}/buffer/_commits" in t["read_error"], t
    # The failed step never became visible (a stalled PUT that landed late is whole and unreferenced);
    # after the outage the same writer and reader go on: steps 1 and 4, each row once.
    assert t["acked_steps"] == [1, 4] and t["visible"] == {"steps": [1, 4], "not_whole": []}, t
    assert (t["lost"], t["duplicated"], t["unexpected"], t["extra_rows"]) == (0, 0, 0, 0), t


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MiB filesystem (tmpfs): writes past it fail with ENOSPC."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=30
    )
    if r.returncode:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_disk_full_names_the_path_and_keeps_committed_data(tiny_disk):
    run = str(tiny_disk / "run")
    writer = BufferWriter(*open_storage(run, {}), explorer_id=0)
    committed = 0
    with pytest.raises(StorageFullError) as err:
        for step in range(1, 1000):  # ~45 KiB a batch: the disk is full long before
            writer.write(step, make_batch(32, explorer_step=step, response_len=256))
            committed = step
    assert 10 < committed < 100, committed
    msg = str(err.value)
    assert f"cannot write {run}/buffer/" in msg and os.strerror(28) in msg and "buffer.storage.url" in msg
    leftovers = [os.path.join(d, f) for d, _, fs in os.walk(run) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    got = BufferReader(*open_storage(run, {}), BufferConfig(poll_interval_s=0.01)).read_batch(
        32 * committed, timeout_s=10
    )
    ids = Counter(got.to_table().column("experience_id").to_pylist())
    assert ids == Counter(f"e0-s{s}-{i}" for s in range(1, committed + 1) for i in range(32))
