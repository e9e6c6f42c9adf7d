"""Bad input, one table (harness/bad_input.py): each row a mistake a user makes, run as a test
that asserts the row ends in a clear error and changes nothing stored; and what must still pass.

    .venv/bin/python -m pytest tests/rl_engine/run/test_bad_input.py -q
    .venv/bin/python -m bench.faults --quick        # the same table as a report
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from harness.bad_input import CASES, Case, Env, run_case, snapshot, started_run
from harness.bad_input_features import FEATURE_CASES, TABLE
from rl_engine.errors import UserError


def _param(c: Case) -> Any:
    marks = [pytest.mark.slow] if c.needs in ("s3", "engine") else []
    return pytest.param(c, id=c.name.replace(" ", "-"), marks=marks)


@pytest.fixture
def env(tmp_path, tiny_model_dir, request) -> Env:
    return Env(tmp_path, tiny_model_dir, s3=lambda: request.getfixturevalue("s3_server"))


@pytest.mark.parametrize("case", [_param(c) for c in TABLE])
def test_bad_input_gets_a_clear_error(case: Case, env: Env):
    out = run_case(case, env)
    assert out["clear"], f"{case.name}: {out['why']}\n--- message:\n{out['message'][-3000:]}"


def test_the_table_covers_the_issue():
    areas = {c.area for c in CASES}
    assert {
        "config",
        "sampling",
        "model",
        "taskset",
        "prompt",
        "reward",
        "workflow",
        "storage",
        "resume",
        "buffer",
        "cli",
    } <= areas
    assert len(CASES) >= 30 and len({c.name for c in TABLE}) == len(TABLE)
    # the second round (issue 45): at least 25 rows, aimed at what is newest
    assert len(FEATURE_CASES) >= 25 and {"eval", "plugin", "algorithm", "reward", "cli", "rollout"} <= {
        c.area for c in FEATURE_CASES
    }


# --------------------------------------------------------------------------- what must still pass


def test_preflight_passes_good_inputs_and_leaves_nothing_behind(env):
    from rl_engine.run.preflight import preflight

    cfg = env.cfg()
    before = snapshot(env.tmp)
    assert preflight(cfg) is cfg
    assert snapshot(env.tmp) == before  # the probe file is gone; the storage directory may now exist, empty
    assert not any((env.tmp / "runs").iterdir())


@pytest.mark.slow
def test_storage_check_passes_an_existing_bucket_and_leaves_nothing(s3_bucket):
    import s3fs

    from rl_engine.run.storage_checks import check_storage

    url, options = s3_bucket
    check_storage(f"{url}/runs", options)
    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    assert fs.find(url) == []


def test_resume_with_the_runs_own_config_passes(env):
    from rl_engine.config import load_config
    from rl_engine.run.preflight import preflight

    run, url = started_run(env)
    # The config file the run was started from (no name, derived fields unset), and the run's saved copy.
    assert preflight(env.cfg(), url, "c.yaml") == run.cfg
    assert preflight(load_config(f"{url}/config.yaml"), url, "config.yaml") == run.cfg


def test_slow_reward_within_its_timeout_is_scored(env):
    from rl_engine.config import PythonReward
    from rl_engine.rewards import RolloutSample, Task, build_reward, score_rollouts

    mod = env.module(
        "import time\ndef f(prompt, response, task, finish_reason, scale=1.0):\n    time.sleep(0.05)\n    return {'len': scale * len(response)}\n"
    )
    fn = build_reward(PythonReward(type="python", function=f"{mod}:f", kwargs={"scale": 2.0}, timeout_s=5))
    result = score_rollouts(fn, [RolloutSample("p", "abc", Task("t", "p", None), "stop")] * 3)
    assert result.rewards == [6.0] * 3 and result.components == [{"len": 6.0}] * 3


def test_user_error_tracebacks_are_hidden_from_logs_others_kept():
    import io
    import logging

    from rl_engine.errors import hide_user_error_tracebacks

    logger = logging.getLogger(f"test.bad_input.{uuid.uuid4().hex[:6]}")
    stream = io.StringIO()
    logger.addHandler(logging.StreamHandler(stream))
    logger.propagate = False
    hide_user_error_tracebacks(logger.name)
    hide_user_error_tracebacks(logger.name)  # idempotent
    assert len(logger.filters) == 1
    refused = UserError(
        "flow parameter set=['trainer.total_stepz=3']: invalid configuration (1 problem)\n  trainer.total_stepz = 3: unknown key; remove it"
    )
    for exc in (refused, RuntimeError("a bug")):
        try:
            raise exc
        except Exception:
            logger.exception("Encountered exception during execution: %r", exc)
            # Prefect's engine restates it, traceback and all ("python -m prefect.engine" on a worker)
            logger.exception("Execution of flow run 'x' exited with unexpected exception")
    lines = stream.getvalue().splitlines()
    # The refused config: one line naming the field and the fix, and nothing else (issue 44: 54-57 lines on a worker)
    assert lines[0] == (
        "Encountered exception during execution: UserError: flow parameter set=['trainer.total_stepz=3']: "
        "invalid configuration (1 problem); trainer.total_stepz = 3: unknown key; remove it"
    ), lines
    assert lines[1] == "Encountered exception during execution: RuntimeError('a bug')", lines  # a bug keeps it all
    text = "\n".join(lines[1:])
    assert text.count("Traceback") == 2 and "RuntimeError: a bug" in text and "exited with unexpected exception" in text


@pytest.mark.slow
def test_sampling_refusals_match_vllm():
    """The sampling rows above refuse exactly what vLLM's SamplingParams refuses, and the bounds they
    allow, vLLM takes (importing vLLM takes seconds; no engine starts)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    for refused, message in (
        ({"temperature": 3.0}, "temperature must be in"),
        ({"stop": [""]}, "empty string"),
        ({"temperature": 0.0, "n": 4}, "n must be 1 when using greedy"),
    ):
        with pytest.raises(VLLMValidationError, match=message):
            SamplingParams(**refused)
    SamplingParams(temperature=2.0, top_p=1.0, top_k=0, n=4, stop=["\n"], max_tokens=1)


