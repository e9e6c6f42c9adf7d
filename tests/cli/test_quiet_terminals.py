"""Commands that start engines keep the engines' and libraries' output off the terminal, as `make
demo` does (issue 44 item 5): `rft demo --model smollm2` (cli.demo_real: its held-out scorings
before and after the run printed vLLM's, Triton's and nanobind's lines, ~120 of 184) and `rft eval`
send what they and their child processes print to a log file, named first; the terminal shows a
line per held-out scoring (its stages, then its result), the run's progress and summary, and the
results. No engine here: the scoring and the run are stand-ins that print as vLLM does, on the
process's file descriptors and from a child process. `make demo` and `make demo-real` set what
keeps Prefect's first-import telemetry notice and DeepSpeed's accelerator guess off a terminal
(issue 49), checked on a pseudo-terminal with the libraries themselves.

    .venv/bin/python -m pytest tests/cli/test_quiet_terminals.py
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.runs import small_config
from rl_engine.config import validate_config
from rl_engine.run.context import start_run

NOISE = ("INFO 11-29 [core.py:93] Initializing a V1 LLM engine", "FutureWarning: a library's warning")


def noisy() -> None:
    """Print as an engine does: on fds 1 and 2 of this process, and from a child that inherits them."""
    os.write(1, f"{NOISE[0]}\n".encode())
    os.write(2, f"{NOISE[1]}\n".encode())
    subprocess.run([sys.executable, "-c", "print('nanobind: leaked 514 functions!')"], check=True)


def quiet(text: str) -> bool:
    return not any(n in text for n in (*NOISE, "nanobind"))


def test_rft_demo_smollm2_shows_its_lines_and_logs_the_engines(tiny_model_dir, task_file, tmp_path, monkeypatch, capfd):
    import cli.demo_real
    import cli.run
    import rl_engine.evaluate
    import rl_engine.run.preflight
    import rl_engine.run.report

    cfg = validate_config(small_config(tiny_model_dir, task_file, str(tmp_path / "runs"), total_steps=2))
    monkeypatch.setattr(cli.demo_real, "real_config", lambda root, overrides, config: (cfg, task_file))
    monkeypatch.setattr(rl_engine.run.preflight, "preflight", lambda c: c)
    scored = []

    def evaluate_model(cfg, model_dir, tasks, t1_samples=1, progress=None):
        for i, stage in enumerate(rl_engine.evaluate.STAGES):
            progress(stage, i)
            noisy()
        scored.append(model_dir)
        return {"tasks": float(len(tasks)), "greedy_exact": 0.25 * len(scored), "t1_exact": 0.125 * len(scored)}

    def run_config(cfg, resume=None):
        noisy()
        return {"run": cfg.run_url, "mode": "synchronous"}

    monkeypatch.setattr(rl_engine.evaluate, "evaluate_model", evaluate_model)
    monkeypatch.setattr(cli.run, "run_config", run_config)
    monkeypatch.setattr(
        rl_engine.run.report, "summary_lines", lambda s: [f"run:        {s['run']}  (mode {s['mode']})"]
    )
    assert cli.demo_real.demo_real(str(tmp_path / "runs"), [], 8) == 0
    out, err = capfd.readouterr()
    assert quiet(out + err) and not err, out + err
    run = scored[1].removesuffix("/model")
    log = Path(run, "logs", "engines.log").read_text()
    assert all(log.count(n) == 7 for n in (*NOISE, "nanobind")), log  # 2 scorings of 3 stages, and the run
    lines = out.splitlines()
    assert lines[1] == f"run {run}: engine and library logs in {run}/logs/engines.log", lines
    assert lines[2:4] == [
        "scoring the base model on 8 held-out problems ...",
        "scoring the base model on 8 held-out problems: greedy 25.0%, temperature 1 12.5% exact (0 s)",
    ], lines
    assert f"run:        {run}  (mode synchronous)" in lines
    assert lines[-1] == (
        f"held-out exact match over 8 problems: greedy 25.0% -> 50.0%, temperature 1 12.5% -> 25.0% (before -> after GRPO); trained model: {run}/model"
    ), lines
    assert len(lines) < 60


def test_rft_eval_shows_a_line_per_version_and_logs_the_engine(tiny_model_dir, task_file, tmp_path, monkeypatch, capfd):
    from rl_engine.roles import evaluate_run

    run = start_run(validate_config(small_config(tiny_model_dir, task_file, str(tmp_path), name="scored")))

    def evaluate_versions(cfg, versions, sets, storage_options=None, log=print):
        noisy()
        log(f"v0     {sets[0].name:<12} avg@4=0.5")
        return [{"version": 0, "heldout/pass@1": 0.5}]

    monkeypatch.setattr(evaluate_run, "evaluate_versions", evaluate_versions)
    assert evaluate_run.main([run.url, "--taskset", task_file]) == 0
    out, err = capfd.readouterr()
    assert quiet(out + err) and not err, out + err
    log = f"{run.url}/logs/engines-eval.log"
    assert out.splitlines()[:3] == [
        f"rft eval {run.url}: engine and library output in {log}",
        "scoring 1 version(s) on heldout ...",
        "v0     heldout      avg@4=0.5",
    ], out
    assert json.loads(out.splitlines()[-1]) == {"versions": [{"version": 0, "heldout/pass@1": 0.5}]}
    assert all(n in Path(log).read_text() for n in (*NOISE, "nanobind"))


# What a terminal showed from `make demo` before the Makefile set DO_NOT_TRACK and DS_ACCELERATOR.
LIBRARY_NOTICES = (
    "Prefect collects anonymous usage data",  # printed once per PREFECT_HOME, on a TTY only
    "Setting accelerator to CPU",  # DeepSpeed's warning when it guesses the accelerator
)
REPO = Path(__file__).resolve().parents[2]


def _on_a_terminal(cmd: list[str], env: dict[str, str], timeout_s: float = 120) -> str:
    """What `cmd` prints on a pseudo-terminal (stdout and stderr both on it, as in a shell)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return out.decode(errors="replace")


@pytest.mark.parametrize("target", ["demo", "demo-real"])
def test_make_demo_keeps_the_library_notices_off_the_terminal(target, tmp_path):
    """`make demo`'s environment, with a stand-in `rft` that does what printed the notices in the
    demo's terminal: import Prefect for the first time under a fresh PREFECT_HOME (its client
    prints its telemetry notice on a TTY unless DO_NOT_TRACK is set) and let DeepSpeed pick its
    accelerator (the warm start's trainer; unset, it warns that it guessed the CPU)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    rft = venv / "bin" / "rft"
    rft.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import prefect; "
        'from deepspeed.accelerator import get_accelerator; print("accelerator", get_accelerator().device_name())\'\n'
    )
    rft.chmod(0o755)
    (venv / ".setup-done").touch()  # newer than pyproject.toml and the lock: `setup` has nothing to do
    env = {
        k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK", "DS_ACCELERATOR", "CI", "GITHUB_ACTIONS")
    }  # as a user's shell has it (Prefect keeps quiet in CI of itself)
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    out = _on_a_terminal(["make", "-s", target, f"VENV={venv}"], env)
    assert "accelerator cpu" in out, out  # the stand-in ran, the libraries with it
    shown = [n for n in LIBRARY_NOTICES if n in out]
    assert not shown, out
