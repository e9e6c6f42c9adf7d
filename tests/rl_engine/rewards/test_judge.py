"""The judge reward (rl_engine/rewards/judge.py) against a scripted OpenAI-compatible server in
this process and against a real vLLM engine server on the tiny model: templates filled per
sample, verdicts parsed (yes/no, a number, a function), requests sent concurrently, the key taken
from the environment and never shown, a slow or unreachable judge failing into failed_reward or
the step as configured, unparsed replies left out and counted.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_engine.config import ConfigError, JudgeReward, load_config
from rl_engine.errors import UserError
from rl_engine.rewards import RewardError, RolloutSample, Task, build_reward, score_rollouts
from rl_engine.rewards.judge import JudgeRewardFn

SECRET = "sk-test-7f3a9c"  # a fake key: what must never show
RELEASE_S = 30.0  # the slow handler's longest wait (released at the fixture's end)


class Scripted:
    """An OpenAI-compatible server: a reply per request from `reply(text)`, the requests kept."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[str | None] = []
        self.lock = threading.Lock()
        self.slow = threading.Event()  # set: every request waits for `release` (or RELEASE_S)
        self.release = threading.Event()
        self.barrier: threading.Barrier | None = None  # set: the first requests wait for each other
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append({"path": self.path, **body})
                    outer.headers.append(self.headers.get("Authorization"))
                if outer.barrier is not None:
                    outer.barrier.wait()  # all `parties` requests in flight at once, or BrokenBarrierError
                if outer.slow.is_set():
                    outer.release.wait(RELEASE_S)
                text = body["messages"][0]["content"] if self.path.endswith("/chat/completions") else body["prompt"]
                reply = outer.reply(text)
                choice = {"message": {"role": "assistant", "content": reply}} if "messages" in body else {"text": reply}
                data = json.dumps({"choices": [choice]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def reply(text: str) -> str:
        """ "Yes." when the proposed answer is the reference, " no" otherwise; "score: N" asks give N."""
        if m := re.search(r"score it: (\d+)", text):
            return f" I'd give it score: {m.group(1)}/10"
        if "mumble" in text:
            return " hmm, hard to say"
        proposed = re.search(r"Proposed answer: (.*)\n", text).group(1)
        reference = re.search(r"Reference answer: (.*)\n", text).group(1)
        return " Yes." if proposed.strip() == reference.strip() else " no"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge_server():
    s = Scripted()
    yield s
    s.close()


ANSWERS = [("2+3=", "5", "5"), ("4+4=", "9", "8"), ("1+1=", " 2 ", "2"), ("7-2=", "five", "5"), ("9+0=", "9", "9")]


def samples(rows=ANSWERS) -> list[RolloutSample]:
    return [RolloutSample(p, r, Task(f"t{i}", p, a, {}), "stop") for i, (p, r, a) in enumerate(rows)]


def judge(url: str, **kw) -> JudgeRewardFn:
    return build_reward(JudgeReward(type="judge", base_url=url, model="judge-model", **kw))


@pytest.mark.parametrize("chat", [False, True])
def test_yes_no_verdicts_in_order_with_the_template_filled(judge_server, chat):
    fn = judge(judge_server.url, chat=chat)
    result = score_rollouts(fn, samples())
    assert result.rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert result.metrics["reward/judge/unparsed"] == result.metrics["reward/judge/failures"] == 0
    assert result.metrics["reward/judge/latency_ms"] > 0
    sent = sorted(judge_server.requests, key=lambda r: str(r.get("prompt") or r["messages"]))
    assert {r["path"] for r in sent} == {"/v1/chat/completions" if chat else "/v1/completions"}
    assert all(r["model"] == "judge-model" and r["temperature"] == 0.0 and r["max_tokens"] == 16 for r in sent)
    text = sent[0]["messages"][0]["content"] if chat else sent[0]["prompt"]
    assert text.startswith("Question: 1+1=\nProposed answer:  2 \nReference answer: 2\n")


def test_number_pattern_and_function_parsers(judge_server):
    rows = [("q", "a", "score it: 7"), ("q", "b", "score it: 3")]
    tpl = "{prompt} {response} {answer}"
    assert score_rollouts(judge(judge_server.url, template=tpl, parser="number"), samples(rows)).rewards == [7.0, 3.0]
    fn = judge(judge_server.url, template=tpl, parser="number", pattern=r"(\d+)/10")
    assert score_rollouts(fn, samples(rows)).rewards == [7.0, 3.0]
    fn = judge(judge_server.url, template=tpl, parser="harness.rewards:reply_length")
    assert score_rollouts(fn, samples(rows)).rewards == [float(len(" I'd give it score: 7/10"))] * 2


def test_an_unparsed_reply_is_left_out_and_counted(judge_server):
    rows = [("q", "mumble", "x"), *ANSWERS[:2]]
    result = score_rollouts(
        judge(
            judge_server.url, template="{prompt}|{response}|Proposed answer: {response}\nReference answer: {answer}\n"
        ),
        samples(rows),
    )
    assert result.rewards == [None, 1.0, 0.0]
    assert result.metrics["reward/errors"] == result.metrics["reward/judge/unparsed"] == 1
    assert "no verdict the parser reads" in result.errors[0]


def test_a_parser_that_raises_leaves_its_sample_out(judge_server):
    fn = judge(judge_server.url, parser="harness.rewards:strict_verdict")
    result = score_rollouts(fn, samples(ANSWERS[:2] + [("q", "mumble", "x")]))
    assert result.rewards == [1.0, 0.0, None]  # " Yes." and " no" parse; "hmm, hard to say" raises KeyError
    assert result.metrics["reward/errors"] == 1 and "the parser failed" in result.errors[2]


def test_requests_of_a_step_are_in_flight_together(judge_server):
    judge_server.barrier = threading.Barrier(4, timeout=20)  # sent one by one, the first would wait in vain
    result = score_rollouts(judge(judge_server.url, concurrency=4), samples(ANSWERS[:4]))
    assert result.rewards == [1.0, 0.0, 1.0, 0.0]


def test_the_key_comes_from_the_environment_and_is_never_shown(judge_server, monkeypatch):
    with pytest.raises(
        UserError, match="taskset.reward.api_key_env = 'JUDGE_KEY_T': that environment variable is not set"
    ):
        judge(judge_server.url, api_key_env="JUDGE_KEY_T")
    monkeypatch.setenv("JUDGE_KEY_T", SECRET)
    fn = judge(judge_server.url, api_key_env="JUDGE_KEY_T", on_failure="fail")
    assert score_rollouts(fn, samples()).ok == [True] * 5
    assert set(judge_server.headers) == {f"Bearer {SECRET}"}
    assert SECRET not in repr(fn) and SECRET not in json.dumps(
        JudgeReward.model_validate(
            {"type": "judge", "base_url": judge_server.url, "model": "m", "api_key_env": "JUDGE_KEY_T"}
        ).model_dump()
    )
    judge_server.close()  # gone: the error names the endpoint, not the key
    with pytest.raises(RewardError) as e:
        score_rollouts(fn, samples())
    assert "taskset.reward.base_url" in str(e.value) and SECRET not in str(e.value)


def test_a_slow_judge_times_out_into_failed_reward_without_waiting_per_sample(judge_server):
    judge_server.slow.set()
    fn = judge(judge_server.url, timeout_s=0.5, concurrency=2)
    result = score_rollouts(fn, samples(), failed_reward=-1.0)
    assert result.rewards == [-1.0] * 5
    assert result.metrics["reward/timeouts"] == result.metrics["reward/judge/timeouts"] == 5
    assert len(judge_server.requests) <= 2  # the first two timed out; the rest were never sent
    with pytest.raises(RewardError, match="the judge at taskset.reward.base_url = .* did not return within"):
        score_rollouts(fn, samples(ANSWERS[:1]))  # no failed_reward: nothing judged fails the step


@pytest.mark.parametrize("on_failure", ["failed_reward", "fail"])
def test_an_unreachable_judge_scores_failed_reward_or_fails_the_step(on_failure):
    from rl_engine.trainer.dist import free_port

    fn = judge(f"http://127.0.0.1:{free_port()}/v1", on_failure=on_failure)
    if on_failure == "fail":
        with pytest.raises(RewardError, match="the judge at taskset.reward.base_url = .* cannot be reached"):
            score_rollouts(fn, samples(), failed_reward=0.0)
    else:
        result = score_rollouts(fn, samples(), failed_reward=0.0)
        assert result.rewards == [0.0] * 5
        assert result.metrics["reward/crashes"] == result.metrics["reward/judge/failures"] == 5


def test_config_refuses_a_bad_template_or_parser(tmp_path):
    base = {
        "model": {"path": "m"},
        "taskset": {"path": "t.jsonl", "reward": {"type": "judge", "base_url": "http://h/v1", "model": "m"}},
    }
    cases = [
        ({"template": "{prompt} {verdict}"}, "placeholder {verdict}"),
        ({"template": "{prompt} only"}, "has no {response}"),
        ({"parser": "maybe"}, "use yes_no, number or an import path"),
        ({"api_key_env": "sk-abc"}, "taskset.reward.api_key_env"),
        ({"base_url": "127.0.0.1:8100"}, "taskset.reward.base_url"),
        ({"path": "runs/models/judge"}, "set base_url (an OpenAI-compatible endpoint, with model) or path"),
        ({"base_url": None}, "set base_url (an OpenAI-compatible endpoint, with model) or path"),
        ({"model": None}, "taskset.reward.model: the judge at base_url = 'http://h/v1' needs the model name"),
    ]
    for change, message in cases:
        data = json.loads(json.dumps(base))
        data["taskset"]["reward"].update(change)
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(str(path))


@pytest.mark.slow
def test_a_real_vllm_engine_server_judges(engine_server, tiny_model_dir):
    fn = build_reward(
        JudgeReward(
            type="judge", base_url=engine_server.url + "/v1", model=tiny_model_dir,
            template="{prompt}{response}", parser="harness.rewards:reply_length", max_tokens=4, timeout_s=120,
        )
    )  # fmt: skip
    result = score_rollouts(fn, samples([("1+", "1=", "2"), ("2+", "2=", "4"), ("3+", "3=", "6")]))
    assert result.ok == [True, True, True] and all(0 <= r <= 64 for r in result.rewards)  # 4 tokens of <= 16 bytes
    assert result.metrics["reward/judge/failures"] == result.metrics["reward/judge/timeouts"] == 0
    again = score_rollouts(fn, samples([("1+", "1=", "2"), ("2+", "2=", "4"), ("3+", "3=", "6")]))
    assert again.rewards == result.rewards  # greedy: the same verdicts


@pytest.mark.slow
def test_a_judge_on_an_engine_of_its_own(engine_server, tiny_model_dir, tmp_path):
    """`path` instead of base_url: the judge starts a vLLM engine of its own for the model directory
    (one per process and setting, shared by its clients), whose greedy replies are those of the
    same model served by `rft engine serve`; the last client's close stops it, children included;
    a directory that is no model fails the reward's build naming the field."""
    import psutil

    from rl_engine.rewards.services import SERVICES

    asked = dict(template="{prompt}{response}", parser="harness.rewards:reply_length", max_tokens=4, timeout_s=300)
    pairs = [("1+", "1=", "2"), ("2+", "2=", "4"), ("3+", "3=", "6")]
    served = build_reward(JudgeReward(type="judge", base_url=engine_server.url + "/v1", model=tiny_model_dir, **asked))
    own = JudgeReward(type="judge", path=tiny_model_dir, max_model_len=128, kv_cache_space_gib=0.25, **asked)
    a, b = build_reward(own), build_reward(own)
    started = SERVICES.started
    try:
        got = score_rollouts(a, samples(pairs))
        assert got.ok == [True] * 3 and got.rewards == score_rollouts(served, samples(pairs)).rewards
        assert score_rollouts(b, samples(pairs)).rewards == got.rewards
        assert SERVICES.started == started + 1  # one engine for both clients
        engine = a._service.proc
        root = psutil.Process(engine.pid)
        tree = [root, *root.children(recursive=True)]  # the server and its engine core
    finally:
        a.close()
        assert engine.poll() is None  # b still uses it
        b.close()
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive
    with pytest.raises(UserError, match="taskset.reward.path = .*no config.json"):
        build_reward(JudgeReward(type="judge", path=str(tmp_path), **asked))
