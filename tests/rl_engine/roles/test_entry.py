"""What roles tell each other on the run's board: stop requests, heartbeats, failures (no engines).

The roles themselves run for real in tests/flows (threads of one flow run, and processes on a
worker); here the board protocol is checked on its own, with short heartbeats.
"""

from __future__ import annotations

import time

import pytest

from rl_engine.board import STOP_KEY, Board, RoleSignals, Stopped, request_stop, restate_failure, role_key, silent_roles
from rl_engine.roles.entry import Role, watched_peers
from rl_engine.run.context import ResumePoint, post_start, read_start, start_run
from tests.rl_engine.rollout.engines import make_config


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def signals(board: Board, role: str, peers: list[str], attempt: str = "a1", timeout_s: float = 30.0) -> RoleSignals:
    return RoleSignals(board, role, peers, attempt, heartbeat_s=0.1, heartbeat_timeout_s=timeout_s)


def test_stop_request_reaches_every_role_and_the_first_reason_wins(tmp_path):
    board = Board.at(str(tmp_path))
    a, b = signals(board, "trainer", ["explorer-0"]), signals(board, "explorer-0", ["trainer"])
    try:
        assert not a.is_set() and not b.is_set()
        request_stop(board, "cancelled", "the flow run was cancelled", by="flow")
        request_stop(board, "failed", "a later reason", by="trainer")
        assert wait_until(lambda: a.is_set() and b.is_set())
        assert board.get(STOP_KEY)["reason"] == "the flow run was cancelled"
        assert b.request["kind"] == "cancelled"
    finally:
        a.close("stopped"), b.close("stopped")
    assert board.get(role_key("trainer"))["state"] == "stopped"


def test_a_role_restates_its_own_failure_but_never_another_roles_request(tmp_path):
    """The trainer's launcher names the killed rank in place of rank 0's "connection reset" (the
    trainer's own failure report); any other request stays the run's reason: another role's
    failure, a silent peer the trainer reported, a cancel."""
    boards = {d: Board.at(str(tmp_path / d)) for d in ("own", "none", "other", "silent", "cancel")}
    own = signals(boards["own"], "trainer", [])
    own.report_failure("RuntimeError: Connection reset by peer")  # what Role.running posts
    own.close("failed")
    other = signals(boards["other"], "explorer-0", [])
    other.report_failure("EngineDiedError: worker gone")
    other.close("failed")
    boards["silent"].post(role_key("explorer-0"), {"state": "running", "attempt": "a1", "pid": 4242, "host": "h"})
    watcher = signals(boards["silent"], "trainer", ["explorer-0"])  # the trainer's own request about a peer
    watcher.close("stopped")
    watcher._check(time.time() + 61)  # 61 s on: explorer-0 went silent
    request_stop(boards["cancel"], "cancelled", "the flow run was cancelled", by="trainer")
    before = {d: b.get(STOP_KEY) for d, b in boards.items()}
    assert before["own"]["reason"] == "trainer failed: RuntimeError: Connection reset by peer"
    assert before["silent"]["reason"].startswith("explorer-0 went silent") and before["silent"]["by"] == "trainer"
    for b in boards.values():
        restate_failure(b, "trainer failed: trainer rank 1 (pid 7) failed: Signal 9 (SIGKILL)", "trainer")
    after = {d: b.get(STOP_KEY) for d, b in boards.items()}
    for d in ("own", "none"):
        assert (after[d]["kind"], after[d]["reason"], after[d]["by"]) == (
            "failed",
            "trainer failed: trainer rank 1 (pid 7) failed: Signal 9 (SIGKILL)",
            "trainer",
        )
    for d in ("other", "silent", "cancel"):
        assert after[d] == before[d], d


def test_heartbeats_refresh_the_role_marker(tmp_path):
    board = Board.at(str(tmp_path))
    s = signals(board, "explorer-0", [])
    try:
        first = board.get(role_key("explorer-0"))
        assert first["state"] == "running" and first["pid"] > 0 and first["attempt"] == "a1"
        assert wait_until(lambda: board.get(role_key("explorer-0"))["time"] > first["time"] + 0.15)
    finally:
        s.close("done")


