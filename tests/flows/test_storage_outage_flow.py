"""A whole run on S3 survives a 20 s storage stall mid-run (harness/s3_outage.py's proxy in front of moto).

The stall starts as the first commit record is written (the proxy holds that very request), so
it falls mid-run whatever the machine's speed; the run then finishes every trainer step, and every
explorer step is in the buffer once, whole.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from cli.run import run_config
from harness.runs import small_config
from harness.s3_outage import OutageProxy
from rl_engine.buffer.reader import BufferReader
from rl_engine.config import BufferConfig, validate_config
from rl_engine.storage import open_storage

pytestmark = pytest.mark.slow
STALL_S = 20.0


def test_run_on_s3_survives_a_20s_stall(prefect_server, tiny_model_dir, task_file, s3_bucket):
    url, direct_options = s3_bucket
    total, name = 6, f"outage-{uuid.uuid4().hex[:6]}"
    with OutageProxy(direct_options["client_kwargs"]["endpoint_url"]) as proxy:
        data = small_config(
            tiny_model_dir, task_file, url, name=name, total_steps=total, mode="one_step_off_policy", sync_offset=1
        )
        data["buffer"]["storage"].update(
            options={"client_kwargs": {"endpoint_url": proxy.endpoint}}, outage_timeout_s=60
        )
        cfg = validate_config(data)
        proxy.stall_on(f"PUT /{url.removeprefix('s3://')}/{name}/buffer/_commits/".encode(), STALL_S)
        summary = run_config(cfg)
        ended, stalled_at = time.monotonic(), proxy.triggered_at

    assert stalled_at is not None and ended - stalled_at >= STALL_S - 1  # mid-run, and the run outlived it
    assert summary["final_version"] == total
    reader = BufferReader(*open_storage(f"{url}/{name}", direct_options), BufferConfig(poll_interval_s=0.2))
    rows = reader.read_batch(total * 4, timeout_s=30).to_table().select(["experience_id", "explorer_step"]).to_pylist()
    assert Counter(r["explorer_step"] for r in rows) == {e: 4 for e in range(1, total + 1)}
    assert len({r["experience_id"] for r in rows}) == len(rows) and reader.poll() == 0
