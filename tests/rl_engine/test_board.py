"""rl_engine.board.poll_until: the one poll loop of board waits, checkpoint commits, buffer reads
and `rft trainer-node`: returns what `ready` gives, stops on request, times out naming the wait."""

from __future__ import annotations

import threading

import pytest

from rl_engine.board import Stopped, WaitTimeout, poll_until


def test_returns_the_first_ready_value_and_calls_between_in_between():
    tries, between = iter([None, False, 0, 7]), []
    assert (
        poll_until(lambda: next(tries), what="x", timeout_s=5, interval_s=0.001, between=lambda: between.append(1)) == 0
    )  # 0 is a value
    assert between == [1, 1]


def test_stop_and_timeout_name_what_was_awaited():
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped, match="stopped while waiting for trainer version 3"):
        poll_until(lambda: None, what="trainer version 3", timeout_s=5, interval_s=0.001, stop=stop)
    with pytest.raises(WaitTimeout, match="waited 0 s for trainer version 3"):
        poll_until(lambda: None, what="trainer version 3", timeout_s=0.01, interval_s=0.001)
    with pytest.raises(ValueError, match="mine"):
        poll_until(lambda: None, what="x", timeout_s=0, interval_s=1, timeout_error=lambda: ValueError("mine"))


def test_a_write_of_this_process_ends_the_pause_at_once(tmp_path):
    """A waiter with a long poll interval wakes as soon as another thread of its process writes a
    board marker (rl_engine.storage's in-process news), not at its next poll."""
    import time

    from rl_engine.board import Board

    board = Board.at(str(tmp_path), poll_s=30.0)
    threading.Timer(0.2, lambda: board.post("other", {"x": 1})).start()  # news elsewhere: keeps waiting
    threading.Timer(0.4, lambda: board.post("k", {"v": 2})).start()
    t0 = time.monotonic()
    assert board.wait("k", lambda m: m["v"] == 2, what="k", timeout_s=20)["v"] == 2
    assert time.monotonic() - t0 < 5


def test_wait_news_filters_by_path_and_never_misses_a_write_before_the_wait():
    import time

    from rl_engine.storage import _written, news, wait_news

    seen = news()
    _written("/runs/a/control/k.json")  # before the wait, after `seen`: returns at once
    t0 = time.monotonic()
    wait_news(seen, 10.0, "/runs/a/control/k.json")
    assert time.monotonic() - t0 < 1
    seen = news()
    _written("/runs/a/control/other.json")
    t0 = time.monotonic()
    wait_news(seen, 0.2, "/runs/a/control/k.json")  # not its path: the whole pause
    assert time.monotonic() - t0 >= 0.19


def test_board_markers_are_links_to_their_latest_file_and_old_files_go(tmp_path):
    """On local disk a marker is a symbolic link to a fresh file (no regular file is renamed over
    another, which makes ext4 write it back at once); readers see the latest value, a marker that
    was a plain file is taken over, and only the latest two files of a marker stay."""
    import json
    import os

    from rl_engine.board import Board

    board = Board.at(str(tmp_path))
    control = tmp_path / "control"
    control.mkdir()
    (control / "k.json").write_text(json.dumps({"v": 0}))  # a run's marker from before markers were links
    assert board.get("k")["v"] == 0
    for v in range(1, 6):
        board.post("k", {"v": v})
        assert board.get("k")["v"] == v and json.loads((control / "k.json").read_text())["v"] == v
    assert os.path.islink(control / "k.json")
    assert len([p for p in os.listdir(control) if p.startswith(".k.json.")]) == 2
    assert not [p for p in os.listdir(control) if p.startswith(".tmp-")]
    board.clear()
    assert board.get("k") is None


def test_a_stop_request_of_this_process_reaches_a_role_at_once_and_close_does_not_wait_a_poll(tmp_path):
    """A role's signals look at the board every few seconds on an object store; a stop request
    posted by a thread of its own process (the flow's cancel watcher, another role of placement
    `local`) is seen at once, and closing the signals ends their thread without waiting a look."""
    import time

    from rl_engine.board import Board, RoleSignals, request_stop

    board = Board.at(str(tmp_path), poll_s=30.0)  # a look every heartbeat_s (20 s) only
    signals = RoleSignals(board, "trainer", [], "a1", heartbeat_s=20.0, heartbeat_timeout_s=60.0)
    time.sleep(0.1)
    assert not signals.is_set()
    threading.Timer(0.2, lambda: request_stop(Board.at(str(tmp_path)), "cancelled", "from the UI", by="flow")).start()
    assert signals._stop.wait(10), "the stop request was not seen before the next look"
    assert signals.request["kind"] == "cancelled"
    t0 = time.monotonic()
    signals.close("stopped")
    assert time.monotonic() - t0 < 5 and not signals._thread.is_alive()
    assert board.get("role-trainer")["state"] == "stopped"
