"""Synthetic experience batches of a given shape, built with numpy (fast at benchmark sizes).

For tests and benchmarks of anything that moves experiences (buffer, trainer input):

    batch = make_batch(256, prompt_len=512, response_len=1024, explorer_id=0, explorer_step=1)

`make_batch` builds uniform rows fast; `make_experiences` builds varied `Experience` objects that
exercise every column. Rows are deterministic in (seed, id_prefix); ids are `<id_prefix>-<row>`, groups of
`group_size` consecutive rows share a group and task id.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rl_engine.experience import (
    EXPERIENCE_SCHEMA,
    FINISH_REASONS,
    SEGMENT_TYPE,
    Experience,
    ExperienceBatch,
    version_runs,
)

_WORDS = "the quick brown fox jumps over a lazy dog and then computes 17 * 23 = 391 "


def _ragged(values: np.ndarray, length: int, n: int, type_: pa.DataType) -> pa.Array:
    offsets = pa.array(np.arange(0, (n + 1) * length, length, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=type_))


def make_batch(
    n: int,
    *,
    prompt_len: int = 16,
    response_len: int = 32,
    explorer_id: int = 0,
    explorer_step: int = 1,
    group_size: int = 4,
    version: int = 0,
    seed: int = 0,
    id_prefix: str | None = None,
    text_chars_per_token: int = 4,
) -> ExperienceBatch:
    """n experiences with fixed prompt/response lengths, all tokens from policy `version`."""
    rng = np.random.default_rng(seed)
    prefix = id_prefix if id_prefix is not None else f"e{explorer_id}-s{explorer_step}"
    rows = np.arange(n)
    groups = [f"{prefix}-g{i // group_size}" for i in rows]
    reward = rng.integers(0, 2, n).astype(np.float64)
    n_resp = n * response_len

    def text(length: int) -> pa.Array:
        chars = length * text_chars_per_token
        body = (_WORDS * (chars // len(_WORDS) + 1))[:chars]
        return pa.array([f"{i}:{body}" for i in rows], pa.string())

    columns = {
        "experience_id": pa.array([f"{prefix}-{i}" for i in rows], pa.string()),
        "task_id": pa.array(groups, pa.string()),
        "group_id": pa.array(groups, pa.string()),
        "explorer_id": pa.array(np.full(n, explorer_id, dtype=np.int32)),
        "explorer_step": pa.array(np.full(n, explorer_step, dtype=np.int64)),
        "prompt_ids": _ragged(rng.integers(0, 32000, n * prompt_len, dtype=np.int32), prompt_len, n, pa.int32()),
        "response_ids": _ragged(rng.integers(0, 32000, n_resp, dtype=np.int32), response_len, n, pa.int32()),
        "logprobs": _ragged(-rng.exponential(1.0, n_resp).astype(np.float32), response_len, n, pa.float32()),
        "versions": _ragged(np.full(n_resp, version, dtype=np.int32), response_len, n, pa.int32()),
        "loss_mask": _ragged(np.ones(n_resp, dtype=np.int8), response_len, n, pa.int8()),
        "reward": pa.array(reward),
        "reward_components": pa.array(
            [[("correct", r)] for r in reward], EXPERIENCE_SCHEMA.field("reward_components").type
        ),
        "finish_reason": pa.array([FINISH_REASONS[i % 2] for i in rows], pa.string()),
        "num_segments": pa.array(np.ones(n, dtype=np.int32)),
        "segments": pa.array(
            [[{"explorer_step": explorer_step, "version": version, "start": 0, "end": response_len}]] * n,
            pa.list_(SEGMENT_TYPE),
        ),
        "created_at": pa.array(np.full(n, 1.7e9) + rows),
        "started_at": pa.array(np.full(n, 1.7e9) + rows - 1.0),
        "prompt_text": text(prompt_len),
        "response_text": text(response_len),
    }
    table = pa.Table.from_arrays([columns[f.name] for f in EXPERIENCE_SCHEMA], schema=EXPERIENCE_SCHEMA)
    return ExperienceBatch.from_table(table, source="<synthetic>")


def make_experiences(
    n: int,
    *,
    explorer_id: int = 0,
    explorer_step: int = 1,
    group_size: int = 2,
    seed: int = 0,
    id_prefix: str | None = None,
) -> list[Experience]:
    """n varied rows exercising every column: ragged lengths (incl. empty responses), mixed token
    versions, null started_at, several reward components, every finish reason, non-ASCII text.
    Floats are float32-exact so a round trip compares with ==."""
    rng = np.random.default_rng(seed)
    prefix = id_prefix if id_prefix is not None else f"e{explorer_id}-s{explorer_step}"
    out = []
    for i in range(n):
        p, r = int(rng.integers(1, 20)), int(rng.integers(0, 30))
        versions = sorted(rng.integers(0, 5, r).tolist())
        out.append(
            Experience(
                experience_id=f"{prefix}-{i}",
                task_id=f"{prefix}-t{i // group_size}",
                group_id=f"{prefix}-g{i // group_size}",
                explorer_id=explorer_id,
                explorer_step=explorer_step,
                prompt_ids=rng.integers(0, 2**31 - 1, p).tolist(),
                response_ids=rng.integers(0, 50000, r).tolist(),
                logprobs=[float(np.float32(x)) for x in -rng.exponential(1.0, r)],
                versions=versions,
                loss_mask=rng.integers(0, 2, r).tolist(),
                reward=float(rng.normal()),
                reward_components={f"c{k}": float(rng.normal()) for k in range(i % 3)},
                finish_reason=FINISH_REASONS[i % len(FINISH_REASONS)],
                segments=version_runs(
                    explorer_step, versions
                ),  # one per version: mixed versions as under partial rollouts
                num_segments=len(version_runs(explorer_step, versions)),
                created_at=1.7e9 + float(rng.random()),
                started_at=None if i % 2 else 1.6e9 + i,
                prompt_text=f"Q{i}: what is 7·6? ✓",
                response_text=f'A{i}: 42 \n\t"quoted"',
            )
        )
    return out
