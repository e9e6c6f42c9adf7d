"""Experience schema: row <-> Arrow round trip, validation errors, trainer tensors.

.venv/bin/python -m pytest tests/rl_engine/test_experience.py
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from rl_engine.experience import (
    EXPERIENCE_SCHEMA,
    FINISH_REASONS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    Experience,
    ExperienceBatch,
    SchemaError,
    version_runs,
)


def _exp(i: int, prompt_len: int = 3, response_len: int = 4, group: str = "g0", **kw) -> Experience:
    # Values exactly representable in float32 so the round trip can compare with ==.
    fields = dict(
        experience_id=f"x{i}",
        task_id=f"t{i // 2}",
        group_id=group,
        explorer_id=i % 3,
        explorer_step=10 + i,
        prompt_ids=list(range(100 + i, 100 + i + prompt_len)),
        response_ids=list(range(200 + i, 200 + i + response_len)),
        logprobs=[-0.5 * (k + 1) for k in range(response_len)],
        versions=[i + k // 2 for k in range(response_len)],
        loss_mask=[1 if k % 3 else 0 for k in range(response_len)],
        reward=0.1 * i,
        reward_components={"correct": float(i), "format": 0.25},
        finish_reason=FINISH_REASONS[i % 4],
        created_at=1_700_000_000.123456 + i,
        started_at=None if i % 2 else 1_699_999_999.5,
        prompt_text=f"prompt {i} ü",
        response_text=f"response {i}",
    )
    fields.update(kw)
    fields.setdefault("segments", version_runs(fields["explorer_step"], fields["versions"]))
    fields.setdefault("num_segments", len(fields["segments"]))
    return Experience(**fields)


def test_round_trip_every_column():
    rows = [_exp(i, prompt_len=1 + i, response_len=i) for i in range(5)]
    table = ExperienceBatch.from_experiences(rows).to_table()
    assert table.schema.equals(EXPERIENCE_SCHEMA, check_metadata=True)
    back = ExperienceBatch.from_table(table).experiences()
    assert back == rows
    # Every schema column is a dataclass field, and vice versa.
    assert [f.name for f in EXPERIENCE_SCHEMA] == [f.name for f in __import__("dataclasses").fields(Experience)]


def test_schema_carries_version_and_docs():
    assert EXPERIENCE_SCHEMA.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert all(f.metadata and f.metadata[b"doc"] for f in EXPERIENCE_SCHEMA)


def test_to_tensors_alignment():
    rows = [
        _exp(0, prompt_len=2, response_len=3, group="a"),
        _exp(1, prompt_len=4, response_len=1, group="b"),
        _exp(2, prompt_len=1, response_len=2, group="a"),
    ]
    t = ExperienceBatch.from_experiences(rows).to_tensors(pad_id=-7)
    assert t["input_ids"].shape == (3, 5) and t["input_ids"].dtype == torch.long
    assert t["input_ids"][0].tolist() == [100, 101, 200, 201, 202]
    assert t["input_ids"][2].tolist() == [102, 202, 203, -7, -7]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert t["response_start"].tolist() == [2, 4, 1]
    assert t["loss_mask"].dtype == torch.float32
    assert t["loss_mask"][0].tolist() == [0, 0, 0, 1, 1]  # mask [0, 1, 1] placed after the prompt
    assert t["behavior_logprobs"][0].tolist() == [0, 0, -0.5, -1.0, -1.5]
    assert t["behavior_logprobs"][1].tolist() == [0, 0, 0, 0, -0.5]
    assert t["versions"][2].tolist() == [-1, 2, 2, -1, -1]
    assert t["rewards"].dtype == torch.float32 and t["rewards"].tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert t["group_index"].tolist() == [0, 1, 0]


def test_min_versions_and_empty_response():
    rows = [_exp(0, response_len=0), _exp(3, response_len=4), _exp(1, response_len=1)]
    batch = ExperienceBatch.from_experiences(rows)
    assert batch.min_versions().tolist() == [-1, 3, 1]
    assert [r.min_version for r in rows] == [-1, 3, 1]


def test_empty_batch_tensors():
    t = ExperienceBatch.empty().to_tensors(pad_id=0)
    assert t["input_ids"].shape == (0, 0) and t["rewards"].shape == (0,)


def _table() -> pa.Table:
    return ExperienceBatch.from_experiences([_exp(0), _exp(1)]).to_table()


def test_version_mismatch_names_source():
    t = _table().replace_schema_metadata({SCHEMA_VERSION_KEY: b"999"})
    with pytest.raises(SchemaError, match=r"part-1\.arrow: experience schema version 999"):
        ExperienceBatch.from_table(t, source="part-1.arrow")
    with pytest.raises(SchemaError, match="no experience schema version"):
        ExperienceBatch.from_table(t.replace_schema_metadata(None), source="f")


def test_missing_column_named():
    t = _table().drop_columns(["logprobs"])
    with pytest.raises(SchemaError, match=r"f\.arrow: column 'logprobs': missing") as info:
        ExperienceBatch.from_table(t, source="f.arrow")
    assert info.value.column == "logprobs" and info.value.source == "f.arrow"


def test_wrong_type_named():
    t = _table()
    i = t.schema.get_field_index("reward")
    t = t.set_column(i, pa.field("reward", pa.string()), pa.array(["1", "2"]))
    with pytest.raises(SchemaError, match=r"column 'reward': has type string, expected double"):
        ExperienceBatch.from_table(t, source="f")


def test_nulls_rejected():
    t = _table()
    i = t.schema.get_field_index("task_id")
    t = t.set_column(i, pa.field("task_id", pa.string()), pa.array(["a", None]))
    with pytest.raises(SchemaError, match=r"column 'task_id': has 1 null"):
        ExperienceBatch.from_table(t, source="f")


def test_misaligned_token_lists_rejected():
    with pytest.raises(SchemaError, match=r"column 'versions': row 0 has a different length"):
        ExperienceBatch.from_experiences([_exp(0, versions=[0])])


def test_unknown_finish_reason_rejected():
    with pytest.raises(SchemaError, match=r"column 'finish_reason': row 1 has 'eos'"):
        ExperienceBatch.from_experiences([_exp(0), _exp(1, finish_reason="eos")])


def test_extra_columns_dropped_and_slicing():
    t = _table().append_column("extra", pa.array([1, 2]))
    batch = ExperienceBatch.from_table(t)
    assert batch.to_table().schema.names == EXPERIENCE_SCHEMA.names
    both = ExperienceBatch.concat([batch, batch.slice(1)])
    assert len(both) == 3
    assert [e.experience_id for e in both.take(np.array([2, 0])).experiences()] == ["x1", "x0"]


def test_version_1_table_reads_with_segments_derived():
    # A buffer written before partial rollouts (schema 1, no `segments`) still reads: one segment per version run.
    t = ExperienceBatch.from_experiences([_exp(i) for i in range(3)]).to_table().drop_columns(["segments"])
    t = t.replace_schema_metadata({SCHEMA_VERSION_KEY: b"1"})
    back = ExperienceBatch.from_table(t, source="old.arrow").experiences()
    assert back[1].segments == [
        {"explorer_step": 11, "version": 1, "start": 0, "end": 2},
        {"explorer_step": 11, "version": 2, "start": 2, "end": 4},
    ]
    assert [e.num_segments for e in back] == [2, 2, 2]


@pytest.mark.parametrize(
    "segments, message",
    [
        (
            [
                {"explorer_step": 3, "version": 1, "start": 0, "end": 1},
                {"explorer_step": 4, "version": 2, "start": 2, "end": 4},
            ],
            "without gaps",
        ),
        ([{"explorer_step": 3, "version": 1, "start": 0, "end": 3}], "without gaps"),  # ends before the response does
        ([{"explorer_step": 3, "version": 1, "start": 0, "end": 4}], "version differs"),  # tokens 2, 3 carry version 2
    ],
)
def test_segments_must_tile_the_response_with_their_versions(segments, message):
    with pytest.raises(SchemaError, match=f"row 0: .*{message}"):
        ExperienceBatch.from_experiences([_exp(1, segments=segments, num_segments=len(segments))])


def test_num_segments_must_count_the_segments():
    with pytest.raises(SchemaError, match="row 0 has 2 segment.* num_segments = 5"):
        ExperienceBatch.from_experiences([_exp(1, num_segments=5)])
