"""Cursor: checkpoint, crash, restore -> the trainer consumes exactly what it did after the checkpoint.

.venv/bin/python -m pytest tests/rl_engine/buffer/test_buffer_cursor.py
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from rl_engine.buffer import BufferReader, BufferWriter, list_cursor_steps, load_cursor, save_cursor
from rl_engine.buffer._files import CommitKey
from rl_engine.buffer.cursor import ConsumedSet
from rl_engine.buffer.synthetic import make_batch
from rl_engine.config import BufferConfig
from rl_engine.errors import UserError
from rl_engine.storage import open_storage


def _fill(run: str, options: dict, steps: int = 6) -> None:
    # Two explorers, files of 12 rows, batches of 8: batches straddle files and explorers.
    writers = [BufferWriter(*open_storage(run, options), e) for e in (0, 1)]
    for s in range(1, steps + 1):
        for e, w in enumerate(writers):
            w.write(s, make_batch(12, explorer_id=e, explorer_step=s, group_size=4))


def _consume(reader: BufferReader, batches: int) -> list[list[str]]:
    return [[str(x) for x in reader.read_batch(8, timeout_s=0).column("experience_id")] for _ in range(batches)]


def _crash_and_restore(run: str, options: dict, whole_groups: bool) -> None:
    _fill(run, options)
    cfg = BufferConfig(whole_groups=whole_groups)
    trainer = BufferReader(*open_storage(run, options), cfg)
    before = _consume(trainer, 3)  # trainer steps 1..3
    save_cursor(*open_storage(run, options), 3, trainer.state_dict())  # checkpoint at step 3
    after = _consume(trainer, 5)  # steps 4..8, then the trainer "crashes"
    del trainer

    resumed = BufferReader(*open_storage(run, options), cfg)
    resumed.load_state_dict(load_cursor(*open_storage(run, options), trainer_step=3))
    replay = _consume(resumed, 5)
    assert replay == after
    seen_before = {i for b in before for i in b}
    assert not seen_before & {i for b in replay for i in b}  # nothing consumed before the checkpoint again
    rest = _consume(resumed, 1)  # and it goes on past the crash point without repeats
    assert not {i for b in before + after for i in b} & set(rest[0])
    assert resumed.stats["consumed"] == 8 * 9


@pytest.mark.parametrize("whole_groups", [True, False])
def test_crash_and_restore_local(tmp_path, whole_groups):
    _crash_and_restore(str(tmp_path), {}, whole_groups)


def test_crash_and_restore_memory():
    _crash_and_restore(f"memory://t-{uuid.uuid4().hex}/run", {}, True)


@pytest.mark.slow
def test_crash_and_restore_s3(s3_bucket):
    url, options = s3_bucket
    _crash_and_restore(f"{url}/r", options, True)


def test_cursor_files(tmp_path):
    run = str(tmp_path)
    assert load_cursor(*open_storage(run, {})) is None
    for t in (2, 10, 4):
        save_cursor(*open_storage(run, {}), t, {"format": 1, "t": t})
    assert list_cursor_steps(*open_storage(run, {})) == [2, 4, 10]
    assert load_cursor(*open_storage(run, {}))["t"] == 10 and load_cursor(*open_storage(run, {}), 4)["t"] == 4
    assert json.loads((tmp_path / "buffer/cursor/step=000000004.json").read_text())["trainer_step"] == 4
    with pytest.raises(UserError, match="no buffer cursor saved for trainer step 5"):
        load_cursor(*open_storage(run, {}), 5)


def test_consumed_set_stays_compact():
    c = ConsumedSet()
    key = lambda seq: CommitKey(seq, 0, "w1", seq)  # noqa: E731
    for seq in (2, 3, 5):
        c.mark(key(seq), np.ones(4, bool))
    c.mark(key(4), np.array([True, True, False, True]))
    assert c.to_json() == {"w1": {"upto": 0, "done": [2, 3, 5], "partial": {"4": [[0, 2], [3, 4]]}}}
    assert c.decided_rows(key(4), 4).tolist() == [True, True, False, True]
    c.mark(key(1), np.ones(4, bool))
    c.mark(key(4), np.ones(4, bool))
    assert c.to_json() == {"w1": {"upto": 5, "done": [], "partial": {}}}  # watermark swallowed them
    assert c.is_done(key(3)) and not c.is_done(key(6))
    assert ConsumedSet.from_json(json.loads(json.dumps(c.to_json()))).to_json() == c.to_json()


def test_state_dict_is_json_and_rejects_unknown_format(tmp_path):
    _fill(str(tmp_path), {}, steps=1)
    reader = BufferReader(*open_storage(str(tmp_path), {}))
    reader.read_batch(8, timeout_s=0)
    state = json.loads(json.dumps(reader.state_dict()))
    other = BufferReader(*open_storage(str(tmp_path), {}))
    other.load_state_dict(state)
    assert other.state_dict() == reader.state_dict()
    with pytest.raises(ValueError, match="cursor format 99"):
        other.load_state_dict({**state, "format": 99})
