"""The Experience: one Arrow schema for every trajectory the explorers write and the trainer reads.

`EXPERIENCE_SCHEMA` is the single definition (buffer files, continuation files and the
trainer all use it). Its metadata carries `SCHEMA_VERSION`; readers reject other versions.
`Experience` is one row as a Python object (explorers build these); `ExperienceBatch` wraps an
Arrow table (columnar, zero-copy from files) and converts to rows, back to Arrow, and to the
padded tensors the trainer consumes (`to_tensors`).

    batch = ExperienceBatch.from_experiences([Experience(...), ...])
    batch.to_table()                    # pa.Table with EXPERIENCE_SCHEMA
    ExperienceBatch.from_table(t, source="buffer/.../part-x.arrow")   # validated
    batch.to_tensors(pad_id=0)["input_ids"]                            # [B, L] long

Tests: `.venv/bin/python -m pytest tests/rl_engine/test_experience.py`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rl_engine.errors import UserError

SCHEMA_VERSION = 2  # 2 added `segments`; version-1 tables are read (upgraded) too
SCHEMA_VERSION_KEY = b"rft.schema_version"
FINISH_REASONS = ("stop", "length", "repeat", "truncated")


def _f(name: str, type_: pa.DataType, doc: str, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={b"doc": doc.encode()})


# One segment: the response tokens [start, end) generated in explorer step `explorer_step` by `version`.
SEGMENT_TYPE = pa.struct(
    [("explorer_step", pa.int64()), ("version", pa.int32()), ("start", pa.int32()), ("end", pa.int32())]
)

# One field per column, each with its meaning. Token lists are int32 (vocabularies < 2**31);
# per-token logprobs are float32 (they dominate file size, and vLLM computes them in float32).
EXPERIENCE_SCHEMA = pa.schema(
    [
        _f("experience_id", pa.string(), "Unique id of this experience (uuid hex)."),
        _f("task_id", pa.string(), "Id of the task (prompt) it answers."),
        _f(
            "group_id",
            pa.string(),
            'GRPO group: the repeat_times rollouts of one task draw share it; "<explorer>-d<draw>-<task_id>" (older plain rows: "<explorer>-<step>-<task_id>").',
        ),
        _f("explorer_id", pa.int32(), "Explorer that generated it."),
        _f("explorer_step", pa.int64(), "Explorer step e (>= 1) in which it was completed and written."),
        _f("prompt_ids", pa.list_(pa.int32()), "Prompt token ids."),
        _f("response_ids", pa.list_(pa.int32()), "Response token ids (all segments, in order)."),
        _f(
            "logprobs",
            pa.list_(pa.float32()),
            "Behavior logprob of each response token under the policy that sampled it.",
        ),
        _f(
            "versions",
            pa.list_(pa.int32()),
            "Policy version that produced each response token (mixed under partial rollouts).",
        ),
        _f("loss_mask", pa.list_(pa.int8()), "1 where a response token is trained on, 0 where it is masked."),
        _f(
            "reward",
            pa.float64(),
            "Scalar reward of the whole trajectory (sum of components unless the reward says otherwise).",
        ),
        _f(
            "reward_components",
            pa.map_(pa.string(), pa.float64()),
            "Named parts of the reward, e.g. {correct: 1.0, format: 0.1}.",
        ),
        _f("finish_reason", pa.string(), "How the generation ended: stop | length | repeat | truncated."),
        _f("num_segments", pa.int32(), "Number of segments it took (len(segments)); 1 without partial rollouts."),
        _f(
            "segments",
            pa.list_(SEGMENT_TYPE),
            "Its segments in order: explorer step, policy version and token span [start, end) of response_ids each generated.",
        ),
        _f("created_at", pa.float64(), "Unix time (s) it was completed and scored."),
        _f("started_at", pa.float64(), "Unix time (s) its first segment started; null if unknown.", nullable=True),
        _f("prompt_text", pa.string(), "Prompt text, for inspection."),
        _f("response_text", pa.string(), "Response text, for inspection."),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)
_TOKEN_COLUMNS = ("logprobs", "versions", "loss_mask")  # aligned with response_ids
_NOT_NULL = [i for i, f in enumerate(EXPERIENCE_SCHEMA) if not f.nullable]


class SchemaError(UserError, ValueError):
    """A table or file that is not a valid experience table; names the source and the column."""

    def __init__(self, source: str, message: str, column: str | None = None):
        self.source, self.column = source, column
        where = f"column {column!r}: " if column else ""
        super().__init__(f"{source}: {where}{message}")


@dataclasses.dataclass(kw_only=True)
class Experience:
    """One trajectory, one row of EXPERIENCE_SCHEMA (see the schema for each field's meaning)."""

    experience_id: str
    task_id: str
    group_id: str
    explorer_id: int
    explorer_step: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    finish_reason: str = "stop"
    num_segments: int | None = None  # None: len(segments)
    segments: list[dict[str, int]] | None = None  # None: one per run of equal versions, in explorer_step
    created_at: float = dataclasses.field(default_factory=time.time)
    started_at: float | None = None
    prompt_text: str = ""
    response_text: str = ""

    @property
    def min_version(self) -> int:
        """The oldest policy version among its tokens ("generated by"); -1 with no response tokens."""
        return min(self.versions) if self.versions else -1


class ExperienceBatch:
    """A validated Arrow table of experiences; cheap to slice, concatenate and convert."""

    def __init__(self, table: pa.Table):
        # Internal: callers use from_table / from_experiences, which validate.
        self._table = table

    # ---- construction and conversion

    @classmethod
    def from_table(cls, table: pa.Table, source: str = "<table>", check_rows: bool = True) -> ExperienceBatch:
        """Validate `table` against EXPERIENCE_SCHEMA; errors name `source` and the column.

        Extra columns are dropped (a newer writer may add some without a version bump only if
        it keeps these); missing columns, wrong types, nulls and misaligned token lists raise.
        `check_rows=False` skips the row rules (no nulls, token lists aligned, segments, finish
        reasons; most of the cost): for bytes known to be those of a batch validated when it was
        built (a buffer file whose checksum matches its commit record).
        """
        if _check_version(table.schema, source) == 1:
            table = _upgrade_v1(table)
        if table.schema.equals(EXPERIENCE_SCHEMA, check_metadata=True):
            out = table  # the usual case, a file this version wrote: no column to pick or retype
        else:
            columns = []
            for field in EXPERIENCE_SCHEMA:
                idx = table.schema.get_field_index(field.name)
                if idx < 0:
                    raise SchemaError(source, "missing", field.name)
                got = table.schema.field(idx).type
                if got != field.type:
                    raise SchemaError(source, f"has type {got}, expected {field.type}", field.name)
                columns.append(table.column(idx))
            out = pa.Table.from_arrays(columns, schema=EXPERIENCE_SCHEMA)
        if check_rows:
            for i in _NOT_NULL:
                if out.column(i).null_count:
                    raise SchemaError(
                        source,
                        f"has {out.column(i).null_count} null value(s); nulls are not allowed",
                        EXPERIENCE_SCHEMA.field(i).name,
                    )
            _check_rows(out, source)
        return cls(out)

    @classmethod
    def from_experiences(cls, experiences: Iterable[Experience]) -> ExperienceBatch:
        rows = [_with_segments(e) for e in experiences]
        data = {f.name: [getattr(e, f.name) for e in rows] for f in EXPERIENCE_SCHEMA}
        data["reward_components"] = [list(d.items()) for d in data["reward_components"]]
        try:
            table = pa.Table.from_pydict(data, schema=EXPERIENCE_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise SchemaError("<experiences>", f"cannot convert to Arrow: {e}") from None
        return cls.from_table(table, source="<experiences>")

    @classmethod
    def empty(cls) -> ExperienceBatch:
        return cls(EXPERIENCE_SCHEMA.empty_table())

    @classmethod
    def concat(cls, batches: Sequence[ExperienceBatch]) -> ExperienceBatch:
        if not batches:
            return cls.empty()
        if len(batches) == 1:
            return batches[0]
        return cls(pa.concat_tables([b._table for b in batches]))

    def to_table(self) -> pa.Table:
        """The Arrow table (EXPERIENCE_SCHEMA, schema version in its metadata)."""
        return self._table

    def experiences(self) -> list[Experience]:
        out = []
        for row in self._table.to_pylist():
            row["reward_components"] = dict(row["reward_components"])
            out.append(Experience(**row))
        return out

    def __len__(self) -> int:
        return self._table.num_rows

    def __repr__(self) -> str:
        return f"ExperienceBatch({len(self)} experiences)"

    def take(self, indices: Sequence[int] | np.ndarray) -> ExperienceBatch:
        return ExperienceBatch(self._table.take(pa.array(np.asarray(indices, dtype=np.int64))))

    def slice(self, offset: int, length: int | None = None) -> ExperienceBatch:
        return ExperienceBatch(self._table.slice(offset, length))

    # ---- column helpers

    def column(self, name: str) -> np.ndarray:
        """A scalar column as a numpy array (strings as object array)."""
        return self._table.column(name).to_numpy()

    def min_versions(self) -> np.ndarray:
        """[B] int64: per row, the oldest policy version among its response tokens; -1 if none."""
        lengths, values = _lists(self._table.column("versions"))
        out = np.full(len(lengths), -1, dtype=np.int64)
        nonempty = lengths > 0
        if nonempty.any():
            starts = (np.cumsum(lengths) - lengths)[nonempty]
            out[nonempty] = np.minimum.reduceat(values, starts)
        return out

    def group_index(self) -> np.ndarray:
        """[B] int64: dense index of group_id within the batch, in order of first appearance."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        col = self._table.column("group_id")
        enc = (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()).dictionary_encode()
        return enc.indices.to_numpy().astype(np.int64)

    # ---- trainer tensors

    def to_tensors(self, pad_id: int) -> dict:
        """Right-padded tensors aligned to token positions of prompt + response.

        Returns (B rows, L = longest prompt + response):
          input_ids         [B, L] long   prompt then response tokens, pad_id after
          attention_mask    [B, L] long   1 on real tokens
          loss_mask         [B, L] float  1 where input_ids[b, i] is a trained response token
          behavior_logprobs [B, L] float  logprob of input_ids[b, i] given input_ids[b, :i]; 0 outside the response
          versions          [B, L] long   policy version of each response token; -1 outside the response
          rewards           [B]    float
          group_index       [B]    long   dense group index (first appearance order)
          response_start    [B]    long   position of the first response token (= prompt length)
          response_len      [B]    long   response tokens
          truncated         [B]    long   1 where the token budget cut the response (finish reason length or truncated)
        """
        import torch

        t = self._table
        p_len, p_val = _lists(t.column("prompt_ids"))
        r_len, r_val = _lists(t.column("response_ids"))
        b = len(p_len)
        total = p_len + r_len
        length = int(total.max()) if b else 0
        rows_p, pos_p = _positions(p_len)
        rows_r, pos_r = _positions(r_len)
        pos_r = pos_r + p_len[rows_r]

        input_ids = np.full((b, length), pad_id, dtype=np.int64)
        input_ids[rows_p, pos_p] = p_val
        input_ids[rows_r, pos_r] = r_val
        attention = (np.arange(length)[None, :] < total[:, None]).astype(np.int64)
        loss_mask = np.zeros((b, length), dtype=np.float32)
        loss_mask[rows_r, pos_r] = _lists(t.column("loss_mask"))[1]
        logprobs = np.zeros((b, length), dtype=np.float32)
        logprobs[rows_r, pos_r] = _lists(t.column("logprobs"))[1]
        versions = np.full((b, length), -1, dtype=np.int64)
        versions[rows_r, pos_r] = _lists(t.column("versions"))[1]
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "loss_mask": torch.from_numpy(loss_mask),
            "behavior_logprobs": torch.from_numpy(logprobs),
            "versions": torch.from_numpy(versions),
            "rewards": torch.from_numpy(self.column("reward").astype(np.float32)),
            "group_index": torch.from_numpy(self.group_index()),
            "response_start": torch.from_numpy(p_len.astype(np.int64)),
            "response_len": torch.from_numpy(r_len.astype(np.int64)),
            "truncated": torch.from_numpy(
                pc.is_in(t.column("finish_reason"), value_set=pa.array(["length", "truncated"]))
                .to_numpy(zero_copy_only=False)
                .astype(np.int64)
            ),
        }


# --------------------------------------------------------------------------- helpers


def _lists(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [B] int64, flattened values) of a list column."""
    lengths = pc.list_value_length(col).to_numpy().astype(np.int64)
    values = pc.list_flatten(col).to_numpy()
    return lengths, values


def _positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of `lengths`: (row index, position within row) of every element."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    return rows, pos


def _check_version(schema: pa.Schema, source: str) -> int:
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if raw is None:
        raise SchemaError(
            source,
            f"no experience schema version in its metadata (key {SCHEMA_VERSION_KEY.decode()!r}); not an experience table?",
        )
    if raw not in (b"1", str(SCHEMA_VERSION).encode()):
        raise SchemaError(
            source,
            f"experience schema version {raw.decode(errors='replace')}, this code reads versions 1 to {SCHEMA_VERSION}; use the matching rl_engine version",
        )
    return int(raw)


def version_runs(explorer_step: int, versions: Sequence[int]) -> list[dict[str, int]]:
    """Segments of a response generated in one explorer step: one per run of equal versions."""
    out: list[dict[str, int]] = []
    for k, v in enumerate(versions):
        if out and out[-1]["version"] == v:
            out[-1]["end"] = k + 1
        else:
            out.append({"explorer_step": int(explorer_step), "version": int(v), "start": k, "end": k + 1})
    return out or [{"explorer_step": int(explorer_step), "version": -1, "start": 0, "end": 0}]


def _with_segments(e: Experience) -> Experience:
    segments = e.segments if e.segments is not None else version_runs(e.explorer_step, e.versions)
    return dataclasses.replace(
        e, segments=segments, num_segments=len(segments) if e.num_segments is None else e.num_segments
    )


def _upgrade_v1(table: pa.Table) -> pa.Table:
    """A version-1 table (before partial rollouts): derive `segments` from steps and versions."""
    steps = table.column("explorer_step").to_pylist()
    segments = [version_runs(s, v) for s, v in zip(steps, table.column("versions").to_pylist())]
    table = table.set_column(
        table.schema.get_field_index("num_segments"), "num_segments", pa.array([len(s) for s in segments], pa.int32())
    )
    return table.append_column("segments", pa.array(segments, pa.list_(SEGMENT_TYPE)))


def _check_rows(table: pa.Table, source: str) -> None:
    """Row-level rules the types cannot express: aligned token lists, known finish reasons."""
    r_len = pc.list_value_length(table.column("response_ids"))
    for name in _TOKEN_COLUMNS:
        bad = pc.not_equal(pc.list_value_length(table.column(name)), r_len)
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise SchemaError(
                source,
                f"row {row} has a different length than response_ids; it must hold one value per response token",
                name,
            )
    _check_segments(table, source)
    known = pc.is_in(table.column("finish_reason"), value_set=pa.array(FINISH_REASONS))
    if len(table) and not pc.all(known).as_py():
        row = pc.index(known, False).as_py()
        value = table.column("finish_reason")[row].as_py()
        raise SchemaError(
            source, f"row {row} has {value!r}; expected one of {', '.join(FINISH_REASONS)}", "finish_reason"
        )


def _check_segments(table: pa.Table, source: str) -> None:
    """Segments tile [0, len(response)) in order, their count is num_segments, and each one's
    tokens carry its version (what schedule checks read from stored data)."""
    seg_len, _seg = _lists(table.column("segments")) if len(table) else (np.zeros(0, np.int64), None)
    bad = np.flatnonzero(seg_len != table.column("num_segments").to_numpy())
    if len(bad):
        raise SchemaError(
            source,
            f"row {bad[0]} has {seg_len[bad[0]]} segment(s) but num_segments = {table.column('num_segments')[int(bad[0])]}",
            "segments",
        )
    if not len(table):
        return
    r_len = pc.list_value_length(table.column("response_ids")).to_numpy()
    flat = pc.list_flatten(table.column("segments")).combine_chunks()
    start, end, version = (
        flat.field(k).to_numpy(zero_copy_only=False).astype(np.int64) for k in ("start", "end", "version")
    )
    first = np.cumsum(seg_len) - seg_len  # [B] index of each row's first segment
    last = first + seg_len - 1
    row = np.repeat(np.arange(len(seg_len)), seg_len)  # [S] row of each segment
    prev_end = np.concatenate([[0], end[:-1]])
    prev_end[first[seg_len > 0]] = 0
    broken = (start != prev_end) | (end < start)
    ends_wrong = np.zeros(len(seg_len), bool)
    ends_wrong[seg_len > 0] = end[last[seg_len > 0]] != r_len[seg_len > 0]
    bad_rows = sorted(set(row[broken].tolist()) | set(np.flatnonzero(ends_wrong | (seg_len == 0)).tolist()))
    if bad_rows:
        raise SchemaError(
            source,
            f"row {bad_rows[0]}: segments must cover response tokens [0, {r_len[bad_rows[0]]}) in order without gaps",
            "segments",
        )
    tok_versions = _lists(table.column("versions"))[1].astype(np.int64)
    starts = np.cumsum(r_len) - r_len  # [B] offset of each row's response in the flat token list
    expected = np.repeat(version, end - start)  # [T] version each token should carry
    if not np.array_equal(expected, tok_versions[: len(expected)]) or len(expected) != len(tok_versions):
        mismatch = np.flatnonzero(np.repeat(version, end - start) != tok_versions)
        r = int(np.searchsorted(starts, mismatch[0], side="right") - 1) if len(mismatch) else 0
        raise SchemaError(source, f"row {r}: a token's version differs from the version of its segment", "segments")
