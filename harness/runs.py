"""Small runs for tests and benchmarks: configs that take seconds, partial rollouts per mode, and
the experience rows a run stored, read without project code."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import yaml

from rl_engine.trainer.dist import free_port

# The random tiny model rarely samples EOS: most generations need several 3-token segments.
PARTIAL = {
    "enabled": True,
    "segment_max_tokens": 3,
    "max_response_tokens": 10,
    "repeat_ngram": 2,
    "repeat_threshold": 4,
}
MODES = {
    "synchronous": {"mode": "synchronous"},
    "one_step_off_policy": {"mode": "one_step_off_policy", "sync_offset": 1},
    "fully_async": {"mode": "fully_async", "sync_method": "checkpoint", "max_staleness": 1},
    "multi_explorer": {"mode": "multi_explorer", "count": 2, "max_staleness": 3},
}


def small_config(model_dir: str, task_file: str, storage: str, **sync) -> dict:
    """A run that takes seconds: 2 tasks x 2 rollouts of <= 4 tokens per explorer step."""
    return {
        "name": sync.pop("name", None),
        "model": {"path": model_dir, "max_model_len": 64},
        "taskset": {"path": task_file},
        "algorithm": {"repeat_times": 2},
        "explorer": {
            "count": sync.pop("count", 1),
            "batch_size": 2,
            "sampling": {"max_tokens": 4},
            "engine": {"kv_cache_space_gib": 0.25},
        },
        "buffer": {"storage": {"url": storage}, "read_timeout_s": 120},
        "trainer": {
            "total_steps": sync.pop("total_steps", 6),
            "micro_batch_size": 4,
            "lr": 1e-3,
            "checkpoint_interval": sync.pop("checkpoint_interval", 2),
        },
        "synchronizer": {"collective": {"port": free_port()}, "wait_timeout_s": 120, **sync},
        "monitor": {"artifacts": True},
    }


def partial_config(model_dir: str, task_file: str, storage: str, **sync) -> dict:
    """`small_config` with partial rollouts on (`PARTIAL`)."""
    data = small_config(model_dir, task_file, storage, **sync)
    data["explorer"]["partial"] = dict(PARTIAL)
    return data


def write_config(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def stored_table(run_url: str):
    """Every stored experience row as one Arrow table, read with plain json and pyarrow (no project
    code): the data files commit records name. A writer killed between its data file and its
    record leaves that file behind, never committed (nothing reads it; the step is written again
    on resume). None when nothing is committed."""
    records = [json.loads(p.read_text()) for p in Path(run_url, "buffer", "_commits").glob("*/*.json")]
    files = [str(Path(run_url, "buffer", r["path"])) for r in records]
    return ds.dataset(files, format="ipc").to_table() if files else None


def stored_rows(run_url: str) -> list[dict]:
    """The columns of `stored_table` the kill-and-resume checks read, as dicts."""
    table = stored_table(run_url)
    if table is None:
        return []
    return table.select(
        ["experience_id", "explorer_id", "explorer_step", "group_id", "segments", "finish_reason", "loss_mask"]
    ).to_pylist()
