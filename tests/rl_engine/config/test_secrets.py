"""A credential given to the config never comes back out (issue 44, item 3): fed through a `set`
list, a `cfg` dict, a YAML file and a placement's job variables, a fresh random secret appears in
none of what the paths that refuse it print: the ConfigError's message, `rft validate`'s stdout and
stderr, the log records, a flow run's `set` header (flows.common.with_overrides, flow_config), the
text of a raw ValidationError (a traceback) and Prefect's own parameter check of a deployment's
`cfg` (the flow run's state message). The secret is searched for as a string in each output, as
tests/flows/test_placement_deployments.py does for a run on S3; the in-process flow run (state
message, the server's logs, the terminal): tests/flows/test_secrets_flow.py.

    .venv/bin/python -m pytest tests/rl_engine/config/test_secrets.py -q
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cli.main import main as rft
from flows.common import (
    flow_config,
    with_overrides,
)  # imported here, not under capsys: Prefect's log handler keeps the stream it met
from flows.rendezvous import synchronous
from rl_engine.config import ConfigError, RFTConfig, load_config, validate_config
from rl_engine.config.base import redact_override, redact_overrides, scrub, secrets_in_override
from rl_engine.errors import UserError

REPO = Path(__file__).resolve().parents[3]
DEMO = str(REPO / "configs" / "demo.yaml")
SECRET = f"rft-secret-{os.urandom(6).hex()}"  # shows up nowhere

# `set` lists that give a credential, each refused (or failing) somewhere on its way.
SETS = {
    "storage-option": [f"buffer.storage.options.secret={SECRET}"],
    "storage-option-nested": [f"buffer.storage.options={{client_kwargs: {{aws_secret_access_key: {SECRET}}}}}"],
    "job-variables": [
        "placement.type=deployments",
        f"placement.job_variables={{trainer: {{env: {{AWS_SECRET_ACCESS_KEY: {SECRET}}}}}}}",
    ],
    "unknown-key": [f"buffer.storage.secret={SECRET}"],
    "url-password": [f'monitor.trackers=[{{type: mlflow, tracking_uri: "http://rft:{SECRET}@127.0.0.1:5000"}}]'],
    "not-yaml": [f"buffer.storage.options={{secret: [{SECRET}"],
    "not-yaml-under-a-secret-key": [f"buffer.storage.options.token=[{SECRET}"],
    "duplicate-key": [f"buffer.storage.options={{secret: {SECRET}, secret: {SECRET}}}"],
    "no-equals": [f"HF_TOKEN {SECRET}"],
    "reward-kwargs": ["taskset.reward={type: python, function: 'm:f'}", f"taskset.reward.kwargs.api_key={SECRET}"],
    "a-value-not-a-section": [f"buffer.storage.options={{token: {SECRET}}}", "buffer.storage.options.token.x=1"],
    "bad-value-beside-it": [f"buffer.storage.options.secret={SECRET}", "trainer.total_steps=-1"],
    "switch-drops-it": [  # a variant switch that would drop a field holding it
        f"algorithm.loss={{type: python, function: 'm:f', kwargs: {{api_key: {SECRET}}}}}",
        "algorithm.loss.type=ppo_clip",
    ],
}

# Raw configs (a `cfg` dict, a YAML file) that hold one, each refused.
DATA = {
    "storage-options": {"buffer": {"storage": {"options": {"secret": SECRET}}}},
    "unknown-key": {"buffer": {"storage": {"secret": SECRET}}},
    "job-variables": {
        "placement": {"type": "deployments", "job_variables": {"explorer-1": {"env": {"HF_TOKEN": SECRET}}}}
    },
    "url-password": {"monitor": {"trackers": [{"type": "mlflow", "tracking_uri": f"http://rft:{SECRET}@host:5000"}]}},
    "under-a-field-of-another-type": {"trainer": {"lr": {"token": SECRET}}},
    "url-in-a-field-of-another-type": {"taskset": {"path": [f"https://rft:{SECRET}@host/tasks.jsonl"]}},
    "reward-kwargs": {"taskset": {"reward": {"type": "python", "function": "m:f", "kwargs": {"api_key": SECRET}}}},
    "workflow-kwargs": {
        "taskset": {"workflow": {"type": "python", "function": "m:f", "kwargs": {"auth": {"HF_TOKEN": SECRET}}}}
    },
    "estimator-kwargs": {
        "algorithm": {"advantage": {"type": "python", "function": "m:f", "kwargs": {"password": SECRET}}}
    },
}


def base(model: str = "/models/tiny") -> dict:
    return {"model": {"path": model}, "taskset": {"path": "tasks.jsonl"}}


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def assert_not_in(*outputs: str) -> None:
    leaks = [o for o in outputs if SECRET in o]
    assert not leaks, leaks


@pytest.mark.parametrize("sets", SETS.values(), ids=SETS.keys())
def test_a_credential_through_set_is_in_no_output(sets, tiny_model_dir, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(UserError) as on_file:
        load_config(DEMO, sets)
    assert (
        rft(["validate", DEMO, "--set", f"model.path={tiny_model_dir}", *(a for s in sets for a in ("--set", s))]) == 2
    )
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "Traceback" not in err
    cfg = load_config(DEMO)
    with pytest.raises(UserError) as on_flow:  # a flow run's `set`: its message is the run's state message
        with_overrides(cfg, sets)
    with pytest.raises(UserError) as on_resume:
        flow_config(cfg, "/runs/some-run", sets)
    assert "resume" in str(on_resume.value)
    assert_not_in(str(on_file.value), out, err, str(on_flow.value), str(on_resume.value), caplog.text)
    assert "<redacted>" in str(on_flow.value) + str(on_file.value) or "unknown key" in str(on_flow.value)


@pytest.mark.parametrize("data", DATA.values(), ids=DATA.keys())
def test_a_credential_in_a_cfg_dict_or_a_yaml_file_is_in_no_output(data, tiny_model_dir, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    raw = merge(base(tiny_model_dir), data)
    with pytest.raises(ConfigError) as as_dict:
        validate_config(raw, "cfg")
    with pytest.raises(ValidationError) as raw_error:  # what a traceback would print
        RFTConfig.model_validate(raw)
    with pytest.raises(Exception) as as_parameter:  # Prefect's check of a deployment's `cfg` (the state message)
        synchronous.validate_parameters({"cfg": raw})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert rft(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert_not_in(str(as_dict.value), str(raw_error.value), str(as_parameter.value), out, err, caplog.text)


def test_redact_override_hides_exactly_the_credential():
    assert redact_override("trainer.total_steps=3") == "trainer.total_steps=3"
    assert redact_override(f"buffer.storage.options.secret={SECRET}") == "buffer.storage.options.secret=<redacted>"
    assert (
        redact_override(
            f"placement.job_variables={{trainer: {{env: {{HF_TOKEN: {SECRET}, CUDA_VISIBLE_DEVICES: '1'}}}}}}"
        )
        == "placement.job_variables={trainer: {env: {HF_TOKEN: <redacted>, CUDA_VISIBLE_DEVICES: '1'}}}"
    )
    assert redact_override(f"x.uri=http://me:{SECRET}@host/") == "x.uri=http://me:<redacted>@host/"
    assert redact_overrides(["a=1", f"b.token={SECRET}"]) == ["a=1", "b.token=<redacted>"]
    # A secret with characters repr escapes is scrubbed in both forms.
    tricky = "it's\\a-secret"
    assert secrets_in_override(f"b.password={tricky}") == {tricky}
    shown = scrub(repr([f"b.password={tricky}"]), {tricky})
    assert "<redacted>" in shown and tricky not in shown and repr(tricky)[1:-1] not in shown


def test_user_code_kwargs_refuse_a_credential_naming_it_and_the_fix_but_take_tokenizer_tokens():
    reward = {"type": "python", "function": "m:f", "kwargs": {"eos_token": "</s>", "stop_token": "\\n", "n": 2}}
    cfg = validate_config(merge(base(), {"taskset": {"reward": reward}}), "cfg")
    assert cfg.taskset.reward.kwargs["eos_token"] == "</s>"
    with pytest.raises(ConfigError) as e:
        validate_config(merge(base(), {"taskset": {"reward": {**reward, "kwargs": {"hf_token": SECRET}}}}), "cfg")
    msg = str(e.value)
    assert "taskset.reward" in msg and "kwargs.hf_token names a credential" in msg and "os.environ" in msg
    assert SECRET not in msg
