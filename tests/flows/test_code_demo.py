"""configs/code.yaml (the `code` demo: reward code_tests, each sample's code run against its
task's tests in the sandbox) as a real flow run on the tiny model: 2 synchronous steps on
`rft make-tasks --task python-functions` tasks, held-out pass@1 at the start and the end. The
tiny model writes no working Python (its rewards are 0); what is checked is the machinery: every
sample ran in the sandbox and was counted in the step's metrics, and the evaluation scored the
held-out set with the same reward, which bench.rewards --code-run reports.

    .venv/bin/python -m pytest tests/flows/test_code_demo.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.rewards import code_demo
from cli.run import run_config
from rl_engine.config import load_config
from rl_engine.rewards.make_tasks import main as make_tasks
from rl_engine.rewards.sandbox import namespaces_available
from rl_engine.run.context import open_run
from rl_engine.run.report import load_evaluations, load_metrics
from rl_engine.trainer.dist import free_port

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "code.yaml"


@pytest.mark.skipif(not namespaces_available()[0], reason="the code_tests reward refuses to start without namespaces")
def test_code_config_runs_with_the_sandboxed_reward(prefect_server, tiny_model_dir, tmp_path):
    train, heldout = tmp_path / "code-train.jsonl", tmp_path / "code-heldout.jsonl"
    assert make_tasks([str(train), "--task", "python-functions", "--n", "40"]) == 0
    assert make_tasks([str(heldout), "--task", "python-functions", "--split", "heldout", "--n", "4"]) == 0
    cfg = load_config(
        str(CONFIG),
        [
            f"model.path={tiny_model_dir}",
            "model.max_model_len=256",  # byte-level tokens: the longest prompt is ~190
            f"taskset.path={train}",
            f"eval.tasksets.0.path={heldout}",
            f"buffer.storage.url={tmp_path / 'runs'}",
            "explorer.batch_size=2",
            "algorithm.repeat_times=2",
            "explorer.engine.kv_cache_space_gib=0.25",
            "explorer.sampling.max_tokens=16",
            "trainer.total_steps=2",
            "trainer.micro_batch_size=4",
            f"synchronizer.collective.port={free_port()}",
        ],
    )
    summary = run_config(cfg)
    assert summary["final_version"] == 2
    run = open_run(summary["run"])
    _, explorer = load_metrics(run)
    assert [m["sandbox_runs"] for m in explorer] == [4, 4]  # 2 tasks x 2 samples, each one sandbox run
    for m in explorer:
        assert m["experiences"] == 4 and m["reward_errors"] == 0
        assert m["sandbox_timeouts"] == m["sandbox_killed"] == m["sandbox_output_limit"] == 0
        assert m["sandbox_errors"] <= 4  # the tiny model's bytes are no Python
    evals = load_evaluations(run)
    assert [r["version"] for r in evals] == [0, 2]
    assert all(r["heldout/tasks"] == 4 and 0.0 <= r["heldout/pass@1"] <= 1.0 for r in evals)
    # `python -m bench.rewards --code-run RUN` reports this run's held-out pass@1, first and last
    assert code_demo(summary["run"]) == {
        "code_pass1_before": round(evals[0]["heldout/pass@1"], 4),
        "code_pass1_after": round(evals[1]["heldout/pass@1"], 4),
        "code_steps": 2,
        "code_heldout_tasks": 4,
        "code_run_s": None,
    }
