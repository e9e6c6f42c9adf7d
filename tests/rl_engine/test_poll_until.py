"""rl_engine.board.poll_until: the one poll loop of board waits, checkpoint commits, buffer reads
and `rft trainer-node`: returns what `ready` gives, stops on request, times out naming the wait."""

from __future__ import annotations

import threading

import pytest

from rl_engine.board import Stopped, WaitTimeout, poll_until


def test_returns_the_first_ready_value_and_calls_between_in_between():
    tries, between = iter([None, False, 0, 7]), []
    assert poll_until(lambda: next(tries), what="x", timeout_s=5, interval_s=0.001, between=lambda: between.append(1)) == 0  # 0 is a value
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
