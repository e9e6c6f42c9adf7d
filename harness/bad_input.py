"""Bad input, one table: each row a mistake a user makes, and what they must get back.

Every row must end in a `UserError` (exit code 2 and no traceback where it goes through `rft`)
whose message matches the row's `problem` (what is wrong: the field, file or row) and `fix`
(what to do) patterns, or, where the design says so, in a counted, excluded sample; and nothing
that was stored before the mistake may change. Checks that `rl_engine.run.preflight` makes before any
engine starts are called the way `rft run` calls them; rows that need an engine are `slow`.
`run_case(case, Env(...))` meets one row; tests/rl_engine/run/test_bad_input.py runs each row as a
test, `python -m bench.faults --quick` the same table as a report.

`before` records what the row gave before the bad-input work of issue 13 (item 6): `clean` (a
clear error already), or `fixed` (a traceback, a hang, an error found only after the engines had
started, or a message without its fix).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rl_engine.errors import UserError

RFT = str(Path(sys.executable).with_name("rft"))


@dataclasses.dataclass
class Env:
    """A scratch directory for one row, the shared tiny model (never modified: rows that damage a
    model damage a copy) and, for the S3 rows, a function returning (endpoint, storage options)."""

    tmp: Path
    model: str
    s3: Callable[[], tuple[str, dict[str, Any]]] | None = None

    def tasks(self, lines: list[str] | None = None, name: str = "tasks.jsonl") -> str:
        rows = (
            lines
            if lines is not None
            else [json.dumps({"id": f"t{i}", "question": f"{i}+1=", "answer": str(i + 1)}) for i in range(8)]
        )
        path = self.tmp / name
        path.write_text("".join(line + "\n" for line in rows))
        return str(path)

    def raw(self, *overrides: str) -> dict[str, Any]:
        """A valid config as a dict, with `a.b=value` overrides (YAML values) applied."""
        from rl_engine.config import apply_overrides

        data = {
            "model": {"path": self.model, "max_model_len": 128},
            "taskset": {"path": self.tasks()},
            "explorer": {"sampling": {"max_tokens": 8}},
            "trainer": {"total_steps": 2},
            "buffer": {"storage": {"url": str(self.tmp / "runs")}},
        }
        return apply_overrides(data, list(overrides))

    def cfg(self, *overrides: str) -> Any:
        from rl_engine.config import validate_config

        return validate_config(self.raw(*overrides), "bad.yaml")

    def config_file(self, *overrides: str, data: dict[str, Any] | None = None) -> str:
        path = self.tmp / f"config-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(data if data is not None else self.raw(*overrides)))
        return str(path)

    def model_copy(self) -> Path:
        d = self.tmp / f"model-{uuid.uuid4().hex[:6]}"
        shutil.copytree(self.model, d)
        return d

    def module(self, source: str) -> str:
        """A uniquely named importable module holding `source`; returns its name."""
        name = f"rewards_{uuid.uuid4().hex[:10]}"
        (self.tmp / f"{name}.py").write_text(textwrap.dedent(source))
        if str(self.tmp) not in sys.path:
            sys.path.insert(0, str(self.tmp))
        return name

    def rft(
        self, *args: str, timeout: float = 300, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.tmp), os.environ.get("PYTHONPATH", "")]),
            **(extra_env or {}),
        }
        return subprocess.run([RFT, *args], cwd=self.tmp, env=env, capture_output=True, text=True, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: `build(env)` sets it up and returns the call that meets it (after which the
    stored files are compared), `problem` and `fix` are regexes the message must match."""

    name: str
    area: str
    build: Callable[[Env], Callable[[], Any]]
    problem: str
    fix: str
    before: str = "clean"
    excluded: bool = False  # the design counts and leaves out the sample instead of failing
    needs: str = ""  # "s3": an S3 server; "engine": starts engines (slow)


# --------------------------------------------------------------------------- building blocks


def _validate(*overrides: str) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import validate_config

        data = env.raw(*overrides)
        return lambda: validate_config(data, "bad.yaml")

    return build


def _preflight(*overrides: str, setup: Callable[[Env], list[str]] | None = None) -> Callable[[Env], Callable[[], Any]]:
    """`preflight` of a config; `setup(env)` damages inputs and returns further overrides."""

    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.run.preflight import preflight

        extra = setup(env) if setup else []
        cfg = env.cfg(*overrides, *extra)
        return lambda: preflight(cfg)

    return build


def _with_tasks(*lines: str, name: str = "bad.jsonl") -> Callable[[Env], list[str]]:
    return lambda env: [f"taskset.path={env.tasks(list(lines), name)}"]


def _damaged_model(damage: Callable[[Path], None]) -> Callable[[Env], list[str]]:
    def setup(env: Env) -> list[str]:
        d = env.model_copy()
        damage(d)
        return [f"model.path={d}"]

    return setup


def _truncate(p: Path, keep: float = 0.5) -> None:
    p.write_bytes(p.read_bytes()[: int(p.stat().st_size * keep)])


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = json.loads((d / name).read_text())
        edit(data)
        (d / name).write_text(json.dumps(data))

    return damage


