"""What `rft run` prints (cli/progress.py): a progress line with trainer step / total, the latest
reward and an ETA, redrawn in place on a TTY and a plain line every `monitor.log_every` steps in a
pipe; the engines' and libraries' output goes to `<run>/logs/engines.log`, and a failing run still
shows its error on the terminal.

The slow tests drive the real `rft run` as a subprocess (its own ephemeral Prefect server, a real
vLLM engine and DeepSpeed trainer); the others drive the progress line on real files and a real pty.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli.progress import ProgressLine, StageLine, follow
from harness.runs import small_config, write_config
from rl_engine.config import validate_config
from rl_engine.run.context import start_run
from rl_engine.run.report import record_step

RFT = str(Path(sys.executable).with_name("rft"))
PROGRESS = re.compile(
    r"^step (\d+)/(\d+) \[[#.]{20}\] +\d+%  reward (-|\d+\.\d{3})(  (\d+\.\d) s/step)?  ETA (\d+:\d\d:\d\d|--:--:--)$"
)
ENGINE_LINE = re.compile(
    r"\b(INFO|DEBUG)\b|\((EngineCore|VllmWorker|Worker|MainProcess) pid=|Loading safetensors|Writing model shards"
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Sink:
    def __init__(self, tty: bool) -> None:
        self.text, self._tty = "", tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self._tty


def test_progress_line_rate_eta_and_pipe_cadence():
    """ETA = seconds per step since the first step seen (start-up excluded) x steps left; in a pipe a
    line at the first step, whenever a multiple of `every` is crossed, and at the last step."""
    clock, out = Clock(), Sink(tty=False)
    line = ProgressLine(out, total=10, every=3, tty=False, clock=clock)
    clock.t += 60.0  # start-up: engines, Prefect
    assert line.text() == "step 0/10  starting: engines and Prefect (60 s)"
    for step, at in ((1, 0.0), (2, 2.0), (4, 6.0), (5, 8.0), (6, 10.0), (10, 18.0)):
        clock.t = 160.0 + at
        line.seen(step, 0.25 * step)
        line.draw()
    lines = out.text.splitlines()
    assert [int(PROGRESS.match(s).group(1)) for s in lines] == [1, 4, 6, 10], out.text  # 2 and 5 cross no multiple of 3
    assert lines[0].endswith("reward 0.250  ETA --:--:--")  # one step seen: no rate yet
    assert lines[1] == "step 4/10 [########............]  40%  reward 1.000  2.0 s/step  ETA 0:00:12"
    assert lines[-1].endswith("100%  reward 2.500  2.0 s/step  ETA 0:00:00")


@pytest.mark.parametrize("tty", [True, False])
def test_stage_line_of_a_held_out_scoring(tty):
    """`rft demo --model smollm2`'s line per held-out scoring (StageLine): on a TTY one line redrawn
    in place (its bar of stages, the stage, the seconds) that ends with the result; in a pipe a
    line at the start and one with the result."""
    clock, out = Clock(), Sink(tty=tty)
    with StageLine(out, "scoring the base model on 8 held-out problems", 3, clock=clock, tick_s=60) as line:
        for i, stage in enumerate(("starting the engine", "greedy", "temperature 1")):
            line.stage(stage, i)
            clock.t += 10.0
        line.result = "greedy 25.0%, temperature 1 12.5% exact"
    end = "scoring the base model on 8 held-out problems: greedy 25.0%, temperature 1 12.5% exact (30 s)"
    if not tty:
        assert out.text == f"scoring the base model on 8 held-out problems ...\n{end}\n"
        return
    assert out.text.count("\n") == 1 and out.text.endswith(f"\r{end}\x1b[K\n"), out.text
    drawn = [s.removesuffix("\x1b[K") for s in out.text.split("\r") if s][:-1]
    assert drawn == [
        "scoring the base model on 8 held-out problems [............] starting the engine (0 s)",
        "scoring the base model on 8 held-out problems [####........] greedy (10 s)",
        "scoring the base model on 8 held-out problems [########....] temperature 1 (20 s)",
    ], drawn


def test_follow_redraws_one_line_in_place_on_a_tty(tiny_model_dir, task_file, tmp_path):
    """On a real pty: every redraw starts with a carriage return, the line is cleared, and the
    terminal gets one newline, at the end; the steps come from the trainer's metrics on storage."""
    run = start_run(validate_config(small_config(tiny_model_dir, task_file, str(tmp_path), total_steps=4)))
    master, slave = os.openpty()
    out = os.fdopen(slave, "w", buffering=1)
    got = bytearray()
    reader = threading.Thread(target=lambda: _drain(master, got), daemon=True)
    reader.start()
    with follow(run.url, None, 4, 1, out, poll_s=0.05):
        for step in range(1, 5):
            time.sleep(0.3)
            record_step(run, "trainer", step, {"step": step, "reward_mean": step / 10})
        time.sleep(0.3)
    out.close()
    reader.join(5)
    os.close(master)
    text = got.decode()
    frames = [f for f in (f.strip().removesuffix("\x1b[K") for f in text.split("\r")) if f]
    assert text.count("\n") == 1 and text.endswith("\x1b[K\r\n"), repr(text[-200:])  # the pty maps \n to \r\n
    assert frames[0].startswith("step 0/4  starting"), frames[:3]
    steps = [int(m.group(1)) for f in frames if (m := PROGRESS.match(f))]
    assert steps[-1] == 4 and steps == sorted(steps) and {1, 2, 3} & set(steps), frames
    rate = float(PROGRESS.match(frames[-1]).group(5))
    assert 0.2 <= rate <= 0.6, frames[-1]  # steps were written 0.3 s apart


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the slave side closed
            return
        if not chunk:
            return
        into += chunk


