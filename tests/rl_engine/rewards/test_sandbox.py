"""The sandbox (rl_engine/rewards/sandbox.py) and the code_tests reward on it
(rl_engine/rewards/code_tests.py): hostile code is contained in bounded time, its sample scores 0
and is counted, and this process is unharmed; honest code scores the fraction of its tests.

The hostile programs are harness/hostile_code.py's (bench.rewards runs them too): each would pass
its test were it not contained (it returns the right answer only when its attack worked, or it
never ends), so a 0 is the containment, not a wrong answer; each is also run alone in the sandbox
(its status, its output free of the secret). Timeouts here are 2 s; every run ends by then plus
the keeper's stop (STOP_GRACE_S).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness.hostile_code import CASES, TESTS, baited, contain, fenced
from rl_engine.errors import UserError
from rl_engine.rewards import RolloutSample, Task, build_reward, score_rollouts
from rl_engine.rewards import sandbox as sandbox_mod
from rl_engine.rewards.code_tests import CodeTestsRewardFn, extract_code, split_tests
from rl_engine.rewards.sandbox import (
    ROOT_UID_BASE,
    STOP_GRACE_S,
    Sandbox,
    SandboxLimits,
    namespaces_available,
)

TIMEOUT_S = 2.0
BOUND_S = TIMEOUT_S + STOP_GRACE_S + 2.0  # the longest a contained run may take, start-up included
LIMITS = {"timeout_s": TIMEOUT_S, "cpu_s": 2, "memory_mb": 256, "file_size_mb": 8, "disk_mb": 32, "output_kb": 64}
NAMESPACES, WHY = namespaces_available()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason=f"no namespaces on this machine: {WHY}")


@pytest.fixture(scope="module")
def reward():
    if not NAMESPACES:
        pytest.skip(f"the code_tests reward refuses to start here: {WHY}")
    return CodeTestsRewardFn(workers=2, sandbox=LIMITS)


def task(tests=None, tid="t0") -> Task:
    return Task(tid, "Write add(a, b).", None, {"tests": TESTS if tests is None else tests})


def score(reward, *responses: str, tests=None):
    """score_rollouts of the responses (each against `tests`); (result, wall seconds)."""
    samples = [RolloutSample("p", r, task(tests, f"t{i}"), "stop") for i, r in enumerate(responses)]
    started = time.monotonic()
    result = score_rollouts(reward, samples)
    return result, time.monotonic() - started


def processes_of(uid: int) -> list[int]:
    """The processes of `uid` alive on the machine."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid == uid:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def nothing_left(run) -> None:
    """No process of the run is alive (seen by its own uid: as root; elsewhere not checked)."""
    if run.uid is None:
        return
    assert run.uid >= ROOT_UID_BASE
    deadline = time.monotonic() + 5.0
    while processes_of(run.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_of(run.uid)


# --------------------------------------------------------------------------- hostile code


@pytest.fixture
def bait(tmp_path, monkeypatch):
    """A fake secret in files outside the sandbox and in the environment, a listener on 127.0.0.1."""
    with baited(tmp_path) as b:
        for name in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "PREFECT_API_KEY", "WANDB_API_KEY"):
            monkeypatch.setenv(name, b.secret)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))  # were the environment passed on, ~ would hold the secret
        yield b


def assert_contained(reward, name: str, bait) -> None:
    verdict = contain(reward, CASES[name], bait)
    assert verdict.contained, f"{name}: {verdict.detail}"


@needs_namespaces
def test_a_fork_bomb_is_contained(reward, bait):
    assert_contained(reward, "fork_bomb", bait)
    run = reward.sandbox.run_python(CASES["fork_bomb"].code(bait))
    assert run.status == "timeout"
    nothing_left(run)


@needs_namespaces
def test_an_infinite_loop_is_killed_at_the_timeout(reward, bait):
    assert_contained(reward, "infinite_loop", bait)


@needs_namespaces
def test_a_memory_bomb_is_refused_its_memory(reward, bait):
    assert_contained(reward, "memory_bomb", bait)
    assert "MemoryError" in reward.sandbox.run_python(CASES["memory_bomb"].code(bait)).output


@needs_namespaces
def test_a_10_gb_file_is_stopped_at_the_file_size_limit(reward, bait):
    assert_contained(reward, "file_10gb", bait)
    assert "File too large" in reward.sandbox.run_python(CASES["file_10gb"].code(bait)).output


@needs_namespaces
def test_many_files_stop_at_the_working_directory_size(reward, bait):
    assert_contained(reward, "disk_fill", bait)
    assert "No space left on device" in reward.sandbox.run_python(CASES["disk_fill"].code(bait)).output


