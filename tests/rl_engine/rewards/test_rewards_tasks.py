"""Task sets: JSONL/Parquet, local/S3, bad rows named by row number, the seeded resumable iterator,
and prompt formatting."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_engine.config import TasksetConfig
from rl_engine.errors import UserError
from rl_engine.rewards import Task, TaskIterator, format_prompt, load_taskset

ROWS = [
    {"question": "1+2=", "answer": "3", "level": 1},
    {"question": "4+4=", "answer": 8, "level": 2},  # a numeric answer becomes a string
    {"question": "9+0=", "level": 1},  # no answer: None
]


def _write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return str(path)


def _write_parquet(path, rows):
    # Parquet columns are typed: answers as strings (None where missing), like a real export.
    pq.write_table(
        pa.Table.from_pylist([{**r, "answer": None if "answer" not in r else str(r["answer"])} for r in rows]), path
    )
    return str(path)


def _check_rows(tasks, name):
    assert [t.prompt for t in tasks] == ["1+2=", "4+4=", "9+0="]
    assert [t.answer for t in tasks] == ["3", "8", None]
    assert [t.task_id for t in tasks] == [f"{name}#1", f"{name}#2", f"{name}#3"]
    assert tasks[0].row["level"] == 1


def test_jsonl_local_ids_from_row_numbers(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", ROWS, extra_lines=["\n"])  # a blank line is no row
    _check_rows(load_taskset(TasksetConfig(path=path)), "t.jsonl")


def test_jsonl_unicode_bom_crlf_and_gzip(tmp_path):
    import gzip

    rows = [{"question": "a\u2028b=", "answer": "x"}, {"question": "c=", "answer": "y"}]
    text = "\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows)
    (tmp_path / "u.jsonl").write_bytes(text.encode("utf-8"))
    tasks = load_taskset(TasksetConfig(path=str(tmp_path / "u.jsonl")))
    assert [(t.task_id, t.prompt) for t in tasks] == [("u.jsonl#1", "a\u2028b="), ("u.jsonl#2", "c=")]
    (tmp_path / "u.jsonl.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    assert [t.prompt for t in load_taskset(TasksetConfig(path=str(tmp_path / "u.jsonl.gz")))] == ["a\u2028b=", "c="]


def test_parquet_local_and_id_column(tmp_path):
    path = _write_parquet(tmp_path / "t.parquet", ROWS)
    _check_rows(load_taskset(TasksetConfig(path=path)), "t.parquet")
    with_ids = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"id": [10, 11], "q": ["a", "b"], "a": ["x", "y"]}), with_ids)
    tasks = load_taskset(TasksetConfig(path=str(with_ids), prompt_key="q", answer_key="a"))
    assert [(t.task_id, t.prompt, t.answer) for t in tasks] == [("10", "a", "x"), ("11", "b", "y")]


@pytest.mark.slow
def test_jsonl_and_parquet_on_s3(s3_bucket, tmp_path):
    import s3fs

    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    local_jsonl = _write_jsonl(tmp_path / "t.jsonl", ROWS)
    fs.put(local_jsonl, f"{url}/data/t.jsonl")
    fs.put(_write_parquet(tmp_path / "t.parquet", ROWS), f"{url}/data/t.parquet")
    _check_rows(load_taskset(TasksetConfig(path=f"{url}/data/t.jsonl"), options), "t.jsonl")
    _check_rows(load_taskset(TasksetConfig(path=f"{url}/data/t.parquet"), options), "t.parquet")
    with pytest.raises(UserError, match="file not found"):
        load_taskset(TasksetConfig(path=f"{url}/data/missing.jsonl"), options)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "1+1=", ', r"line 3: not valid JSON"),
        ('{"prompt": "1+1="}', r"line 3: no 'question' key"),
        ('{"question": 5}', r"line 3: 'question' must be a string"),
        ('["1+1="]', r"line 3: expected a JSON object"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path, bad_line, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], extra_lines=[bad_line + "\n"])
    with pytest.raises(UserError, match=message) as e:
        load_taskset(TasksetConfig(path=path))
    assert str(e.value).startswith(path)


def test_bad_parquet_row_names_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a", None, "c"]}), path)
    with pytest.raises(UserError, match=r"bad.parquet: row 2: 'question' must be a string"):
        load_taskset(TasksetConfig(path=str(path)))


def test_duplicate_ids_rejected(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "question": "x"}, {"id": "a", "question": "y"}])
    with pytest.raises(UserError, match=r"line 2: duplicate id 'a' \(first at line 1\)"):
        load_taskset(TasksetConfig(path=path))


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n")])
def test_empty_taskset_names_the_file(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=f"{name}.*empty"):
        load_taskset(TasksetConfig(path=str(tmp_path / name)))


def test_empty_parquet_and_missing_and_unknown_type(tmp_path):
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(UserError, match="e.parquet.*empty"):
        load_taskset(TasksetConfig(path=str(tmp_path / "e.parquet")))
    with pytest.raises(UserError, match="nope.jsonl.*file not found"):
        load_taskset(TasksetConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(UserError, match="unknown file type"):
        load_taskset(TasksetConfig(path=str(tmp_path / "t.csv")))


# --------------------------------------------------------------------------- iterator


def _tasks(n):
    return [Task(task_id=f"t{i}", prompt=f"p{i}", answer=None) for i in range(n)]


def _ids(batch):
    return [t.task_id for t in batch]


def test_iterator_epochs_cover_every_task_and_shuffle_by_seed():
    tasks = _tasks(10)
    it = TaskIterator(tasks, batch_size=5, seed=1)
    epoch0 = _ids(it.next_batch()) + _ids(it.next_batch())
    epoch1 = _ids(it.next_batch()) + _ids(it.next_batch())
    assert sorted(epoch0) == sorted(epoch1) == sorted(t.task_id for t in tasks)
    assert epoch0 != epoch1  # a new order each epoch
    assert epoch0 != [t.task_id for t in tasks]  # shuffled
    other = TaskIterator(tasks, batch_size=5, seed=2)
    assert _ids(other.next_batch()) + _ids(other.next_batch()) != epoch0
    plain = TaskIterator(tasks, batch_size=4, seed=1, shuffle=False)
    assert [_ids(plain.next_batch()) for _ in range(3)] == [
        ["t0", "t1", "t2", "t3"],
        ["t4", "t5", "t6", "t7"],
        ["t8", "t9", "t0", "t1"],
    ]


def test_iterator_resume_continues_same_order():
    tasks = _tasks(7)
    straight = TaskIterator(tasks, batch_size=3, seed=42)
    expected = [_ids(straight.next_batch()) for _ in range(10)]

    first = TaskIterator(tasks, batch_size=3, seed=42)
    got = [_ids(first.next_batch()) for _ in range(4)]  # stops mid-epoch (12 of 14 tasks)
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON
    resumed = TaskIterator(tasks, batch_size=3, seed=42)
    resumed.load_state_dict(state)
    got += [_ids(resumed.next_batch()) for _ in range(6)]
    assert got == expected
    assert resumed.state_dict()["batches"] == 10


def test_iterator_resume_refuses_a_changed_taskset():
    state = TaskIterator(_tasks(7), batch_size=3, seed=42).state_dict()
    with pytest.raises(UserError, match="num_tasks"):
        TaskIterator(_tasks(8), batch_size=3, seed=42).load_state_dict(state)
    with pytest.raises(UserError, match="seed"):
        TaskIterator(_tasks(7), batch_size=3, seed=1).load_state_dict(state)


# --------------------------------------------------------------------------- prompts


class _ChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_format_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert format_prompt(tok, None, "1+2=") == "1+2="  # tiny tokenizer: no chat template
    assert format_prompt(None, None, "1+2=") == "1+2="
    assert format_prompt(_ChatTokenizer(), None, "1+2=") == "<user>1+2=</user><assistant>"
    assert format_prompt(_ChatTokenizer(), "Q: {prompt}\nA:", "1+2=") == "Q: 1+2=\nA:"  # template wins
    assert format_prompt(tok, '{{"q": "{prompt}"}}', "x") == '{"q": "x"}'
    with pytest.raises(UserError, match="taskset.template"):
        format_prompt(tok, "{question}", "x")


@pytest.mark.parametrize("n_tasks,batch", [(7, 3), (6, 3), (5, 8)])
def test_advance_equals_drawing_the_batches(n_tasks, batch):
    for skip in (0, 1, 2, 5, 11):
        drawn = TaskIterator(_tasks(n_tasks), batch_size=batch, seed=9)
        for _ in range(skip):
            drawn.next_batch()
        jumped = TaskIterator(_tasks(n_tasks), batch_size=batch, seed=9)
        jumped.advance(skip)
        assert [t.task_id for t in jumped.next_batch()] == [t.task_id for t in drawn.next_batch()], skip
        assert jumped.state_dict() == drawn.state_dict()
