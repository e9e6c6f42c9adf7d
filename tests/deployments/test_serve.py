"""deployments/serve.py: the config's mode flow with its `cfg`, plus the role flows."""

from __future__ import annotations

import pytest

from deployments.serve import build_deployments
from harness.prefect_live import REPO
from rl_engine.config import load_config


@pytest.mark.parametrize("mode", ["synchronous", "one_step_off_policy", "fully_async", "multi_explorer"])
def test_build_deployments(mode, tiny_model_dir):
    cfg = load_config(REPO / "configs" / f"{mode}.yaml", [f"model.path={tiny_model_dir}"])
    deps = build_deployments(cfg, "default", cron="0 3 * * *")
    assert [d.flow_name for d in deps] == [mode.replace("_", "-"), "rft-explorer", "rft-trainer", "rft-reward"]
    assert {d.name for d in deps} == {"default"}
    assert deps[0].parameters["cfg"]["synchronizer"]["mode"] == mode
    assert deps[0].schedules and not any(d.schedules for d in deps[1:])
    assert all(d.parameters == {} for d in deps[1:])
