"""ContinuationStore: save / list / load / retire partial rollouts, atomically, on any storage.

.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_continuations.py
"""

from __future__ import annotations

import json
import uuid

import pytest

from rl_engine.buffer import ContinuationStore, CorruptFileError
from rl_engine.buffer.synthetic import make_batch, make_experiences
from rl_engine.experience import ExperienceBatch, SchemaError
from rl_engine.storage import open_storage


def _life_cycle(run: str, options: dict) -> None:
    store = ContinuationStore(*open_storage(run, options), explorer_id=3)
    assert store.list() == []
    rows = make_experiences(6, explorer_id=3, explorer_step=1)
    a = store.save(ExperienceBatch.from_experiences(rows), explorer_step=1)
    b = store.save(make_batch(4, explorer_id=3, response_len=5).to_table(), explorer_step=1)  # a table works too
    entries = store.list()
    assert [e.id for e in entries] == [a, b]
    assert entries[1].num_rows == 4 and entries[1].response_tokens == 20 and entries[1].explorer_step == 1
    assert store.load([a]).experiences() == rows  # every column survives
    assert len(store.load()) == 10
    # Resume a in step 2: its still-unfinished rows are saved and a is retired in one commit.
    c = store.save(make_batch(2, explorer_id=3, explorer_step=2), explorer_step=2, retire=[a])
    assert [e.id for e in store.list()] == [b, c]
    store.retire([b])
    store.retire([b])  # retiring twice is a no-op (a retry after a crash)
    assert [e.id for e in store.list()] == [c]
    with pytest.raises(KeyError, match="no active continuation set"):
        store.load([a])
    with pytest.raises(KeyError, match="cannot retire unknown"):
        store.retire(["nope"])
    # Other explorers have their own store.
    assert ContinuationStore(*open_storage(run, options), explorer_id=4).list() == []
    m = store.manifest()
    assert m["num_rows"] == 2 and m["entries"][0]["uri"].endswith(f"continuations/explorer=3/part-{c}.arrow")
    assert json.loads(json.dumps(m)) == m


def test_life_cycle_local(tmp_path):
    _life_cycle(str(tmp_path), {})
    # Retired files are removed once the manifest no longer names them.
    assert sorted(p.name for p in (tmp_path / "continuations/explorer=3").iterdir())[:1] == ["_manifest.json"]
    assert len(list((tmp_path / "continuations/explorer=3").glob("part-*.arrow"))) == 1


def test_life_cycle_memory():
    _life_cycle(f"memory://t-{uuid.uuid4().hex}/run", {})


@pytest.mark.slow
def test_life_cycle_s3(s3_bucket):
    url, options = s3_bucket
    _life_cycle(f"{url}/run", options)


def test_failed_manifest_write_changes_nothing(tmp_path, monkeypatch):
    from rl_engine.buffer import _files

    store = ContinuationStore(*open_storage(str(tmp_path), {}), 0)
    a = store.save(make_batch(2))
    monkeypatch.setattr(_files, "put_json", lambda *a, **k: (_ for _ in ()).throw(OSError("no space")))
    with pytest.raises(OSError):
        store.save(make_batch(2), retire=[a])
    assert [e.id for e in store.list()] == [a]  # neither the new set nor the retirement happened
    assert len(store.load([a])) == 2


def test_invalid_and_corrupt(tmp_path):
    store = ContinuationStore(*open_storage(str(tmp_path), {}), 0)
    with pytest.raises(SchemaError, match="ContinuationStore.save: column 'logprobs': missing"):
        store.save(make_batch(2).to_table().drop_columns(["logprobs"]))
    a = store.save(make_batch(2))
    path = tmp_path / f"continuations/explorer=0/part-{a}.arrow"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptFileError, match=f"part-{a}.arrow: size"):
        store.load([a])