def _client_error(code: str, status: int, operation: str = "PutObject") -> Exception:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": f"{code} says the store"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        operation,
    )


def test_a_refused_request_is_access_denied_not_a_missing_bucket(monkeypatch):
    """s3fs turns a 403 into PermissionError and its bucket probe answers False for it: the storage
    check must name credentials, not tell the user to create a bucket that exists (without an S3 server:
    the fake store refuses every request, as an S3 endpoint does for credentials it does not know)."""
    from s3fs.errors import translate_boto_error

    import rl_engine.run.storage_checks as pf

    class RefusingStore:
        protocol = ("s3", "s3a")

        def pipe_file(self, path, data):
            raise translate_boto_error(_client_error("InvalidAccessKeyId", 403))

        def exists(self, path):
            return False  # what s3fs answers for a bucket it may not look at

    monkeypatch.setattr(pf, "open_for_checks", lambda url, options: (RefusingStore(), url.removeprefix("s3://")))
    with pytest.raises(UserError) as e:
        pf.check_storage("s3://bucket/runs", {"client_kwargs": {"endpoint_url": "http://store:9000"}})
    msg = str(e.value)
    assert (
        "access denied by the object store at endpoint http://store:9000 (InvalidAccessKeyId" in msg
        and "AWS_ACCESS_KEY_ID" in msg
    ), msg
    assert "does not exist" not in msg


def test_access_denied_tells_403_from_other_answers():
    from botocore.exceptions import NoCredentialsError
    from s3fs.errors import translate_boto_error

    from rl_engine.storage import access_denied

    assert access_denied(_client_error("AccessDenied", 403)) == "AccessDenied"
    assert access_denied(translate_boto_error(_client_error("SignatureDoesNotMatch", 403))) == "SignatureDoesNotMatch"
    assert access_denied(_client_error("", 403, "HeadBucket")) == "403"  # a HEAD answer has no body, so no code
    assert access_denied(NoCredentialsError()) == "NoCredentials"
    for other in (
        _client_error("NoSuchBucket", 404),
        _client_error("InternalError", 500),
        FileNotFoundError("b/x"),
        PermissionError("local"),
    ):
        assert access_denied(other) is None
