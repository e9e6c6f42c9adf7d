"""The run's reward service under placement deployments (rl_engine/rewards/run_service.py), without
a model: which rewards use the reward role's service, the explorers' look-up on the board and its
timeout, a step after a failed request looking the service up again, and the reward role's
keeping its service up (a dead one started again and posted) until it is done. The whole role on
a real worker: tests/flows/test_placement_deployments.py.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_engine.board import Board, Stopped
from rl_engine.config import RFTConfig
from rl_engine.rewards import RewardError, RolloutSample, Task, run_service, score_rollouts
from rl_engine.rewards.reward_model import ModelRewardFn
from rl_engine.rewards.run_service import SERVICE_KEY, has_reward_role, run_reward, serve, service_locator
from rl_engine.rewards.services import Service


def classifier_dir(tmp_path) -> str:
    """What check_classifier reads of a classifier (its config.json): nothing here loads it."""
    d = tmp_path / "rm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}))
    return str(d)


def config(rm: str, placement: str = "deployments", eval_reward: dict | None = None, **reward) -> RFTConfig:
    data = {
        "model": {"path": rm},
        "taskset": {"path": "t.jsonl", "reward": {"type": "model", "path": rm, **reward}},
        "placement": {"type": placement, **({"start_timeout_s": 0.3} if placement == "deployments" else {})},
    }
    if eval_reward is not None:
        data["eval"] = {"tasksets": [{"name": "e", "path": "t.jsonl", "reward": eval_reward}]}
    return RFTConfig.model_validate(data)


def test_only_a_model_reward_under_deployments_has_the_reward_roles_service(tmp_path):
    rm = classifier_dir(tmp_path)
    board = Board.at(str(tmp_path / "run"))
    local = config(rm, "local")
    assert not has_reward_role(local)
    assert run_reward(local.taskset.reward, local, board).locate is None  # one service per process, as before
    cfg = config(rm, eval_reward={"type": "model", "path": rm, "normalize": "running", "timeout_s": 5})
    assert has_reward_role(cfg)
    assert run_reward(cfg.taskset.reward, cfg, board).locate is not None
    assert run_reward(cfg.taskset.reward, cfg, None).locate is None  # no board (`rft eval`): its own
    same = cfg.eval.tasksets[0].reward  # other client settings, the same service
    assert run_reward(same, cfg, board).locate is not None
    other = cfg.eval.tasksets[0].reward.model_copy(update={"batch_size": 3})  # another service: its own
    assert run_reward(other, cfg, board).locate is None
    rule = RFTConfig.model_validate(
        {**cfg.model_dump(mode="json"), "taskset": {"path": "t.jsonl", "reward": {"type": "arithmetic"}}}
    )
    assert not has_reward_role(rule)  # a rule reward: no reward role, and an eval set's model reward is its own
    assert run_reward(rule.eval.tasksets[0].reward, rule, board).locate is None


def test_the_explorers_wait_for_the_posted_service_and_name_the_reward_role_past_the_timeout(tmp_path):
    cfg = config(classifier_dir(tmp_path))
    board = Board.at(str(tmp_path / "run"), poll_s=0.02)
    locate = service_locator(board, cfg.placement)
    started = time.monotonic()
    with pytest.raises(
        RewardError,
        match=r"the reward role did not post its service within placement.start_timeout_s = 0.3 s: .*rft-reward/default",
    ):
        locate()
    assert 0.3 <= time.monotonic() - started < 5
    threading.Timer(0.1, board.post, args=(SERVICE_KEY, {"url": "http://10.0.0.7:4242", "starts": 1})).start()
    assert locate() == "http://10.0.0.7:4242"  # posted while it waited
    stop = threading.Event()
    stop.set()
    board.clear()
    with pytest.raises(Stopped):
        service_locator(board, cfg.placement, stop)()


class _Scores(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        pairs = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["pairs"]
        body = json.dumps({"scores": [float(len(r)) for _, r in pairs], "batch_sizes": [len(pairs)]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_step_after_a_failed_request_locates_the_service_again(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scores)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = ThreadingHTTPServer(("127.0.0.1", 0), _Scores)  # bound, then closed: nothing answers there
    dead_url = f"http://127.0.0.1:{dead.server_address[1]}"
    dead.server_close()
    urls = [dead_url, f"http://127.0.0.1:{server.server_address[1]}"]
    asked: list[str] = []

    def locate() -> str:
        asked.append(urls[len(asked)])
        return asked[-1]

    fn = ModelRewardFn(classifier_dir(tmp_path), batch_size=2, locate=locate)
    samples = [RolloutSample("p", r, Task(f"t{i}", "p", None, {}), "stop") for i, r in enumerate(["a", "bb", "ccc"])]
    try:
        first = score_rollouts(fn, samples, failed_reward=-1.0)
        assert first.rewards == [-1.0] * 3 and first.metrics["reward/model/failures"] == 3
        assert score_rollouts(fn, samples).rewards == [1.0, 2.0, 3.0]  # the service it located again
        assert score_rollouts(fn, samples).rewards == [1.0, 2.0, 3.0]
        assert asked == urls  # once per failure, not per step
        assert fn._service is None  # it started none of its own
    finally:
        fn.close()
        server.shutdown()
        server.server_close()


def test_the_reward_role_keeps_its_service_up_until_done(tmp_path, monkeypatch):
    """serve() with stand-in service processes: posted on the board, started again and posted
    again when it dies, stopped once done."""
    started: list[Service] = []

    def start(settings) -> Service:
        assert settings["host"] == "10.1.2.3" and settings["batch_size"] == 4
        started.append(Service(subprocess.Popen(["sleep", "300"]), f"http://10.1.2.3:{4000 + len(started)}"))
        return started[-1]

    monkeypatch.setattr(run_service, "start_model_service", start)
    monkeypatch.setattr(run_service, "_CHECK_S", 0.02)
    cfg = config(classifier_dir(tmp_path), batch_size=4, host="10.1.2.3")
    board = Board.at(str(tmp_path / "run"))
    finish = threading.Event()
    role = threading.Thread(target=serve, args=(board, cfg.taskset.reward, finish.is_set))
    role.start()
    try:
        deadline = time.monotonic() + 10
        while not board.get(SERVICE_KEY) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert board.get(SERVICE_KEY)["url"] == "http://10.1.2.3:4000" and board.get(SERVICE_KEY)["starts"] == 1
        started[0].proc.kill()
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        assert board.get(SERVICE_KEY)["url"] == "http://10.1.2.3:4001" and board.get(SERVICE_KEY)["starts"] == 2
        assert started[1].alive
    finally:
        finish.set()
        role.join(10)
    assert not role.is_alive() and len(started) == 2
    assert all(s.proc.wait(5) is not None for s in started)  # nothing left running