def test_a_silent_peer_of_this_attempt_stops_the_run_naming_it(tmp_path):
    board = Board.at(str(tmp_path))
    # A crashed attempt's explorer, silent for long, must not count; this attempt's one must.
    board.post(role_key("explorer-1"), {"pid": 1, "host": "h", "state": "running", "attempt": "old"})
    board.post(role_key("explorer-0"), {"pid": 4242, "host": "h", "state": "running", "attempt": "a1"})
    trainer = signals(board, "trainer", ["explorer-0", "explorer-1"], timeout_s=0.5)
    try:
        assert wait_until(trainer.is_set, timeout_s=5)
        stop = board.get(STOP_KEY)
        assert stop["kind"] == "failed" and stop["by"] == "trainer"
        assert stop["reason"].startswith("explorer-0 went silent") and "pid 4242" in stop["reason"]
        assert silent_roles(board, ["explorer-0", "explorer-1", "trainer"], "a1", 0.5) == ["explorer-0"]
    finally:
        trainer.close("stopped")


def test_the_trainer_watches_every_explorer_and_each_explorer_the_trainer():
    # Heartbeat reads per check grow with the explorers, not with their square.
    assert watched_peers("trainer", 3) == ["explorer-0", "explorer-1", "explorer-2"]
    assert watched_peers("explorer-1", 3) == ["trainer"]
    assert sum(len(watched_peers(r, 16)) for r in ["trainer"] + [f"explorer-{i}" for i in range(16)]) == 32


def test_a_peer_that_finished_is_not_silent(tmp_path):
    board = Board.at(str(tmp_path))
    board.post(role_key("explorer-0"), {"pid": 1, "host": "h", "state": "done", "attempt": "a1"})
    trainer = signals(board, "trainer", ["explorer-0"], timeout_s=0.2)
    try:
        time.sleep(1.0)
        assert not trainer.is_set()
    finally:
        trainer.close("done")


@pytest.fixture
def run(tiny_model_dir, tmp_path):
    cfg = make_config(
        tiny_model_dir,
        name="roles",
        buffer={"storage": {"url": str(tmp_path)}},
        placement={"type": "local", "heartbeat_s": 0.1},
    )
    run = start_run(cfg)
    post_start(Board.at(run.url), ResumePoint(3, {0: 5}))
    return run


def test_start_marker_tells_every_role_where_the_attempt_starts(run):
    attempt, at, generation = read_start(Board.at(run.url), timeout_s=5)
    assert len(attempt) == 12 and at == ResumePoint(3, {0: 5}) and at.resumed and generation is None


def test_a_failing_role_stops_the_others_with_its_error(run):
    role = Role(run, "explorer-0", on_step=None)
    with pytest.raises(ValueError, match="boom"), role.running():
        raise ValueError("boom")
    board = Board.at(run.url)
    assert board.get(STOP_KEY)["reason"] == "explorer-0 failed: ValueError: boom"
    marker = board.get(role_key("explorer-0"))
    assert marker["state"] == "failed" and marker["error"] == "ValueError: boom"
    assert role.result().stopped_by["kind"] == "failed"


def test_a_stopped_role_ends_quietly_and_says_why(run):
    role = Role(run, "trainer", on_step=None)
    request_stop(role.board, "cancelled", "the flow run was cancelled", by="flow")
    assert wait_until(role.stop.is_set)
    with role.running():
        raise Stopped("stopped while waiting for experiences")
    assert role.board.get(role_key("trainer"))["state"] == "stopped"
    assert role.result().stopped_by["reason"] == "the flow run was cancelled"


def test_steps_are_recorded_in_the_run(run):
    from rl_engine.run.report import load_metrics

    role = Role(run, "trainer", on_step=None)
    seen = []
    role.on_step = lambda name, m: seen.append((name, m["step"]))
    with role.running():
        role.record(1, {"step": 1, "reward_mean": 0.5})
        role.record(2, {"step": 2, "reward_mean": 0.7})
        role.record(2, {"step": 2, "reward_mean": 0.8})  # a resumed run redoes step 2: it replaces it
    trainer, explorer = load_metrics(run)
    assert [m["reward_mean"] for m in trainer] == [0.5, 0.8] and explorer == []
    assert seen == [("trainer", 1), ("trainer", 2), ("trainer", 2)]


