"""deployments/prefect.yaml: every deployment points at a real flow and carries a valid config."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from rl_engine.config import validate_config

SPEC = yaml.safe_load((Path(__file__).parents[2] / "deployments" / "prefect.yaml").read_text())


@pytest.mark.parametrize("dep", SPEC["deployments"], ids=lambda d: d["name"])
def test_deployment_entrypoint_and_parameters(dep, tiny_model_dir):
    path, func = dep["entrypoint"].split(":")
    flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), func)
    assert hasattr(flow, "to_deployment"), f"{dep['entrypoint']} is not a Prefect flow"
    cfg = dict(dep["parameters"]["cfg"])
    cfg["model"] = dict(cfg["model"], path=tiny_model_dir)
    parsed = validate_config(cfg, dep["name"])
    assert flow.name.replace("-", "_") == parsed.synchronizer.mode