def _no_pickle_only(d: Path) -> None:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")


def _other_models_config(d: Path) -> None:
    _edit_json("config.json", lambda c: c.update(hidden_size=256, intermediate_size=512))(d)


def _no_tokenizer(d: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()


def _tokenizer_without_pad(env: Env) -> list[str]:
    d = env.tmp / "tokenizer"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(env.model) / f, d / f)
    _edit_json("tokenizer_config.json", lambda c: c.pop("pad_token"))(d)
    return [f"model.tokenizer_path={d}"]


def _bigger_tokenizer(env: Env) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(env.model)
    tok.add_tokens([f"<extra-{i}>" for i in range(8)])
    tok.save_pretrained(env.tmp / "tokenizer")
    return [f"model.tokenizer_path={env.tmp / 'tokenizer'}"]


def _reward(source: str, samples: int = 4, bad_every: int = 1, **config: Any) -> Callable[[Env], Callable[[], Any]]:
    """Score `samples` samples with the user reward `f` defined in `source`; rows whose responses
    are `bad` (every `bad_every`-th) are the ones the reward may fail on."""

    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import PythonReward
        from rl_engine.rewards import RolloutSample, Task, build_reward, score_rollouts

        fn = build_reward(PythonReward(type="python", function=f"{env.module(source)}:f", **config))
        items = [
            RolloutSample("1+1=", "bad" if i % bad_every == 0 else "2", Task(f"t{i}", "1+1=", "2"), "stop")
            for i in range(samples)
        ]

        def call() -> str:
            result = score_rollouts(fn, items)
            failed = sum(not ok for ok in result.ok)
            assert (
                failed == result.metrics["reward/errors"] == len(range(0, samples, bad_every))
                and result.metrics["reward/count"] == samples - failed
            )
            return f"{failed} of {samples} samples excluded (reward/errors): {result.metrics['reward/error_messages']}"

        return call

    return build


def _build_reward(function: str, source: str | None = None, **kwargs: Any) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import PythonReward
        from rl_engine.rewards import build_reward

        spec = function.replace("MOD", env.module(source)) if source else function
        return lambda: build_reward(PythonReward(type="python", function=spec, kwargs=kwargs))

    return build


def _build_workflow(function: str, source: str | None = None, **kwargs: Any) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import PythonWorkflow
        from rl_engine.rollout.workflow import build_workflow

        spec = function.replace("MOD", env.module(source)) if source else function
        return lambda: build_workflow(PythonWorkflow(type="python", function=spec, kwargs=kwargs))

    return build


def started_run(env: Env, *overrides: str) -> tuple[Any, str]:
    """A run as `rft run` leaves it after two trainer steps: its config, a buffer of two explorer
    steps and a committed trainer state (the tiny model's weights)."""
    from safetensors.torch import load_file, save_file

    from rl_engine.buffer import BufferWriter
    from rl_engine.buffer.synthetic import make_batch
    from rl_engine.run.context import start_run

    run = start_run(env.cfg("name=r1", *overrides))
    for e in (1, 2):
        BufferWriter(*run.fs(), 0).write(e, make_batch(8, explorer_step=e))
    state = Path(run.url) / "trainer_state" / "step=2"
    state.mkdir(parents=True)
    save_file(load_file(f"{env.model}/model.safetensors"), str(state / "model.safetensors"))
    (state / "COMMITTED").write_text(json.dumps({"version": 2}))
    return run, run.url


def _resume(
    *given: str, edit_state: Callable[[Path], None] | None = None, url: Callable[[str], str] | None = None
) -> Callable[[Env], Callable[[], Any]]:
    """`preflight` of `rft run CONFIG --resume RUN` where CONFIG is the run's config with `given` overrides."""

    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.run.preflight import preflight

        _, run_url = started_run(env)
        if edit_state:
            edit_state(Path(run_url) / "trainer_state" / "step=2" / "model.safetensors")
        cfg = env.cfg(*given)
        target = url(run_url) if url else run_url
        return lambda: preflight(cfg, target, "bad.yaml")

    return build


def _state_of_other_model(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:, :64].contiguous()
    save_file(weights, str(path))


def _restore_other_model(env: Env) -> Callable[[], Any]:
    import torch

    from rl_engine.trainer.checkpoint import restore_state

    module = torch.nn.Linear(4, 2)
    return lambda: restore_state(module, None, {"weight": torch.zeros(2, 8), "bias": torch.zeros(2)}, {}, {})