def rft(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    # As a user's shell: its own ephemeral server, and engines closed when the run ends (not kept for reuse).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "RFT_KEEP_ENGINES"}
    env |= {"PREFECT_HOME": str(cwd / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    return subprocess.run(
        [RFT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rft_run_prints_progress_and_logs_engines_to_the_run(tiny_model_dir, task_file, tmp_path):
    data = small_config(tiny_model_dir, task_file, str(tmp_path / "runs"), total_steps=3)
    data["synchronizer"]["collective"].pop("port")
    data["monitor"]["artifacts"] = False
    res = rft(["run", write_config(tmp_path / "c.yaml", data)], tmp_path, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout.splitlines()
    progress = [m for s in out if (m := PROGRESS.match(s))]
    assert [int(m.group(1)) for m in progress][-1] == 3 and all(m.group(2) == "3" for m in progress), res.stdout
    assert all(m.group(3) != "-" for m in progress)  # every line has a reward
    if len({m.group(1) for m in progress}) > 1:  # a rate needs two steps seen; 3 steps may pass within one poll
        assert any(m.group(6) != "--:--:--" for m in progress), res.stdout  # then an ETA is shown
    noise = [s for s in out + res.stderr.splitlines() if ENGINE_LINE.search(s)]
    assert not noise, noise[:10]
    assert len(out) < 25, res.stdout  # header, progress, summary: not hundreds of lines

    run_dir = Path(re.search(r"^run:\s+(\S+)", res.stdout, re.MULTILINE).group(1))
    log = (run_dir / "logs" / "engines.log").read_text()
    assert f"engine and library logs in {run_dir}/logs/engines.log" in out[0]
    assert re.search(r"\(MainProcess pid=\d+\) INFO .*Initializing a V1 LLM engine", log), log[
        -2000:
    ]  # vLLM's EngineCore (in the run's process on CPU)
    assert re.search(r"\(VllmWorker-0 pid=\d+\) INFO ", log), log[-2000:]  # the engine's worker process's own lines
    assert (
        "Flow run 'synchronous-" in log and "train t=   3" in log
    )  # Prefect's INFO lines: the file and the UI, not the terminal


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_run_shows_its_error_on_the_terminal(tiny_model_dir, task_file, tmp_path):
    """The run fails inside its flow (its lineage is busy) while the terminal is redirected: the error
    and where the log is still reach stderr, exit code 2, no traceback."""
    from rl_engine.config import LineageConfig
    from rl_engine.run import lineage

    storage = tmp_path / "runs"
    data = small_config(tiny_model_dir, task_file, str(storage), total_steps=2) | {
        "lineage": {"name": "busy", "when_busy": "refuse"}
    }
    held = lineage.lock(lineage.lineage_url(str(storage), "busy"), {}, LineageConfig(name="busy"))
    try:
        res = rft(["run", write_config(tmp_path / "c.yaml", data)], tmp_path, timeout=240)
    finally:
        held.release()
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"^error: lineage 'busy' is busy: .*when_busy", res.stderr, re.MULTILINE), res.stderr
    log = re.search(r"^the run's engine and library logs: (\S+)$", res.stderr, re.MULTILINE).group(1)
    assert "lineage 'busy' is busy" in Path(log).read_text()
    assert "Traceback" not in res.stdout + res.stderr


def test_the_line_shows_the_reward_service_from_the_explorer_metrics(tmp_path):
    """With a reward that asks a service, the line carries the explorer's latest figure of it (read
    from the run's storage, as the steps are): the model's ms per request and batch size, the
    judge's ms per request, the sandbox's ms per run; a step without a figure keeps the last one."""
    import json

    from cli.progress import reward_service_text
    from rl_engine.run.report import METRICS_DIR

    assert reward_service_text({"reward/model/latency_ms": 85.2, "reward/model/batch_size": 16.0}) == (
        "reward model 85 ms/request, batch 16"
    )
    assert reward_service_text({"reward/judge/latency_ms": 1210.0}) == "judge 1210 ms/request"
    assert reward_service_text({"reward/sandbox/run_ms_mean": 41.0}) == "sandbox 41 ms/run"
    assert reward_service_text({"reward/model/latency_ms": float("nan")}) is None  # every request failed
    assert reward_service_text({"reward_mean": 0.5}) is None

    def write(role: str, step: int, metrics: dict) -> None:
        d = tmp_path / METRICS_DIR / f"role={role}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"step={step:08d}.json").write_text(json.dumps({"step": step, **metrics}))

    write("trainer", 1, {"reward_mean": 0.5})
    write("explorer-0", 1, {"reward/model/latency_ms": 85.2, "reward/model/batch_size": 16.0})
    out = Sink(tty=False)
    with follow(str(tmp_path), None, 4, 1, out, poll_s=0.05, reward_service=True) as line:
        deadline = time.monotonic() + 10
        while line.service is None and time.monotonic() < deadline:
            time.sleep(0.05)
        write("explorer-0", 2, {"reward/model/latency_ms": float("nan")})  # a step whose requests all failed
        write("trainer", 2, {"reward_mean": 0.7})
        while line.step < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert out.text.splitlines()[-1].startswith("step 2/4 ") and "reward model 85 ms/request, batch 16  ETA" in out.text
    out = Sink(tty=False)
    with follow(str(tmp_path), None, 4, 1, out, poll_s=0.05):  # a rule reward: no service read
        pass
    assert "ms/request" not in out.text
