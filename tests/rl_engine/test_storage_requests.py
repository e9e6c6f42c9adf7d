"""What a read costs on S3 (moto on loopback): a whole small object is one GET, a missing one is
one 404, an empty one one request, a large one the first block then concurrent ranges; the bytes
are the object's every time.

    .venv/bin/python -m pytest tests/rl_engine/test_storage_requests.py -q
"""

from __future__ import annotations

import threading
import time

import pytest

from rl_engine.storage import open_storage, read_marker, write_marker

pytestmark = pytest.mark.slow


@pytest.fixture
def counted(s3_bucket, monkeypatch):
    """(filesystem, root, the S3 operations it sends from now on)."""
    import s3fs

    url, options = s3_bucket
    fs, root = open_storage(url, options)
    sent: list[tuple[str, str | None]] = []
    inner = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        sent.append((method, kwargs.get("Range")))
        return await inner(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    return fs, root, sent


def test_a_marker_read_is_one_get_and_a_missing_one_one_404(counted):
    fs, root, sent = counted
    write_marker(fs, f"{root}/control/trainer.json", {"version": 3})
    sent.clear()
    assert read_marker(fs, f"{root}/control/trainer.json") == {"version": 3}
    assert [m for m, _ in sent] == ["get_object"]
    sent.clear()
    with pytest.raises(FileNotFoundError, match="control/none.json"):
        read_marker(fs, f"{root}/control/none.json")
    assert [m for m, _ in sent] == ["get_object"]


def test_empty_and_large_objects_read_whole(counted):
    fs, root, sent = counted
    fs.pipe_file(f"{root}/empty", b"")
    big = bytes(range(256)) * 4000  # 1,024,000 bytes
    fs.pipe_file(f"{root}/big", big)
    sent.clear()
    assert fs.cat_file(f"{root}/empty") == b""
    assert len(sent) == 1
    fs.default_block_size = 100_000
    sent.clear()
    assert fs.cat_file(f"{root}/big") == big
    # The first block's GET, then the whole object in 11 concurrent ranges (s3fs's own).
    assert sent[0] == ("get_object", "bytes=0-99999") and len(sent) == 1 + 11 and {m for m, _ in sent} == {"get_object"}
    sent.clear()
    assert fs.cat_file(f"{root}/big", start=10, end=20) == big[10:20] and len(sent) == 1


def test_a_commit_marker_probe_is_one_head(counted):
    from rl_engine.storage import file_exists

    fs, root, sent = counted
    fs.pipe_file(f"{root}/v1/_COMMITTED", b"{}")
    sent.clear()
    assert file_exists(fs, f"{root}/v1/_COMMITTED") and not file_exists(fs, f"{root}/v2/_COMMITTED")
    assert [m for m, _ in sent] == ["head_object", "head_object"]
    assert file_exists(fs, root)  # a bucket: s3fs's own probe


def test_roles_of_one_process_share_their_board_reads(counted, s3_bucket):
    from rl_engine.board import Board

    fs, root, sent = counted
    url, options = s3_bucket
    boards = [Board.at(url, options, poll_s=2.0) for _ in range(8)]  # 8 roles of one process; a read serves 1 s
    boards[0].post("trainer", {"version": 1})
    sent.clear()
    seen: list = []
    threads = [threading.Thread(target=lambda b=b: seen.append(b.get("trainer")["version"])) for b in boards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [1] * 8 and [m for m, _ in sent] == ["get_object"]  # one GET served all eight
    seen[0] = boards[0].get("trainer")
    seen[0]["version"] = 99  # a caller's copy: mutating it changes no one else's read
    # This process's own post is seen at once; another process's write once the read is 1 s old.
    boards[1].post("trainer", {"version": 2})
    assert boards[5].get("trainer")["version"] == 2
    fs.pipe_file(f"{root}/control/trainer.json", b'{"version": 3}')  # written behind this process's back
    assert boards[5].get("trainer")["version"] == 2
    time.sleep(1.05)
    assert boards[5].get("trainer")["version"] == 3
    assert boards[2].get("missing") is None and boards[3].get("missing") is None
    boards[0].clear()  # a cleared board forgets what it read
    assert boards[4].get("trainer") is None