def _corrupt_buffer(damage: str) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.buffer import BufferReader
        from rl_engine.buffer._files import list_commits
        from rl_engine.config import BufferConfig
        from rl_engine.storage import open_storage

        _, run_url = started_run(env)
        fs, root = open_storage(run_url)
        record = Path(list_commits(fs, root)[0][1])
        if damage == "truncated":
            _truncate(Path(root) / "buffer" / json.loads(record.read_text())["path"])
        elif damage == "bit flip":
            data_file = Path(root) / "buffer" / json.loads(record.read_text())["path"]
            b = bytearray(data_file.read_bytes())
            b[len(b) // 2] ^= 1
            data_file.write_bytes(bytes(b))
        elif damage == "record garbage":
            record.write_text('{"format": 1, "path": ')
        else:  # a record of another format version
            record.write_text(json.dumps({**json.loads(record.read_text()), "format": 99}))
        return lambda: BufferReader(*open_storage(run_url, {}), BufferConfig(on_corrupt="fail")).read_batch(
            8, timeout_s=0
        )

    return build


def _unwritable_dir(env: Env) -> list[str]:
    if os.geteuid() != 0:
        d = env.tmp / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return [f"buffer.storage.url={d}/runs"]
    return ["buffer.storage.url=/proc/rft-runs"]  # root ignores permission bits; /proc refuses everyone


def _under_a_file(env: Env) -> list[str]:
    (env.tmp / "a-file").write_text("x")
    return [f"buffer.storage.url={env.tmp}/a-file/runs"]


def _missing_bucket(start: bool) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        import s3fs

        from rl_engine.config import validate_config
        from rl_engine.run.context import start_run
        from rl_engine.run.preflight import preflight

        assert env.s3 is not None
        _, options = env.s3()
        bucket = f"missing-{uuid.uuid4().hex[:8]}"
        data = env.raw(f"buffer.storage.url=s3://{bucket}/runs")
        data["buffer"]["storage"]["options"] = options
        cfg = validate_config(data, "bad.yaml")

        def call() -> Any:
            try:
                return start_run(cfg) if start else preflight(cfg)
            finally:
                fs = s3fs.S3FileSystem(**options)
                fs.invalidate_cache()
                assert not fs.exists(bucket), f"bucket {bucket} was created"

        return call

    return build


def _cli(
    *args: str, setup: Callable[[Env], list[str]] | None = None, config: bool = True
) -> Callable[[Env], Callable[[], Any]]:
    """`rft ARGS [CONFIG]` as a subprocess; CONFIG is a valid config with `setup`'s overrides."""

    def build(env: Env) -> Callable[[], Any]:
        extra = setup(env) if setup else []
        argv = [a.replace("TMP", str(env.tmp)) for a in args] + ([env.config_file(*extra)] if config else [])
        return lambda: env.rft(*argv)

    return build


def _load(text: bytes, name: str = "bad.yaml") -> Callable[[Env], Callable[[], Any]]:
    """`load_config` of a file holding `text` after a valid config's YAML (b"" for none)."""

    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import load_config

        path = env.tmp / name
        path.write_bytes(yaml.safe_dump(env.raw()).encode() + text)
        return lambda: load_config(path)

    return build


def _cli_not_utf8(env: Env) -> Callable[[], Any]:
    path = env.tmp / "latin1.yaml"
    path.write_bytes(yaml.safe_dump(env.raw()).encode() + "name: caf\xe9-run\n".encode("latin-1"))
    return lambda: env.rft("validate", str(path))


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()`, failing the row (not a UserError) if it ended later than `seconds`."""
    import time

    start = time.monotonic()
    try:
        return call()
    finally:
        took = time.monotonic() - start
        assert took <= seconds, f"took {took:.0f} s, more than {seconds:g} s"


def _dead_prefect_api(env: Env) -> Callable[[], Any]:
    from rl_engine.trainer.dist import free_port

    path = env.config_file()

    def call() -> Any:
        result = _within(
            60, lambda: env.rft("run", path, extra_env={"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"})
        )
        runs = env.tmp / "runs"
        assert not runs.exists() or not any(runs.iterdir()), (
            f"the run's directory was created: {sorted(runs.iterdir())}"
        )
        return result

    return call


def _damaged_saved_config(env: Env) -> Callable[[], Any]:
    from rl_engine.run.preflight import preflight

    _, url = started_run(env)
    Path(url, "config.yaml").write_text("model: {path: [unclosed\n")
    cfg = env.cfg()
    return lambda: preflight(cfg, url, "bad.yaml")


def _complete_run(env: Env) -> Callable[[], Any]:
    """A run whose trainer reached trainer.total_steps (2), with its model and report written."""
    from rl_engine.run.preflight import preflight

    _, url = started_run(env)
    shutil.copytree(env.model, Path(url, "model"))
    Path(url, "report").mkdir()
    Path(url, "report", "summary.json").write_text("{}")
    cfg = env.cfg()
    return lambda: _within(10, lambda: preflight(cfg, url, "bad.yaml"))


def _dead_s3_endpoint(env: Env) -> Callable[[], Any]:
    """An S3 endpoint refusing connections (a port nobody listens on), the default outage limit (120 s)."""
    from rl_engine.config import validate_config
    from rl_engine.run.preflight import preflight
    from rl_engine.trainer.dist import free_port

    for k, v in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)  # dummies, as the S3 server fixture sets them: nothing is signed for real
    data = env.raw("buffer.storage.url=s3://rft-runs/runs")
    data["buffer"]["storage"]["options"] = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"}}
    cfg = validate_config(data, "bad.yaml")
    return lambda: _within(20, lambda: preflight(cfg))  # preflight waits 5 s for a store that does not answer


def _s3_credentials_refused(env: Env) -> Callable[[], Any]:
    """An existing bucket, then moto's IAM check switched on (its `reset-auth` API): the session's
    dummy credentials are in no IAM user's records, so every request gets 403 InvalidAccessKeyId."""
    import requests
    import s3fs

    from rl_engine.config import validate_config
    from rl_engine.run.preflight import preflight

    assert env.s3 is not None
    endpoint, options = env.s3()
    bucket = f"denied-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
    data = env.raw(f"buffer.storage.url=s3://{bucket}/runs")
    data["buffer"]["storage"]["options"] = options
    cfg = validate_config(data, "bad.yaml")

    def call() -> Any:
        previous = requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).json()[
            "PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"
        ]
        try:
            return preflight(cfg)
        finally:
            requests.post(f"{endpoint}/moto-api/reset-auth", data=str(previous).encode(), timeout=10)

    return call


def _resume_missing_cli(env: Env) -> Callable[[], Any]:
    path = env.config_file()
    return lambda: env.rft("run", path, "--resume", str(env.tmp / "runs" / "no-such-run"))


def _real_run_broken_reward(env: Env) -> Callable[[], Any]:
    mod = env.module("def f(prompt, response, task):\n    raise ValueError('cannot parse ' + repr(response[:10]))\n")
    path = env.config_file(
        f"taskset.reward={{type: python, function: '{mod}:f'}}",
        "explorer.engine={kv_cache_space_gib: 0.25, num_threads: 1}",
        "trainer.micro_batch_size=16",
        "monitor.artifacts=false",
    )
    return lambda: env.rft("run", path, timeout=600)


# --------------------------------------------------------------------------- the table

NEVER_RETURNS = "import time\ndef f(prompt, response, task):\n    time.sleep(60)\n    return 1.0\n"
RAISES = "def f(prompt, response, task):\n    if response == 'bad':\n        raise ValueError('cannot parse ' + repr(response))\n    return 1.0\n"
NAN = "def f(prompt, response, task):\n    return float('nan') if response == 'bad' else 1.0\n"
STRING = "def f(prompt, response, task):\n    return 'high' if response == 'bad' else 1.0\n"
LONG_PROMPT = json.dumps({"id": "long-1", "question": "1+" * 200 + "1=", "answer": "201"})

CASES: list[Case] = [
    # ---- configs: types, ranges, unknown keys, inconsistent modes
    Case(
        "wrong type", "config", _validate("trainer.total_steps=ten"), r"trainer\.total_steps = 'ten'", r"valid integer"
    ),
    Case(
        "out of range",
        "config",
        _validate("explorer.batch_size=0"),
        r"explorer\.batch_size = 0",
        r"greater than or equal to 1",
    ),
    Case(
        "unknown key",
        "config",
        _validate("trainer.learning_rate=0.1"),
        r"trainer\.learning_rate.*unknown key",
        r"check its spelling against `rft validate --schema`",
    ),
    Case(
        "GRPO group of one",
        "config",
        _validate("algorithm.repeat_times=1"),
        r"algorithm\.repeat_times = 1",
        r"set it >= 2",
    ),
    Case(
        "offset in synchronous mode",
        "config",
        _validate("synchronizer.sync_offset=1"),
        r"synchronizer\.sync_offset = 1",
        r"use mode 'one_step_off_policy'",
    ),
    Case(
        "multi_explorer with one explorer",
        "config",
        _validate("synchronizer.mode=multi_explorer"),
        r"explorer\.count = 1",
        r"explorer\.count >= 2",
    ),
    Case(
        "staleness bound in a rendezvous mode",
        "config",
        _validate("synchronizer.max_staleness=2"),
        r"synchronizer\.max_staleness = 2",
        r"set it to null or use an async mode",
    ),
    Case(
        "credentials in storage options",
        "config",
        _validate("buffer.storage.options={key: AKIA123}"),
        r"must not hold credentials \('key'\)",
        r"in the environment",
    ),
    Case(
        "model directory missing",
        "model",
        _preflight("model.path=/nonexistent/model"),
        r"model directory '/nonexistent/model' does not exist",
        r"rft make-tiny-model",
    ),
    Case(
        "seed beyond numpy's range",
        "config",
        _validate("seed=1180591620717411303424"),
        r"seed = 1180591620717411303424: too large",
        r"use a seed in 0\.\.4294966272",
        "fixed",
    ),
    Case(
        "section given twice",
        "config",
        _load(b"trainer:\n  lr: 0.001\n", "twice.yaml"),
        r"twice\.yaml: line \d+: key 'trainer' given twice in one section \(first at line \d+\)",
        r"merge the two into one or delete one",
        "fixed",
    ),
    Case(
        "key given twice in a section",
        "config",
        _load(b"synchronizer:\n  sync_interval: 2\n  sync_interval: 4\n", "twice.yaml"),
        r"line \d+: key 'sync_interval' given twice",
        r"merge the two",
        "fixed",
    ),
    Case(
        "learning rate NaN",
        "config",
        _validate("trainer.lr=.nan"),
        r"trainer\.lr = nan: must be a finite number",
        r"give a number within the field's bounds",
        "fixed",
    ),
    Case(
        "infinite timeout",
        "config",
        _validate("buffer.read_timeout_s=.inf"),
        r"buffer\.read_timeout_s = inf: must be a finite number",
        r"give a number",
        "fixed",
    ),
    Case(
        "model path is a file",
        "model",
        lambda env: _preflight(f"model.path={env.model}/config.json")(env),
        r"model\.path = '.*config\.json': '.*config\.json' is a file, not a directory",
        r"point model\.path at the directory that holds",
        "fixed",
    ),
    # ---- sampling settings vLLM refuses: caught when the config loads
    Case(
        "temperature above vLLM's 2",
        "sampling",
        _validate("explorer.sampling.temperature=3.0"),
        r"explorer\.sampling\.temperature = 3\.0",
        r"less than or equal to 2",
        "fixed",
    ),
    Case(
        "empty stop string",
        "sampling",
        _validate("explorer.sampling.stop=['']"),
        r"explorer\.sampling\.stop.*empty stop string",
        r"remove it",
        "fixed",
    ),
    Case(
        "greedy with a GRPO group",
        "sampling",
        _validate("explorer.sampling.temperature=0"),
        r"explorer\.sampling\.temperature = 0.*identical rollouts",
        r"use a temperature > 0",
        "fixed",
    ),
    # ---- model directories (preflight)
    Case(
        "corrupt config.json",
        "model",
        _preflight(setup=_damaged_model(lambda d: (d / "config.json").write_text('{"model_type": "qwen2",'))),
        r"config\.json: not valid JSON",
        r"restore the model's config\.json",
        "fixed",
    ),
    Case(
        "config.json of no model",
        "model",
        _preflight(setup=_damaged_model(lambda d: (d / "config.json").write_text("{}"))),
        r"config\.json: not a Hugging Face model config",
        r"restore the model's config\.json",
        "fixed",
    ),
    Case(
        "truncated safetensors",
        "model",
        _preflight(setup=_damaged_model(lambda d: _truncate(d / "model.safetensors"))),
        r"model\.safetensors: truncated",
        r"copy it again",
        "fixed",
    ),
    Case(
        "pickle weights only",
        "model",
        _preflight(setup=_damaged_model(_no_pickle_only)),
        r"no \*\.safetensors weights.*pickle",
        r"safe_serialization=True",
        "fixed",
    ),
    Case(
        "weights of another model",
        "model",
        _preflight(setup=_damaged_model(_other_models_config)),
        r"weights do not fit its config\.json",
        r"config\.json and the \*\.safetensors of one model together",
        "fixed",
    ),
    Case(
        "no tokenizer files",
        "model",
        _preflight(setup=_damaged_model(_no_tokenizer)),
        r"cannot load a tokenizer",
        r"tokenizer\.json and tokenizer_config\.json",
        "fixed",
    ),
    Case(
        "tokenizer without pad token",
        "model",
        _preflight(setup=_damaged_model(_edit_json("tokenizer_config.json", lambda c: c.update(pad_token=None)))),
        r"model\.path = .*the tokenizer has no pad token",
        r"tokenizer\.pad_token = tokenizer\.eos_token",
        "fixed",
    ),
    Case(
        "separate tokenizer without pad token",
        "model",
        _preflight(setup=_tokenizer_without_pad),
        r"model\.tokenizer_path = .*the tokenizer has no pad token",
        r"tokenizer\.pad_token = tokenizer\.eos_token",
        "fixed",
    ),
    Case(
        "context longer than the model's positions",
        "model",
        _preflight("model.max_model_len=1000000"),
        r"model\.max_model_len = 1000000: the model .* has max_position_embeddings = 1024",
        r"set model\.max_model_len <= 1024",
        "fixed",
    ),
    Case(
        "tokenizer of another model",
        "model",
        _preflight(setup=_bigger_tokenizer),
        r"the tokenizer has 267 tokens but the model's embedding only 259 rows",
        r"use the model's own tokenizer",
        "fixed",
    ),
    # ---- task sets (preflight: before any engine; they used to surface after ~45 s of engine start-up)
    Case(
        "task set missing",
        "taskset",
        _preflight(setup=lambda env: [f"taskset.path={env.tmp}/nope.jsonl"]),
        r"nope\.jsonl'?: file not found",
        r"rft make-tasks",
        "fixed",
    ),
    Case("empty task set", "taskset", _preflight(setup=_with_tasks()), r"the task set is empty", r"add rows", "fixed"),
    Case(
        "malformed row",
        "taskset",
        _preflight(setup=_with_tasks('{"question": "1+1="}', "{}", '{"question": "2+2=", ')),
        r"bad\.jsonl: line 3: not valid JSON",
        r"fix or delete that line",
        "fixed",
    ),
    Case(
        "row without the prompt field",
        "taskset",
        _preflight(setup=_with_tasks('{"question": "1+1="}', '{"prompt": "2+2="}')),
        r"line 2: no 'question' key",
        r"set taskset\.prompt_key",
        "fixed",
    ),
    Case(
        "rows without the reward's answer",
        "taskset",
        _preflight(
            setup=_with_tasks(
                '{"question": "1+1=", "answer": "2"}', '{"question": "2+2="}', '{"question": "3+3=", "answer": null}'
            )
        ),
        r"bad\.jsonl: line 2: no 'answer' value \(keys: \['question'\]\) \(and 1 more row\(s\)\), and the arithmetic reward",
        r"give every row its answer, or set taskset\.answer_key",
        "fixed",
    ),
    Case(
        "prompt not a string",
        "taskset",
        _preflight(setup=_with_tasks('{"question": 12}')),
        r"line 1: 'question' must be a string",
        r"write the prompt as a string",
        "fixed",
    ),
    Case(
        "duplicate task ids",
        "taskset",
        _preflight(setup=_with_tasks('{"id": "a", "question": "1="}', '{"id": "a", "question": "2="}')),
        r"line 2: duplicate id 'a'",
        r"give every row its own id",
        "fixed",
    ),
    Case(
        "unknown task file type",
        "taskset",
        _preflight(setup=_with_tasks("q,a", name="tasks.csv")),
        r"tasks\.csv'?: unknown file type",
        r"use \.jsonl",
        "fixed",
    ),
    # ---- prompts longer than the context (preflight formats and tokenizes every prompt)
    Case(
        "prompt longer than the context",
        "prompt",
        _preflight(setup=_with_tasks('{"question": "1+1=", "answer": "2"}', LONG_PROMPT)),
        r"1 prompt\(s\) leave no room.*'long-1' \(\d+ tokens\)",
        r"shorten or drop those rows, or raise model\.max_model_len",
        "fixed",
    ),
    Case(
        "empty prompt",
        "prompt",
        _preflight(setup=_with_tasks('{"id": "e", "question": "", "answer": "0"}')),
        r"prompt\(s\) are empty.*'e'",
        r"give every row a prompt",
        "fixed",
    ),
    # ---- reward functions
    Case(
        "reward does not import",
        "reward",
        _build_reward("no_such_rewards_xyz:f"),
        r"cannot import module 'no_such_rewards_xyz'",
        r"installed or on PYTHONPATH",
    ),
    Case(
        "reward module fails at import",
        "reward",
        _build_reward("MOD:f", "raise RuntimeError('needs a GPU')\n"),
        r"RuntimeError: needs a GPU",
        r"installed or on PYTHONPATH",
    ),
    Case(
        "reward with a wrong signature",
        "reward",
        _build_reward("MOD:f", "def f(prompt):\n    return 0.0\n"),
        r"signature \(prompt\) cannot be called",
        r"as \(prompt, response, task\[, finish_reason\]\)",
    ),
    Case(
        "reward not importable, at preflight",
        "reward",
        _preflight("taskset.reward={type: python, function: 'no_such_rewards_xyz:f'}"),
        r"cannot import module",
        r"installed or on PYTHONPATH",
        "fixed",
    ),
    Case(
        "reward raises on some samples",
        "reward",
        _reward(RAISES, bad_every=2),
        r"2 of 4 samples excluded.*ValueError: cannot parse 'bad'",
        r"",
        excluded=True,
    ),
    Case(
        "reward returns NaN on some samples",
        "reward",
        _reward(NAN, bad_every=2),
        r"2 of 4 samples excluded.*not finite",
        r"",
        excluded=True,
    ),
    Case(
        "reward returns a string on some samples",
        "reward",
        _reward(STRING, bad_every=2),
        r"2 of 4 samples excluded.*returned str 'high'",
        r"",
        excluded=True,
    ),
    Case(
        "reward raises on every sample",
        "reward",
        _reward(RAISES),
        r"failed on all 4 samples.*ValueError: cannot parse 'bad'",
        r"fix the reward: it must return a finite float",
        "fixed",
    ),
    Case(
        "reward returns NaN on every sample",
        "reward",
        _reward(NAN),
        r"failed on all 4 samples.*not finite",
        r"fix the reward",
        "fixed",
    ),
    Case(
        "reward returns a string on every sample",
        "reward",
        _reward(STRING),
        r"failed on all 4 samples.*returned str 'high'",
        r"fix the reward",
        "fixed",
    ),
    Case(
        "reward never returns",
        "reward",
        _reward(NEVER_RETURNS, timeout_s=0.3),
        r"did not return within taskset\.reward\.timeout_s = 0\.3 s \(task 't0'\)",
        r"make it return faster.*or raise taskset\.reward\.timeout_s",
        "fixed",
    ),
    # ---- workflow
    Case(
        "workflow does not import",
        "workflow",
        _build_workflow("no_such_workflows_xyz:play"),
        r"taskset\.workflow\.function = 'no_such_workflows_xyz:play': cannot import module",
        r"installed or on PYTHONPATH",
    ),
    Case(
        "workflow name not in its module",
        "workflow",
        _build_workflow("MOD:play", "def other(task, episode):\n    return 0.0\n"),
        r"has no attribute 'play'",
        r"",
    ),
    Case(
        "workflow class with wrong kwargs",
        "workflow",
        _build_workflow(
            "MOD:Game",
            "class Game:\n    def __init__(self, turns):\n        self.turns = turns\n    def run(self, task, episode):\n        return 0.0\n",
            level=2,
        ),
        r"cannot build the class with taskset\.workflow\.kwargs \['level'\]",
        r"",
    ),
    Case(
        "workflow not importable, at preflight",
        "workflow",
        _preflight("taskset.workflow={type: python, function: 'no_such_workflows_xyz:play'}"),
        r"cannot import module",
        r"installed or on PYTHONPATH",
        "fixed",
    ),
    Case(
        "workflow with partial rollouts",
        "workflow",
        _validate("taskset.workflow={type: calculator}", "explorer.partial.enabled=true"),
        r"explorer\.partial\.enabled with taskset\.workflow\.type = 'calculator'",
        r"disable explorer\.partial or use taskset\.workflow\.type: single_turn",
    ),
    Case(
        "failed episodes scored without a reward",
        "workflow",
        _validate("taskset.user_code.on_episode_error=score"),
        r"on_episode_error = score needs taskset\.user_code\.failed_reward",
        r"",
    ),
    # ---- storage
    Case(
        "storage not writable",
        "storage",
        _preflight(setup=_unwritable_dir),
        r"buffer\.storage\.url = .*cannot write there",
        r"point buffer\.storage\.url at a directory or bucket you can write to",
        "fixed",
    ),
    Case(
        "storage under a file",
        "storage",
        _preflight(setup=_under_a_file),
        r"a-file/runs'?: cannot write there",
        r"point buffer\.storage\.url at",
        "fixed",
    ),
    Case(
        "unknown storage protocol",
        "storage",
        _preflight("buffer.storage.url=nosuchfs://bucket/runs"),
        r"nosuchfs://bucket/runs'?: cannot open it",
        r"fsspec URL such as s3://",
        "fixed",
    ),
    Case(
        "missing S3 bucket",
        "storage",
        _missing_bucket(start=False),
        r"bucket 'missing-\w+' does not exist \(rft never creates buckets\)",
        r"create it first",
        "fixed",
        needs="s3",
    ),
    Case(
        "S3 endpoint refusing connections",
        "storage",
        _dead_s3_endpoint,
        r"rft-runs/runs'?: the object store at endpoint http://127\.0\.0\.1:\d+ did not answer within the 5 s",
        r"endpoint_url\) is up and reachable.*buffer\.storage\.outage_timeout_s = 120 s",
        "fixed",
    ),
    Case(
        "S3 credentials refused",
        "storage",
        _s3_credentials_refused,
        r"access denied by the object store at endpoint http://127\.0\.0\.1:\d+ \(InvalidAccessKeyId",
        r"check the credentials in the environment \(AWS_ACCESS_KEY_ID",
        "fixed",
        needs="s3",
    ),
    Case(
        "missing S3 bucket, run started by a flow",
        "storage",
        _missing_bucket(start=True),
        r"bucket 'missing-\w+' does not exist",
        r"create it first",
        "fixed",
        needs="s3",
    ),
    # ---- runs: new, resumed
    Case(
        "new run under an existing name",
        "resume",
        lambda env: (started_run(env), _preflight("name=r1")(env))[1],
        r"run .*/runs/r1 already exists",
        r"resume it with `rft run CONFIG --resume",
        "fixed",
    ),
    Case(
        "resume of a missing run",
        "resume",
        _resume(url=lambda u: u + "-missing"),
        r"r1-missing: not a run directory \(no config\.yaml\)",
        r"runs live under buffer\.storage\.url",
    ),
    Case(
        "resume with a different mode",
        "resume",
        _resume("synchronizer.mode=fully_async"),
        r"that run is mode 'synchronous', bad\.yaml says 'fully_async'",
        r"resume it with its own config.*or start a new run",
        "fixed",
    ),
    Case(
        "resume with an edited config",
        "resume",
        _resume("trainer.total_steps=50", "trainer.lr=0.001"),
        r"differs .* in 2 field\(s\): trainer\.lr .*trainer\.total_steps \(the run's 2, given 50\)",
        r"resume with that one \(`rft run .*r1/config\.yaml --resume",
        "fixed",
    ),
    Case(
        "resume of a run whose config.yaml is damaged",
        "resume",
        _damaged_saved_config,
        r"r1/config\.yaml is damaged, not readable as a config \(.*r1/config\.yaml: not valid YAML",
        r"restore it from a copy.*--set name=r1 --print",
        "fixed",
    ),
    Case(
        "resume of a complete run",
        "resume",
        _complete_run,
        r"r1: the run is complete, its trainer reached step 2 of trainer\.total_steps = 2",
        r"nothing to resume: use that model, or start a new run",
        "fixed",
    ),
    Case(
        "checkpoint from another model, on resume",
        "resume",
        _resume(edit_state=_state_of_other_model),
        r"trainer state trainer_state/step=2 does not fit this model.*model\.embed_tokens\.weight \[259, 64\]",
        r"Resume with the model the run was started from",
        "fixed",
    ),
    Case(
        "checkpoint from another model, at restore",
        "resume",
        _restore_other_model,
        r"trainer state does not fit this model.*weight \[2, 8\], the model's \[2, 4\]",
        r"Resume with the model the run was started from",
        "fixed",
    ),
    # ---- corrupted buffer files and commit records (found when read: the reader stops, deletes nothing)
    Case(
        "truncated buffer file",
        "buffer",
        _corrupt_buffer("truncated"),
        r"part-\w+\.arrow: size \d+ bytes, its commit record says \d+: truncated",
        r"restore the file from a copy, or set buffer\.on_corrupt: skip",
        "fixed",
    ),
    Case(
        "buffer file altered after commit",
        "buffer",
        _corrupt_buffer("bit flip"),
        r"part-\w+\.arrow: checksum mismatch",
        r"buffer\.on_corrupt: skip",
        "fixed",
    ),
    Case(
        "unreadable commit record",
        "buffer",
        _corrupt_buffer("record garbage"),
        r"_commits/\S+\.json: unreadable commit record",
        r"buffer\.on_corrupt: skip",
        "fixed",
    ),
    Case(
        "commit record of another format",
        "buffer",
        _corrupt_buffer("record format"),
        r"commit record format 99, expected 1",
        r"buffer\.on_corrupt: skip",
        "fixed",
    ),
    # ---- through the command line: exit code 2, no traceback
    Case(
        "rft validate: unknown key",
        "cli",
        _cli("validate", setup=lambda env: ["trainer.learning_rate=0.1"]),
        r"trainer\.learning_rate.*unknown key",
        r"rft validate --schema",
    ),
    Case(
        "rft run: corrupt config.json",
        "cli",
        _cli("run", setup=_damaged_model(lambda d: (d / "config.json").write_text("{"))),
        r"config\.json: not valid JSON",
        r"restore the model's config\.json",
        "fixed",
    ),
    Case(
        "rft run: empty task set",
        "cli",
        _cli("run", setup=_with_tasks()),
        r"the task set is empty",
        r"add rows",
        "fixed",
    ),
    Case(
        "rft run: read-only storage",
        "cli",
        _cli("run", setup=_unwritable_dir),
        r"cannot write there",
        r"point buffer\.storage\.url at",
        "fixed",
    ),
    Case(
        "rft validate: config not UTF-8",
        "cli",
        _cli_not_utf8,
        r"latin1\.yaml: not UTF-8 text \(byte 0xe9 at line \d+, column 10\)",
        r"save the file as UTF-8",
        "fixed",
    ),
    Case(
        "rft run: Prefect API not answering",
        "cli",
        _dead_prefect_api,
        r"PREFECT_API_URL = 'http://127\.0\.0\.1:\d+/api': cannot reach a Prefect server there.*nothing of the run was created",
        r"prefect server start.*or unset it",
        "fixed",
    ),
    Case(
        "rft run --resume of a missing run",
        "cli",
        _resume_missing_cli,
        r"no-such-run: not a run directory",
        r"runs live under buffer\.storage\.url",
    ),
    Case(
        "rft run: reward fails on every sample",
        "cli",
        _real_run_broken_reward,
        r"failed on all 16 samples of this step.*ValueError: cannot parse",
        r"fix the reward",
        "fixed",
        needs="engine",
    ),
]