@needs_namespaces
def test_credentials_and_files_outside_the_sandbox_cannot_be_read(reward, bait, tmp_path):
    assert_contained(reward, "read_secrets", bait)
    # Not merely unreadable: outside its root nothing of the machine exists for it.
    run = reward.sandbox.run_python(
        f"import os\nprint(os.path.exists({str(tmp_path)!r}), os.path.exists('/work'), sorted(os.environ))"
    )
    assert run.output.strip() == "False False ['HOME', 'LANG', 'PATH', 'TMPDIR']"


@needs_namespaces
def test_a_socket_to_a_local_listener_never_connects(reward, bait):
    assert_contained(reward, "socket_localhost", bait)
    assert reward.sandbox.run_python(CASES["socket_localhost"].code(bait)).output.strip() == "False"


@needs_namespaces
def test_killing_the_parent_fails_and_this_process_lives(reward, bait):
    assert_contained(reward, "kill_parent", bait)
    assert os.getpid() == bait.pid


@needs_namespaces
def test_printing_a_gigabyte_is_cut_at_the_output_limit(reward, bait):
    started = time.monotonic()
    assert_contained(reward, "print_1gb", bait)
    assert time.monotonic() - started < TIMEOUT_S  # cut at 64 KiB, not timed out


@needs_namespaces
def test_what_a_run_leaves_behind_dies_with_it():
    box = Sandbox(SandboxLimits(**LIMITS))
    run = box.run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('left')")
    assert run.status == "ok" and run.output == "left\n"
    nothing_left(run)


@needs_namespaces
def test_a_user_namespace_sandbox_drops_its_capabilities():
    box = Sandbox(SandboxLimits(**LIMITS), isolation="namespaces", userns=True)
    run = box.run_python(
        "import os, socket\n"
        "for what, fn in (('chroot', lambda: os.chroot('/tmp')), ('setuid', lambda: os.setuid(5)),\n"
        "                 ('net', lambda: socket.create_connection(('127.0.0.1', 22), timeout=1))):\n"
        "    try:\n"
        "        fn()\n"
        "        print(what, 'allowed')\n"
        "    except OSError as e:\n"
        "        print(what, 'refused')\n"
        "print(os.path.exists('/work'), os.getuid())\n"
    )
    assert run.status == "ok", run.output
    assert run.output.split("\n")[:4] == ["chroot refused", "setuid refused", "net refused", "False 0"]


# --------------------------------------------------------------------------- correctness


@needs_namespaces
def test_all_some_and_no_tests_passed(reward):
    right = "def add(a, b):\n    return a + b\n"
    half = "def add(a, b):\n    return a + b if a > 0 else 7\n"  # passes tests 0 and 2
    result, _ = score(reward, fenced(right), fenced(half), fenced("def add(a, b):\n    return 7\n"))
    assert result.rewards == [1.0, 0.5, 0.0]
    assert result.metrics["reward/sandbox/passed_frac"] == pytest.approx(0.5)
    assert result.metrics["reward/sandbox/runs"] == 3 and result.metrics["reward/sandbox/errors"] == 0


@needs_namespaces
def test_a_syntax_error_scores_0_counted(reward):
    result, _ = score(reward, fenced("def add(a, b)\n    return a + b\n"))
    assert result.rewards == [0.0] and result.metrics["reward/sandbox/errors"] == 1


@needs_namespaces
def test_without_a_code_block_the_whole_response_is_the_code(reward):
    result, _ = score(reward, "def add(a, b):\n    return a + b\n", "I would add the two numbers.")
    assert result.rewards == [1.0, 0.0]
    assert result.metrics["reward/sandbox/errors"] == 1  # the prose is a syntax error


@needs_namespaces
def test_all_or_nothing():
    box = CodeTestsRewardFn(scoring="all_or_nothing", sandbox=LIMITS)
    half = "def add(a, b):\n    return a + b if a > 0 else 7\n"
    result, _ = score(box, fenced("def add(a, b):\n    return a + b\n"), fenced(half))
    assert result.rewards == [1.0, 0.0]


@needs_namespaces
def test_a_test_snippet_counts_each_top_level_assert(reward):
    snippet = "def check(f):\n    return f(2, 2)\nassert check(add) == 4\nx = add(1, 1)\nassert x == 3\n"
    result, _ = score(reward, fenced("def add(a, b):\n    return a + b\n"), tests=snippet)
    assert result.rewards == [0.5]


