"""`reward: {type: model}` in a real run: multi_explorer mode, two explorers of one process
scoring with one reward service (a tiny random sequence classifier), 2 trainer steps. Checked:
the run completes, each explorer step carries the service's `reward/model/...` metrics with every
sample scored, each step's scoring is a `reward` span of its explorer's timeline, the two
explorers started one service between them, and none is left running.

    .venv/bin/python -m pytest tests/flows/test_reward_model_run.py
"""

from __future__ import annotations

import psutil
import pytest

from cli.run import run_config
from harness.runs import MODES, small_config
from rl_engine.config import RFTConfig
from rl_engine.rewards.services import SERVICES
from rl_engine.run.context import open_run
from rl_engine.run.report import load_metrics
from rl_engine.run.timeline import load_spans
from rl_engine.tiny_model import make_tiny_classifier

pytestmark = pytest.mark.slow


def test_two_explorers_share_one_reward_service(prefect_server, tiny_model_dir, task_file, tmp_path):
    rm = make_tiny_classifier(tmp_path / "rm")
    data = small_config(tiny_model_dir, task_file, str(tmp_path / "runs"), total_steps=2, **MODES["multi_explorer"])
    data["taskset"]["reward"] = {"type": "model", "path": str(rm), "batch_size": 4, "normalize": "running"}
    started = SERVICES.started
    summary = run_config(RFTConfig.model_validate(data))
    assert summary["final_version"] == 2
    _, explorer = load_metrics(open_run(summary["run"]))
    assert {m["explorer_id"] for m in explorer} == {0, 1}
    for m in explorer:
        assert m["experiences"] == 4 and m["reward_errors"] == 0  # 2 tasks x 2 samples, all scored
        assert m["reward/model/failures"] == m["reward/model/timeouts"] == 0
        assert 1 <= m["reward/model/batch_size"] <= 4 and m["reward/model/samples_per_s"] > 0
    assert SERVICES.started == started + 1  # one service for both explorers
    spans = [s for s in load_spans(summary["run"]) if s.kind == "reward"]  # each step's scoring, in its rollout
    assert sorted((s.component, s.step) for s in spans) == sorted(
        (f"explorer-{m['explorer_id']}", m["explorer_step"]) for m in explorer
    )
    left = [p for p in psutil.Process().children(recursive=True) if "reward_model_server" in " ".join(p.cmdline())]
    assert left == []  # the last explorer to close stopped it
