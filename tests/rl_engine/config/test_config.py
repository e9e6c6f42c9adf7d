"""Config loading, validation messages, overrides, resolve, and every shipped config under configs/."""

from __future__ import annotations

import contextlib
import glob
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.main import main as rft
from rl_engine.config import (
    CollectiveConfig,
    ConfigError,
    DecoupledSync,
    DeploymentsPlacement,
    PythonReward,
    RendezvousSync,
    RFTConfig,
    load_config,
    migrate,
    read_yaml,
    to_yaml,
    validate_config,
)

REPO = Path(__file__).resolve().parents[3]

CONFIGS = sorted(glob.glob(str(Path(__file__).parents[3] / "configs" / "*.yaml")))


def base(model_dir: str) -> dict:
    return {"model": {"path": model_dir}, "taskset": {"path": "tasks.jsonl"}}


def write(tmp_path: Path, data: dict, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_shipped_configs_exist_one_per_mode():
    modes = {yaml.safe_load(Path(p).read_text())["synchronizer"]["mode"] for p in CONFIGS}
    assert modes == {"synchronous", "one_step_off_policy", "fully_async", "multi_explorer"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: Path(p).name)
def test_every_shipped_config_validates(path, tiny_model_dir, capsys):
    # The shipped configs point at the demo model built by `make demo`; any model dir will do here.
    assert rft(["validate", path, "--set", f"model.path={tiny_model_dir}"]) == 0
    assert capsys.readouterr().out.startswith(f"OK {path}")


def test_validate_print_writes_the_resolved_config(tiny_model_dir, capsys):
    """`rft validate configs/synchronous.yaml --print` (README): the resolved run as YAML, which validates as it is."""
    assert (
        rft(
            ["validate", str(REPO / "configs" / "synchronous.yaml"), "--set", f"model.path={tiny_model_dir}", "--print"]
        )
        == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    cfg = validate_config(printed)
    assert (
        cfg.name.startswith("synchronous-")
        and cfg.trainer.train_batch_size == cfg.explorer.batch_size * cfg.algorithm.repeat_times
    )


def test_make_targets_the_readme_shows_run_the_commands_it_says():
    """`make test-fast` and `make test PYTEST_ARGS=...` (docs/guides/development.md), dry-run: the suite
    itself is what `make test` runs in CI."""
    import subprocess

    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    assert '-m pytest -m "not slow"' in dry("test-fast")
    assert "RFT_SOAK=1" in dry("test-soak") and "-m pytest -m soak" in dry("test-soak")
    assert "RFT_RELEASE=1" in dry("test-release") and "-m pytest -m release -n 2" in dry("test-release")
    assert "-m pytest -n 2 --dist loadfile -k buffer" in dry("test", "PYTEST_ARGS=-k buffer")
    assert "-m pytest -n 0 --dist loadfile" in dry("test", "PYTEST_WORKERS=0")
    assert "rft demo" in dry("demo")
    assert "rft demo --model smollm2" in dry("demo-real")
    assert "-m bench.modes --quick --synthetic" in dry("bench")
    assert "ruff check ." in dry("lint") and "ruff format --check ." in dry("lint")
    assert "ruff check --fix ." in dry("format") and "ruff format ." in dry("format")
    assert "make lint" in (REPO / ".ci" / "run").read_text()  # CI lints before it tests


def test_minimal_config_gets_defaults_and_resolves(tiny_model_dir):
    cfg = validate_config(base(tiny_model_dir))
    assert cfg.synchronizer.mode == "synchronous"
    assert (cfg.synchronizer.sync_interval, cfg.synchronizer.sync_offset) == (1, 0)
    assert cfg.name is None and cfg.trainer.train_batch_size is None
    r = cfg.resolved()
    assert r.trainer.train_batch_size == cfg.explorer.batch_size * cfg.algorithm.repeat_times
    assert r.name.startswith("synchronous-") and r.run_url == f"runs/{r.name}"
    assert cfg.resolved().name != r.name  # two runs started in the same second never share a directory
    assert r.model.tokenizer_path == tiny_model_dir
    # Resolve works on a copy: validators never rewrite, the input stays as given.
    assert cfg.name is None
    # The resolved YAML loads back to the same model.
    assert RFTConfig.model_validate(yaml.safe_load(to_yaml(r))) == r


def test_overrides_apply_with_yaml_types(tmp_path, tiny_model_dir):
    p = write(tmp_path, base(tiny_model_dir))
    cfg = load_config(
        p,
        [
            "synchronizer.mode=one_step_off_policy",
            "synchronizer.sync_offset=2",
            "synchronizer.sync_interval=4",
            'explorer.sampling.stop=["\\n"]',
            "algorithm.kl={coef: 0.05, estimator: k1}",
        ],
    )
    assert (cfg.synchronizer.sync_interval, cfg.synchronizer.sync_offset) == (4, 2)
    assert cfg.explorer.sampling.stop == ["\n"]
    assert cfg.algorithm.kl.estimator == "k1" and cfg.algorithm.kl.coef == 0.05


def test_no_field_without_description():
    seen = set()

    def walk(model, prefix=""):
        seen.add(model)
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            ann = field.annotation
            # A union's members may be Annotated (the synchronizer's carry a Tag): walk the model inside.
            for sub in [
                typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
                for a in getattr(ann, "__args__", ()) + (ann,)
            ]:
                if isinstance(sub, type) and issubclass(sub, RFTConfig.__mro__[1]) and sub is not model:
                    walk(sub, f"{prefix}{name}.")

    walk(RFTConfig)
    assert {
        RendezvousSync,
        DecoupledSync,
        CollectiveConfig,
        PythonReward,
        DeploymentsPlacement,
    } <= seen  # the unions' members were walked too


def bare_placeholders(text: str) -> list[str]:
    """`<word>` outside backticks: the Prefect UI renders descriptions as markdown, where it is an HTML tag and vanishes."""
    return re.findall(r"<[A-Za-z/!][^>]*>", re.sub(r"`[^`]*`", "", text))


def descriptions(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(where, text) of every `description` in a JSON schema."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "description" and isinstance(v, str):
                yield path, v
            else:
                yield from descriptions(v, f"{path}.{k}")
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            yield from descriptions(v, f"{path}[{i}]")


def test_no_description_has_a_bare_placeholder():
    found = list(descriptions(RFTConfig.model_json_schema()))
    assert any("lineages/<name>/" in text for _, text in found)  # the one the UI lost: kept in backticks
    bad = {where: text for where, text in found if bare_placeholders(text)}
    assert not bad, f"write placeholders in backticks (`<name>`), the UI's markdown drops a bare <name>: {bad}"
    assert bare_placeholders("under <storage>/x, `<kept>`") == ["<storage>"]


# (overrides on a valid base, substrings the message must contain)
BAD = [
    (
        {"synchronizer": {"mode": "fully_async", "max_backlog_steps": 1}, "trainer": {"train_batch_size": 64}},
        ["synchronizer.max_backlog_steps = 1", "fewer than one trainer batch", "at least"],
    ),
    ({"placement": {"type": "kubernetes"}}, ["placement", "'kubernetes'", "local", "deployments"]),
    (
        {"placement": {"type": "deployments", "job_variables": {"explorer0": {}}}},
        ["placement.deployments.job_variables", "explorer0", "explorer-<i>", "`reward`"],
    ),
    (
        {"taskset": {"reward": {"type": "model", "path": "runs/models/rm", "host": "0.0.0.0"}}},
        ["taskset.reward", "host '0.0.0.0'", "no address to connect to"],
    ),
    (
        {"placement": {"type": "local", "heartbeat_timeout_s": 0}},
        ["placement.local.heartbeat_timeout_s", "greater than 0"],
    ),
    ({"synchronizer": {"sync_offset": -1}}, ["synchronizer.sync_offset", "-1", "greater than or equal to 0"]),
    ({"synchronizer": {"sync_interval": 0}}, ["synchronizer.sync_interval", "0", "greater than or equal to 1"]),
    ({"synchronizer": {"mode": "multi_explorer"}}, ["explorer.count = 1", "multi_explorer", "explorer.count >= 2"]),
    ({"synchronizer": {"mode": "bogus"}}, ["synchronizer.mode", "'bogus'", "synchronous"]),
    (
        {"synchronizer": {"mode": "bogus"}},
        ["synchronizer.mode = 'bogus': unknown mode", "one_step_off_policy", "fully_async", "multi_explorer"],
    ),
    (
        {"synchronizer": "fully_async"},
        ["synchronizer = 'fully_async'", "must be a section with a mode", "multi_explorer"],
    ),
    ({"synchronizer": {"sync_ofset": 1}}, ["synchronizer.sync_ofset", "unknown key"]),
    ({"trainer": {"lr": "fast"}}, ["trainer.lr", "'fast'", "valid number"]),
    ({"synchronizer": {"sync_offset": 2}}, ["synchronizer.sync_offset = 2", "one_step_off_policy"]),
    (  # one_step_off_policy without a sync_offset runs 1 ahead; 0 is synchronous's
        {"synchronizer": {"mode": "one_step_off_policy", "sync_offset": 0}},
        ["sync_offset = 0", "sync_offset >= 1"],
    ),
    ({"synchronizer": {"mode": "fully_async", "sync_offset": 1}}, ["synchronizer.sync_offset = 1", "rendezvous"]),
    # A field of the other variant: not allowed in that mode, and what to do instead.
    (
        {"synchronizer": {"mode": "fully_async", "sync_offset": 2}},
        ["synchronizer.sync_offset = 2", "mode 'fully_async' has no sync_offset", "remove it or use a rendezvous mode"],
    ),
    (
        {"synchronizer": {"mode": "multi_explorer", "sync_offset": 1}, "explorer": {"count": 2}},
        ["synchronizer.sync_offset = 1", "mode 'multi_explorer' has no sync_offset"],
    ),
    (
        {"synchronizer": {"mode": "one_step_off_policy", "sync_offset": 1, "max_staleness": 3}},
        ["synchronizer.max_staleness = 3", "mode 'one_step_off_policy' has no max_staleness", "use an async mode"],
    ),
    (
        {"synchronizer": {"max_backlog_steps": 4}},
        [
            "synchronizer.max_backlog_steps = 4",
            "mode 'synchronous' has no max_backlog_steps",
            "remove it or use an async mode",
        ],
    ),
    (
        {
            "synchronizer": {"mode": "fully_async"},
            "buffer": {"max_backlog_steps": 2},
            "trainer": {"train_batch_size": 64},
        },
        ["synchronizer.max_backlog_steps = 2", "fewer than one trainer batch"],
    ),  # the old key, migrated
    (
        {"synchronizer": {"mode": "fully_async", "max_backlog_steps": 4}, "buffer": {"max_backlog_steps": 2}},
        ["buffer.max_backlog_steps = 2 and synchronizer.max_backlog_steps = 4", "delete buffer.max_backlog_steps"],
    ),
    ({"synchronizer": {"max_staleness": 2}}, ["synchronizer.max_staleness = 2", "async mode"]),
    ({"explorer": {"count": 2}}, ["explorer.count = 2", "multi_explorer"]),
    (
        {"synchronizer": {"mode": "fully_async", "sync_interval": 4, "max_staleness": 1}},
        ["synchronizer.max_staleness = 1", "max_staleness >= 3"],
    ),
    (
        {"trainer": {"train_batch_size": 10}},
        ["trainer.train_batch_size = 10", "explorer.batch_size x algorithm.repeat_times"],
    ),
    ({"algorithm": {"repeat_times": 1}}, ["algorithm.repeat_times = 1", ">= 2"]),
    (
        {"taskset": {"reward": {"type": "python", "function": "not a path"}}},
        ["taskset.reward.function", "'not a path'"],
    ),
    ({"taskset": {"reward": {"type": "nope"}}}, ["taskset.reward", "arithmetic", "python"]),
    (
        {"buffer": {"storage": {"options": {"key": "AKIA..."}}}},
        ["buffer.storage.options", "credentials", "AWS_ACCESS_KEY_ID"],
    ),
    (
        {
            "placement": {
                "type": "deployments",
                "job_variables": {"trainer": {"env": {"AWS_SECRET_ACCESS_KEY": "wJalr..."}}},
            }
        },
        [
            "job_variables.trainer.env.AWS_SECRET_ACCESS_KEY",
            "credentials must not be in the config",
            "environment of every worker",
        ],
    ),
    (
        {"explorer": {"partial": {"enabled": True, "segment_max_tokens": 64, "max_response_tokens": 32}}},
        ["segment_max_tokens = 64", "max_response_tokens = 32"],
    ),
    (
        {"explorer": {"batch_size": 4, "partial": {"enabled": True, "max_groups_in_flight": 3}}},
        ["max_groups_in_flight = 3", "explorer.batch_size = 4"],
    ),
    (
        {"explorer": {"partial": {"enabled": True, "max_response_tokens": 600}}},
        ["explorer.partial.max_response_tokens = 600", "model.max_model_len"],
    ),
    ({"explorer": {"sampling": {"max_tokens": 600}}}, ["explorer.sampling.max_tokens = 600", "model.max_model_len"]),
    ({"model": {"dtype": "int4"}}, ["model.dtype", "'int4'", "float32"]),
    (
        {"explorer": {"engine": {"num_threads": "most"}}},
        ["explorer.engine.num_threads", "'most' is no thread count", "`all`"],
    ),
    (
        {"explorer": {"engine": {"num_threads": 0}}},
        ["explorer.engine.num_threads", "0 is no thread count", "a number >= 1"],
    ),
    ({"trainer": {"num_ranks": 3, "nodes": 2, "rendezvous": "h:1"}}, ["trainer.num_ranks = 3", "trainer.nodes = 2"]),
    ({"trainer": {"num_ranks": 2, "nodes": 2}}, ["trainer.nodes = 2", "trainer.rendezvous = 'host:port'"]),
    ({"trainer": {"rendezvous": "node0"}}, ["trainer.rendezvous", "'node0'"]),
    ({"trainer": {"num_ranks": 3}}, ["trainer.micro_batch_size", "trainer.num_ranks = 3"]),
]


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("bad,expected", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_names_file_field_value_and_rule(bad, expected, tmp_path, tiny_model_dir, capsys):
    p = write(tmp_path, merge(base(tiny_model_dir), bad), "bad.yaml")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    for s in expected:
        assert s in msg, f"{s!r} not in:\n{msg}"
    # Through the CLI: one clear message on stderr, exit code 2, no traceback.
    assert rft(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and expected[0] in err


@pytest.mark.parametrize(
    "bad",
    [
        {"buffer": {"storage": {"options": {"secret": "s3cr3t-VALUE"}}}},
        {"buffer": {"storage": {"secret": "s3cr3t-VALUE"}}},  # an unknown key is named, its value not shown
        {
            "placement": {
                "type": "deployments",
                "job_variables": {"explorer-1": {"env": {"HF_TOKEN": "s3cr3t-VALUE", "CUDA_VISIBLE_DEVICES": "1"}}},
            }
        },
    ],
    ids=["storage-options", "unknown-key", "job-variables"],
)
def test_a_refused_credential_is_never_echoed(bad, tmp_path, tiny_model_dir, capsys):
    p = write(tmp_path, merge(base(tiny_model_dir), bad), "bad.yaml")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "s3cr3t-VALUE" not in str(ei.value) and "<redacted>" in str(ei.value)
    assert rft(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert "s3cr3t-VALUE" not in err
    assert "credentials" in err or "unknown key" in err


def test_job_variables_without_credentials_pass():
    from rl_engine.config.placement import DeploymentsPlacement

    jv = {
        "explorer-1": {
            "env": {
                "CUDA_VISIBLE_DEVICES": "1",
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        }
    }
    assert DeploymentsPlacement(type="deployments", job_variables=jv).job_variables == jv


def test_the_reward_role_has_a_deployment_and_job_variables():
    p = DeploymentsPlacement(type="deployments", job_variables={"reward": {"env": {"CUDA_VISIBLE_DEVICES": "3"}}})
    assert p.reward_deployment == "rft-reward/default"
    assert p.job_variables["reward"] == {"env": {"CUDA_VISIBLE_DEVICES": "3"}}
    with pytest.raises(
        ValueError, match="job_variables key 'rewards': use `trainer`, `explorer`, `explorer-<i>` or `reward`"
    ):
        DeploymentsPlacement(type="deployments", job_variables={"rewards": {}})


def test_missing_required_sections_are_named(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, {"trainer": {"lr": 1e-4}}))
    assert "model: required field missing" in str(ei.value) and "taskset: required field missing" in str(ei.value)


@pytest.mark.parametrize(
    "text,expected",
    [("not: [valid", "not valid YAML"), ("- a\n- b\n", "top level must be a mapping")],
)
def test_unparseable_files(tmp_path, text, expected):
    p = tmp_path / "x.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(p)


def test_bad_override_syntax_and_missing_file(tmp_path, tiny_model_dir):
    p = write(tmp_path, base(tiny_model_dir))
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(p, ["synchronizer.sync_offset"])
    with pytest.raises(ConfigError, match="'mode' is a value"):
        load_config(p, ["synchronizer.mode=synchronous", "synchronizer.mode.x=1"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as ei:
        rft(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for cmd in (
        "validate",
        "run",
        "make-tiny-model",
        "warmstart",
        "make-tasks",
        "buffer",
        "timeline",
        "demo",
        "trainer-node",
    ):
        assert cmd in out


def test_cli_schema_is_json(capsys):
    import json

    assert rft(["validate", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "synchronizer" in schema["properties"]


def test_yaml_not_utf8_and_duplicate_keys_name_file_and_line(tmp_path, tiny_model_dir):
    p = tmp_path / "x.yaml"
    p.write_bytes(yaml.safe_dump(base(tiny_model_dir)).encode() + b"name: caf\xe9\n")
    with pytest.raises(
        ConfigError, match=r"x\.yaml: not UTF-8 text \(byte 0xe9 at line 5, column 10\); save the file as UTF-8"
    ):
        load_config(p)
    p.write_text(yaml.safe_dump(base(tiny_model_dir)) + "trainer:\n  lr: 0.1\n  warmup_steps: 1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"x\.yaml: line 8: key 'lr' given twice in one section \(first at line 6\)"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"--set .*: line 1: key 'lr' given twice"):
        load_config(write(tmp_path, base(tiny_model_dir)), ["trainer={lr: 0.1, lr: 0.2}"])
    # A YAML merge key is not a duplicate: keys beside it override what it merges, as YAML means.
    p.write_text(
        yaml.safe_dump(base(tiny_model_dir)) + "x: &t {lr: 0.1, warmup_steps: 2}\ntrainer:\n  <<: *t\n  lr: 0.2\n"
    )
    with pytest.raises(ConfigError, match=r"\(1 problem\)\n  x = .*unknown key"):  # only the anchor's holder is unknown
        load_config(p)


@pytest.mark.parametrize(
    "mode,k,m,total,warns",
    [
        ("synchronous", 50, 0, 2, True),  # the case
        ("synchronous", 1, 0, 2, False),  # sync after explorer step 1
        ("synchronous", 2, 0, 3, False),
        ("synchronous", 2, 0, 2, True),  # the only sync point is after the last step: no rollout follows
        ("one_step_off_policy", 1, 1, 2, True),
        ("one_step_off_policy", 1, 1, 3, False),
        ("fully_async", 2, 0, 2, True),
        ("fully_async", 1, 0, 2, False),
    ],
)
def test_validate_warns_when_no_weight_sync_happens(mode, k, m, total, warns, tmp_path, tiny_model_dir, capsys):
    from rl_engine.schedule import rendezvous_syncs

    p = write(
        tmp_path,
        merge(
            base(tiny_model_dir),
            {"synchronizer": {"mode": mode, "sync_interval": k, "sync_offset": m}, "trainer": {"total_steps": total}},
        ),
    )
    assert rft(["validate", str(p)]) == 0
    err = capsys.readouterr().err
    assert ("no weight sync happens" in err or "publishes no weights before its last step" in err) == warns, err
    if mode == "synchronous":
        assert warns == (not rendezvous_syncs(total, k, m))  # the schedule's own plan
    if warns:
        assert (
            err.startswith(f"warning: synchronizer.sync_interval = {k}")
            and f"trainer.total_steps = {total}" in err
            and "version 0" in err
        )


def test_run_prints_the_warnings_before_it_starts(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import cli.run

    started = []
    monkeypatch.setattr(cli.run, "check_prefect_api", lambda: None)  # whatever Prefect profile this machine has
    monkeypatch.setattr(cli.run, "prefect_server_ahead", contextlib.nullcontext)  # no flow runs here: no server
    monkeypatch.setattr(cli.run, "run_watched", lambda cfg, resume=None: started.append(cfg) or "stopped")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "1+1=", "answer": "2"}\n')
    p = write(
        tmp_path,
        merge(
            base(tiny_model_dir),
            {
                "taskset": {"path": str(tasks)},
                "buffer": {"storage": {"url": str(tmp_path / "runs")}},
                "trainer": {"total_steps": 2},
            },
        ),
    )
    assert cli.run.run_from_cli(str(p), ["synchronizer.sync_interval=50"]) == 1 and len(started) == 1
    assert (
        "warning: synchronizer.sync_interval = 50 (sync_offset 0) with trainer.total_steps = 2: no weight sync happens"
        in capsys.readouterr().err
    )


def test_validate_prints_what_one_step_generates(tmp_path, tiny_model_dir, capsys):
    p = write(tmp_path, base(tiny_model_dir))
    assert (
        rft(
            [
                "validate",
                str(p),
                "--set",
                "explorer.batch_size=4096",
                "--set",
                "algorithm.repeat_times=64",
                "--set",
                "trainer.micro_batch_size=64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "volume: up to 262,144 generations (4,096 tasks x algorithm.repeat_times 64) of up to 64 tokens (explorer.sampling.max_tokens) per explorer step, 16,777,216 generated tokens at most"
        in out
    )
    assert "262,144 experiences per trainer step, 2,621,440 over the run's 10 steps" in out
    partial = [
        "--set",
        "explorer.partial={enabled: true, segment_max_tokens: 16, max_response_tokens: 128, max_groups_in_flight: 8}",
    ]
    assert rft(["validate", str(p), *partial]) == 0
    assert (
        "up to 32 generations (8 tasks x algorithm.repeat_times 4) of up to 16 tokens (explorer.partial.segment_max_tokens)"
        in capsys.readouterr().out
    )


# --------------------------------------------------------------------------- the synchronizer union and migration


def test_mode_picks_the_synchronizer_variant_and_its_fields(tiny_model_dir):
    rendezvous = validate_config(
        merge(
            base(tiny_model_dir),
            {"synchronizer": {"mode": "one_step_off_policy", "sync_interval": 2, "sync_offset": 1}},
        )
    ).synchronizer
    assert isinstance(rendezvous, RendezvousSync) and (rendezvous.sync_interval, rendezvous.sync_offset) == (2, 1)
    assert not hasattr(rendezvous, "max_staleness") and not hasattr(rendezvous, "max_backlog_steps")
    decoupled = validate_config(
        merge(base(tiny_model_dir), {"synchronizer": {"mode": "fully_async", "max_staleness": 2}})
    ).synchronizer
    assert isinstance(decoupled, DecoupledSync) and (decoupled.max_staleness, decoupled.max_backlog_steps) == (2, 8)
    assert not hasattr(decoupled, "sync_offset")
    # No mode given: synchronous, as before the union.
    assert validate_config(
        merge(base(tiny_model_dir), {"synchronizer": {"sync_interval": 3}})
    ).synchronizer == RendezvousSync(mode="synchronous", sync_interval=3)


OLD_ASYNC = {  # fully_async as an older version wrote it: the backlog cap under buffer, the rendezvous fields at their neutral values
    "buffer": {"max_backlog_steps": 3},
    "synchronizer": {
        "mode": "fully_async",
        "sync_interval": 2,
        "sync_offset": 0,
        "max_staleness": None,
        "sync_method": "checkpoint",
    },
}
NEW_ASYNC = {
    "synchronizer": {"mode": "fully_async", "sync_interval": 2, "max_backlog_steps": 3, "sync_method": "checkpoint"}
}
OLD_RENDEZVOUS = {
    "buffer": {"max_backlog_steps": 8},
    "synchronizer": {"mode": "one_step_off_policy", "sync_interval": 1, "sync_offset": 1, "max_staleness": None},
}
NEW_RENDEZVOUS = {"synchronizer": {"mode": "one_step_off_policy", "sync_interval": 1, "sync_offset": 1}}


@pytest.mark.parametrize(
    "old,new", [(OLD_ASYNC, NEW_ASYNC), (OLD_RENDEZVOUS, NEW_RENDEZVOUS)], ids=["fully_async", "one_step_off_policy"]
)
def test_a_config_in_the_old_shape_loads_to_the_same_values(old, new, tmp_path, tiny_model_dir, capsys):
    old_file, new_file = (
        write(tmp_path, merge(base(tiny_model_dir), old), "old.yaml"),
        write(tmp_path, merge(base(tiny_model_dir), new), "new.yaml"),
    )
    assert load_config(old_file) == load_config(new_file)
    assert load_config(old_file).synchronizer.sync_interval == new["synchronizer"]["sync_interval"]
    assert migrate(read_yaml(old_file))[1], "the old shape itself is not today's: migration made the difference"
    # Prefect validates a deployment's stored `cfg` parameter with the model itself: a deployment
    # registered before the change keeps running.
    assert RFTConfig.model_validate(read_yaml(old_file)) == RFTConfig.model_validate(read_yaml(new_file))
    assert migrate(read_yaml(new_file)) == (read_yaml(new_file), [])  # today's shape is left as it is
    # `rft validate` loads it and says how to rewrite it.
    assert rft(["validate", str(old_file)]) == 0
    assert f"warning: {old_file} is in an older shape" in capsys.readouterr().err


def test_migrate_notes_each_change_and_leaves_its_input_alone():
    data = {"model": {"path": "m"}, **OLD_ASYNC}
    given = yaml.safe_load(yaml.safe_dump(data))
    new, notes = migrate(data)
    assert data == given
    assert (
        new["synchronizer"]
        == {
            "mode": "fully_async",
            "sync_interval": 2,
            "max_staleness": None,
            "sync_method": "checkpoint",
            "max_backlog_steps": 3,
        }
        and new["buffer"] == {}
    )
    assert notes == [
        "buffer.max_backlog_steps moved to synchronizer.max_backlog_steps",
        "synchronizer.sync_offset: 0 removed: mode 'fully_async' has no sync_offset",
    ]
    _, notes = migrate(OLD_RENDEZVOUS)
    assert notes == [
        "buffer.max_backlog_steps: 8 removed: mode 'one_step_off_policy' never used it",
        "synchronizer.max_staleness: null removed: mode 'one_step_off_policy' has no max_staleness",
    ]
    # Only the synchronizer's neutral values go: a meaningful one is left for validation to refuse, naming it.
    assert migrate({"synchronizer": {"mode": "fully_async", "sync_offset": 3}}) == (
        {"synchronizer": {"mode": "fully_async", "sync_offset": 3}},
        [],
    )


def test_the_flat_grpo_fields_migrate_into_the_algorithm_knobs():
    old = {
        "type": "grpo",
        "repeat_times": 2,
        "std_normalize": False,
        "clip_eps_low": 0.1,
        "clip_eps_high": 0.3,
        "old_logprobs": "recompute",
        "loss_agg": "seq-mean",
    }
    new, notes = migrate({"algorithm": old})
    assert new["algorithm"] == {
        "repeat_times": 2,
        "advantage": {"type": "grpo", "std": "none"},
        "loss": {"type": "ppo_clip", "clip_eps_low": 0.1, "clip_eps_high": 0.3},
        "proximal": "recompute",
        "aggregation": "seq-mean-token-mean",
    }
    assert len(notes) == 5 and notes[0].startswith("algorithm.type: grpo removed")
    algo = RFTConfig.model_validate(
        {"model": {"path": "m"}, "taskset": {"path": "t.jsonl"}, "algorithm": old}
    ).algorithm  # the run's own validation migrates too
    assert (algo.preset, algo.advantage.std, algo.loss.clip_eps_high, algo.proximal, algo.aggregation) == (
        "grpo",
        "none",
        0.3,
        "recompute",
        "seq-mean-token-mean",
    )


def test_rft_validate_print_shows_what_a_preset_expanded_to(tiny_model_dir, capsys):
    """The README's `rft validate configs/synchronous.yaml --set algorithm.preset=... --print` lines."""
    path, model = str(REPO / "configs" / "synchronous.yaml"), f"model.path={tiny_model_dir}"
    assert rft(["validate", path, "--set", model, "--set", "algorithm.preset=dapo", "--print"]) == 0
    algo = yaml.safe_load(capsys.readouterr().out)["algorithm"]
    assert algo["preset"] == "dapo" and algo["dynamic_sampling"] is True and algo["overlong"]["buffer_fraction"] == 0.25
    assert algo["loss"] == {
        "type": "ppo_clip",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
    }  # the file's loss, laid over the preset's
    assert (
        rft(
            [
                "validate",
                path,
                "--set",
                model,
                "--set",
                "algorithm.preset=gspo",
                "--set",
                "algorithm.loss={type: gspo}",
                "--print",
            ]
        )
        == 0
    )
    algo = yaml.safe_load(capsys.readouterr().out)["algorithm"]
    assert (
        algo["loss"] == {"type": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}
        and algo["aggregation"] == "seq-mean-token-mean"
    )


def test_rft_config_migrate_rewrites_a_file_that_then_loads_without_migration(tmp_path, tiny_model_dir, capsys):
    before = load_config(write(tmp_path, merge(base(tiny_model_dir), OLD_ASYNC), "ref.yaml"))
    p = tmp_path / "old.yaml"
    p.write_text("# my fully async run\n# (kept)\n" + yaml.safe_dump(merge(base(tiny_model_dir), OLD_ASYNC)))
    assert rft(["config", "migrate", str(p)]) == 0
    assert "buffer.max_backlog_steps moved to synchronizer.max_backlog_steps" in capsys.readouterr().out
    assert p.read_text().startswith("# my fully async run\n# (kept)\n")
    assert RFTConfig.model_validate(read_yaml(p)) == before  # no migration needed any more, same values
    text = p.read_text()
    assert (
        rft(["config", "migrate", str(p)]) == 0 and "already in the current shape, unchanged" in capsys.readouterr().out
    )
    assert p.read_text() == text


@pytest.mark.parametrize(
    "old_backlog", [{"buffer": {"max_backlog_steps": 3}}, {}], ids=["with-other-old-keys", "alone"]
)
def test_rft_config_migrate_refuses_a_value_without_meaning_and_leaves_the_file(
    old_backlog, tmp_path, tiny_model_dir, capsys
):
    p = write(
        tmp_path,
        merge(base(tiny_model_dir), {**old_backlog, "synchronizer": {"mode": "fully_async", "sync_offset": 3}}),
    )
    text = p.read_text()
    assert rft(["config", "migrate", str(p)]) == 2
    err = capsys.readouterr().err
    assert (
        "synchronizer.sync_offset = 3: mode 'fully_async' has no sync_offset" in err
        and "remove it or use a rendezvous mode" in err
    )
    assert p.read_text() == text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: Path(p).name)
def test_every_shipped_config_is_in_the_current_shape(path):
    data = read_yaml(path)
    assert migrate(data) == (data, [])
    RFTConfig.model_validate(
        data
    )  # loads without migration (and without the model directory: validators never touch the filesystem)


def test_a_run_stored_by_an_older_version_opens(tmp_path):
    from rl_engine.run.context import open_run

    run_dir = tmp_path / "runs" / "old-async"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text((REPO / "tests" / "rl_engine" / "old_run_config.yaml").read_text())
    cfg = open_run(str(run_dir)).cfg
    assert isinstance(cfg.synchronizer, DecoupledSync)
    assert (
        cfg.synchronizer.mode,
        cfg.synchronizer.sync_interval,
        cfg.synchronizer.max_backlog_steps,
        cfg.synchronizer.max_staleness,
    ) == ("fully_async", 2, 3, None)
    assert (cfg.name, cfg.trainer.train_batch_size, cfg.synchronizer.sync_method) == ("old-async", 4, "checkpoint")


def test_the_model_directory_is_checked_by_preflight_and_rft_validate_not_by_validators(
    tmp_path, tiny_model_dir, capsys
):
    from rl_engine.run.preflight import check_model_paths

    p = write(tmp_path, merge(base(tiny_model_dir), {"model": {"path": "/nonexistent/model"}}), "bad.yaml")
    cfg = load_config(p)  # validators only check values: no filesystem
    expected = ["model.path", "/nonexistent/model", "does not exist", "rft make-tiny-model"]
    with pytest.raises(ConfigError) as ei:
        check_model_paths(cfg.model)
    assert all(s in str(ei.value) for s in expected), str(ei.value)
    assert rft(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(s in err for s in expected), err
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path = .*config\.json': .* is a file, not a directory"):
        check_model_paths(
            validate_config(
                merge(base(tiny_model_dir), {"model": {"tokenizer_path": f"{tiny_model_dir}/config.json"}})
            ).model
        )
    with pytest.raises(ConfigError, match=r"has no config\.json; model\.path must be a Hugging Face model directory"):
        check_model_paths(validate_config(merge(base(tiny_model_dir), {"model": {"path": str(tmp_path)}})).model)
    check_model_paths(validate_config(base(tiny_model_dir)).model)  # a model directory passes


def test_workflow_config_variants_and_partial_refusal(tiny_model_dir):
    data = base(tiny_model_dir)
    assert validate_config(data).taskset.workflow.type == "single_turn"  # the default: prompt -> one response
    data["taskset"]["workflow"] = {"type": "python", "function": "my_env.game:play", "kwargs": {"level": 2}}
    assert validate_config(data).taskset.workflow.kwargs == {"level": 2}
    data["taskset"]["workflow"] = {"type": "calculator", "max_calls": 40}
    with pytest.raises(ConfigError, match="taskset.workflow.calculator.max_calls"):
        validate_config(data)
    data["taskset"]["workflow"] = {"type": "guess_number"}
    data["explorer"] = {"partial": {"enabled": True, "max_response_tokens": 64, "segment_max_tokens": 8}}
    with pytest.raises(
        ConfigError,
        match=r"explorer.partial.enabled with taskset.workflow.type = 'guess_number'.*a continuation cannot store",
    ):
        validate_config(data)