def test_one_driver_per_run_and_a_dead_drivers_lease_expires(run):
    from rl_engine.errors import UserError
    from rl_engine.run.lease import RunLease, read_lease

    first = RunLease(*run.fs(), ttl_s=1.5).acquire()
    try:
        with pytest.raises(UserError, match=rf"run {run.url} is being run by pid \d+ on .*retry in \d+ s"):
            RunLease(*run.fs(), ttl_s=1.5).acquire()
        time.sleep(2.0)  # the holder keeps renewing: still refused after its ttl
        with pytest.raises(UserError, match="is being run by"):
            RunLease(*run.fs(), ttl_s=1.5).acquire()
    finally:
        first.release()
    second = RunLease(*run.fs(), ttl_s=1.5).acquire()  # released: free at once
    second._done.set()  # the holder dies: no more renewals, no release
    second._thread.join(5)
    assert read_lease(*run.fs())["holder"] == second.me["holder"]
    time.sleep(1.7)
    third = RunLease(*run.fs(), ttl_s=1.5).acquire()  # the dead holder's lease expired
    third.release()
    # one generation per holder, none for the refused
    assert read_lease(*run.fs())["released"] and third.generation == 3


def test_roles_sharing_a_process_pass_the_gil_sooner_and_the_interval_is_restored():
    import sys

    from rl_engine.roles.entry import SHARED_PROCESS_SWITCH_INTERVAL_S, roles_share_process

    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="a role failed"), roles_share_process():
        assert sys.getswitchinterval() == pytest.approx(SHARED_PROCESS_SWITCH_INTERVAL_S)
        raise RuntimeError("a role failed")
    assert sys.getswitchinterval() == before


def test_a_role_whose_driver_lost_the_lease_posts_nothing_on_the_board(run):
    from rl_engine.run.lease import LeaseLost, RunLease

    old = RunLease(*run.fs(), ttl_s=0.5).acquire()
    old._done.set()  # the driver paused past its ttl
    old._thread.join(5)
    post_start(Board.at(run.url), ResumePoint(0, {0: 1}), old.generation)
    role = Role(run, "trainer", on_step=None)
    time.sleep(0.6)
    new = RunLease(*run.fs(), ttl_s=60).acquire()  # a second driver took the run over
    try:
        with pytest.raises(LeaseLost, match="generation 1, which generation 2"), role.running():
            role.fence.check()  # what every commit of the role does first
        assert Board.at(run.url).get(STOP_KEY) is None  # the new driver's run is not stopped
        assert Board.at(run.url).get(role_key("trainer"))["state"] == "running"  # its last word was its heartbeat
    finally:
        new.release()


def test_the_reward_role_serves_until_the_run_stopped_and_no_explorer_runs(run, monkeypatch):
    """The reward role (placement deployments, a model reward) keeps serving after the trainer's
    end while an explorer still runs (explorer 0's last evaluation may score with it); its service
    itself is rl_engine.rewards.run_service.serve's (tests/rl_engine/rewards/test_run_service.py)."""
    from rl_engine.roles import entry

    board = Board.at(run.url)
    attempt, _, _ = read_start(board, timeout_s=5)
    seen = []

    def serve(role_board, reward, done, before_post):
        before_post()  # the role's fence: this driver's attempt
        board.post(role_key("explorer-0"), {"pid": 1, "host": "h", "state": "running", "attempt": attempt})
        seen.append(done())  # the run goes on
        request_stop(board, "finished", "trainer reached version 2", by="trainer")
        seen.append(wait_until(done, timeout_s=0.5))  # the trainer ended, explorer-0 runs on
        board.post(role_key("explorer-0"), {"pid": 1, "host": "h", "state": "done", "attempt": attempt})
        seen.append(wait_until(done))

    monkeypatch.setattr(entry, "serve", serve)
    result = entry.reward_role(run)
    assert seen == [False, False, True]
    assert board.get(role_key("reward"))["state"] == "done" and result.stopped_by is None