# --------------------------------------------------------------------------- running a row


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root`."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_case(case: Case, env: Env) -> dict[str, Any]:
    """Meet the row's bad input; returns {outcome, clear, message, why}: `clear` when it ended as
    the row says, with a message matching `problem` and `fix`, and every stored file unchanged."""
    call = case.build(env)
    stored = snapshot(env.tmp)
    outcome, message, why = "no error", "", []
    try:
        result = call()
    except UserError as e:
        outcome, message = "error", str(e)
    except Exception as e:  # noqa: BLE001 - what the row must not end in
        outcome, message = f"{type(e).__name__} (not a UserError)", f"{type(e).__name__}: {e}"
    else:
        if isinstance(result, subprocess.CompletedProcess):
            outcome, message = f"exit {result.returncode}", result.stderr.strip()
            if result.returncode != 2:
                why.append(f"exit code {result.returncode}, expected 2")
            if "Traceback" in result.stderr + result.stdout:
                why.append("a traceback was printed")
        elif case.excluded and isinstance(result, str):
            outcome, message = "excluded", result
    expected = "excluded" if case.excluded else ("exit 2" if case.area == "cli" else "error")
    if outcome != expected and not why:
        why.append(f"ended in {outcome!r}, expected {expected!r}")
    for what, pattern in (("problem", case.problem), ("fix", case.fix)):
        if not re.search(pattern, message, re.DOTALL):
            why.append(f"the message does not name the {what} (/{pattern}/)")
    after = snapshot(env.tmp)
    changed = sorted(p for p, h in stored.items() if after.get(p) != h)
    if changed:
        why.append(f"stored files changed or lost: {changed[:5]}")
    return {
        "case": case.name,
        "area": case.area,
        "before": case.before,
        "outcome": outcome,
        "clear": not why,
        "why": "; ".join(why),
        "message": message,
    }