@needs_namespaces
def test_a_task_without_tests_is_left_out_and_counted(reward):
    samples = [
        RolloutSample("p", fenced("def add(a, b):\n    return a + b\n"), task(), "stop"),
        RolloutSample("p", "x", Task("bare", "p", None, {"question": "p"}), "stop"),
    ]
    result = score_rollouts(reward, samples)
    assert result.rewards == [1.0, None] and result.metrics["reward/errors"] == 1
    assert "no 'tests' column" in result.errors[1]


@needs_namespaces
def test_a_step_runs_its_samples_in_parallel_within_its_bound():
    box = CodeTestsRewardFn(workers=4, sandbox={**LIMITS, "timeout_s": 5.0})
    sleepy = fenced("import time\ntime.sleep(1.5)\ndef add(a, b):\n    return a + b\n")
    result, wall = score(box, *[sleepy] * 4)
    assert result.rewards == [1.0] * 4
    assert wall < 4.5  # 4 x 1.5 s one at a time would be > 6 s
    box = CodeTestsRewardFn(workers=4, sandbox=LIMITS)
    stuck = fenced("import time\ntime.sleep(1000)\n")
    result, wall = score(box, *[stuck] * 4)
    assert result.rewards == [0.0] * 4 and result.metrics["reward/sandbox/timeouts"] == 4
    assert wall < 2 * TIMEOUT_S + 2.0  # one timeout for all four (four in a row: > 8 s)


def test_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("```py\ny = 1\n```") == "y = 1\n"
    assert extract_code("```\nz = 1\n```\n```bash\nls\n```") == "z = 1\n"
    assert extract_code("```python\ncut = 1") == "cut = 1"  # the token budget ended it
    assert extract_code("return 1") == "return 1"


def test_split_tests():
    assert split_tests(["assert f(1) == 1", "assert f(2) == 2"]) == ["assert f(1) == 1", "assert f(2) == 2"]
    assert split_tests("x = 1\nassert x == 1\nassert x > 0\ncheck(x)") == [
        "x = 1\nassert x == 1",
        "assert x > 0",
        "check(x)",
    ]
    assert split_tests("check(f)") == ["check(f)"]
    for bad in ([], "", ["assert 1", 2], 3):
        with pytest.raises(ValueError):
            split_tests(bad)
    with pytest.raises(ValueError, match="not valid Python"):
        split_tests("assert (")


# --------------------------------------------------------------------------- where namespaces are refused


def test_without_namespaces_the_reward_refuses_to_start_unless_allowed(monkeypatch):
    monkeypatch.setattr(
        sandbox_mod, "namespaces_available", lambda userns=None: (False, "unshare: Operation not permitted")
    )
    from rl_engine.config import CodeTestsReward

    with pytest.raises(
        UserError, match=r"taskset\.reward\.sandbox: this machine cannot .*Operation not permitted.*allow_network: true"
    ):
        build_reward(CodeTestsReward(type="code_tests"))
    cfg = CodeTestsReward(type="code_tests", sandbox={"allow_network": True})
    if os.geteuid() == 0 and not sandbox_mod._readable_by_others(sandbox_mod.sys.base_prefix):
        with pytest.raises(UserError, match="would run as root"):
            build_reward(cfg)
    else:
        assert build_reward(cfg).sandbox.isolation == "none"


def test_without_namespaces_the_limits_timeout_and_environment_still_hold(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "FAKE-SECRET")
    box = Sandbox(SandboxLimits(**LIMITS, allow_network=True), isolation="none", allow_root=True)
    assert "no namespaces" in box.guarantees()
    assert box.run_python("import os\nprint(sorted(os.environ))").output.strip() == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    started = time.monotonic()
    assert box.run_python("while True:\n    pass\n").status == "timeout"
    assert time.monotonic() - started < BOUND_S
    assert box.run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n").status == "output_limit"
    big = box.run_python("with open('big', 'wb') as f:\n    f.write(b'0' * (64 << 20))\n")
    assert big.status == "error" and "File too large" in big.output
    assert "MemoryError" in box.run_python("hog = bytearray(8 << 30)").output


def test_preflight_refuses_the_run_before_any_engine_starts(monkeypatch, tmp_path):
    from rl_engine.config import load_config
    from rl_engine.run.preflight import check_inputs

    monkeypatch.setattr(
        sandbox_mod, "namespaces_available", lambda userns=None: (False, "unshare: Operation not permitted")
    )
    code_yaml = Path(__file__).resolve().parents[3] / "configs" / "code.yaml"
    cfg = load_config(str(code_yaml), [f"buffer.storage.url={tmp_path / 'runs'}"])
    with pytest.raises(UserError, match=r"taskset\.reward\.sandbox: .*the run refuses to start"):
        check_inputs(cfg)
