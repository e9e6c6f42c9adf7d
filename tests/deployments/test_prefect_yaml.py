"""prefect.yaml (repo root): every deployment points at a real flow, mode deployments carry a valid
config, and the pull steps find the checkout on the worker at run time (no path frozen at deploy time)."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl_engine.config import validate_config

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "prefect.yaml").read_text())
MODES = [d for d in SPEC["deployments"] if "cfg" in (d.get("parameters") or {})]
ROLES = {"rft-explorer": {"run_url", "explorer_id"}, "rft-trainer": {"run_url"}, "rft-reward": {"run_url"}}


def load_flow(entrypoint: str):
    module, func = entrypoint.split(":")
    return getattr(importlib.import_module(module), func)


@pytest.mark.parametrize("dep", SPEC["deployments"], ids=lambda d: f"{d['entrypoint']}/{d['name']}")
def test_entrypoint_is_an_installed_flow(dep):
    """Module-style entrypoints: the worker imports the project installed in its venv, from any directory."""
    assert ".py" not in dep["entrypoint"] and "/" not in dep["entrypoint"], "use package.module:flow entrypoints"
    flow = load_flow(dep["entrypoint"])
    assert hasattr(flow, "to_deployment"), f"{dep['entrypoint']} is not a Prefect flow"
    assert dep["work_pool"]["name"] == "rft-cpu"


def test_one_deployment_per_mode_and_role():
    names = {load_flow(d["entrypoint"]).name + "/" + d["name"] for d in SPEC["deployments"]}
    assert names == {
        "synchronous/synchronous",
        "one-step-off-policy/one-step-off-policy-nightly",
        "fully-async/fully-async",
        "multi-explorer/multi-explorer",
        "rft-explorer/default",
        "rft-trainer/default",
        "rft-reward/default",
        "rft-eval/default",
    }


@pytest.mark.parametrize("dep", MODES, ids=lambda d: d["name"])
def test_mode_deployment_parameters(dep, tiny_model_dir):
    flow = load_flow(dep["entrypoint"])
    cfg = dict(dep["parameters"]["cfg"])
    cfg["model"] = dict(cfg["model"], path=tiny_model_dir)
    parsed = validate_config(cfg, dep["name"])
    assert flow.name.replace("-", "_") == parsed.synchronizer.mode
    # What the server checks at `prefect deploy` (enforce_parameter_schema): the parameters against the
    # flow's JSON schema. A union's `oneOf` that two variants matched ({type: arithmetic} under the
    # registered reward's `type: string` too) failed every mode deployment with a 422.
    server_accepts(flow, dep["parameters"])


def server_accepts(flow, parameters: dict) -> None:
    """Prefect's server-side check of a deployment's (or a flow run's) parameters against the flow's
    schema (prefect's validate_values_conform_to_schema: jsonschema.validate, the schema checked once)."""
    flow_validator(flow).validate(parameters)


@functools.cache
def flow_validator(flow):
    """A validator of the flow's parameter schema as `prefect deploy` sends it."""
    import jsonschema
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(flow).model_dump(exclude_unset=True)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_role_flows_take_handles_only():
    for dep in SPEC["deployments"]:
        flow = load_flow(dep["entrypoint"])
        if flow.name in ROLES:
            params = set(inspect.signature(flow.fn).parameters)
            assert ROLES[flow.name] <= params, (flow.name, params)
            assert "cfg" not in params and not dep.get("parameters")


def test_nightly_schedule_inactive():
    nightly = next(d for d in SPEC["deployments"] if d["name"] == "one-step-off-policy-nightly")
    assert [s["active"] for s in nightly["schedules"]] == [False]
    # scheduled retraining that continues: one lineage, one run at a time
    assert nightly["parameters"]["cfg"]["lineage"] == {"name": "nightly"} and nightly["concurrency_limit"] == 1


def test_pull_steps_find_the_checkout_at_run_time(tmp_path):
    """Run the pull steps as a worker's flow process would, from an unrelated directory, with no
    venv on PATH: they end in this checkout. Nothing in them is an absolute path or an env placeholder
    (those are filled in at deploy time, from the deploying machine)."""
    text = json.dumps(SPEC["pull"])
    assert str(REPO) not in text and "{{ $" not in text and "{{$" not in text
    code = (
        "import asyncio, os, sys, yaml\n"
        "from prefect.deployments.steps.core import run_steps\n"
        f"steps = yaml.safe_load(open({str(REPO / 'prefect.yaml')!r}))['pull']\n"
        "asyncio.run(run_steps(steps, print_function=lambda *a, **k: None))\n"
        "print(os.getcwd())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "VIRTUAL_ENV"))}
    env.update(PATH="/usr/bin:/bin", PREFECT_HOME=str(tmp_path / "home"), PREFECT_API_URL="http://127.0.0.1:9/api")
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert Path(res.stdout.strip().splitlines()[-1]).resolve() == REPO


@pytest.mark.parametrize("dep", MODES, ids=lambda d: d["name"])
def test_mode_deployments_show_their_placement(dep):
    """The UI's run form edits the placement union as raw JSON: with no value in the deployment's
    cfg it shows an empty editor, with one it shows {"type": "local"} to change."""
    assert dep["parameters"]["cfg"]["placement"] == {"type": "local"}
