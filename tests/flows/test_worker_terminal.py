"""What a worker's terminal shows of a mode flow run refused for its config: the flow run in the
process a worker starts for it (`python -m prefect.engine`, as tests/flows/test_cancelled_exit.py
runs one), with a `set` that names no field, or a `cfg` whose field has the wrong type (Prefect
refuses it before the flow runs). It fails naming the field (and the fix) on one line; no
traceback (issue 44: 47-57 lines, Prefect's engine logging the error's traceback twice).

    .venv/bin/python -m pytest tests/flows/test_worker_terminal.py
"""

from __future__ import annotations

import pytest

from harness.prefect_live import REPO
from harness.runs import small_config
from rl_engine.config import validate_config
from tests.flows.conftest import run_in_own_process

SET_FIELD_AND_FIX = (
    "trainer.total_stepz = 3: unknown key; remove it or check its spelling against `rft validate --schema`"
)
CFG_FIELD = "cfg.trainer.total_steps: Input should be a valid integer, unable to parse string as an integer"


def refused(cfg: dict, how: str) -> tuple[dict, str, str]:
    """(parameters, the problem's line in the state message, the line the terminal shows)."""
    if how == "set":
        return (
            {"cfg": cfg, "set": ["trainer.total_stepz=3"]},
            SET_FIELD_AND_FIX,
            (
                "Encountered exception during execution: ConfigError: flow parameter set=['trainer.total_stepz=3']: "
                f"invalid configuration (1 problem); {SET_FIELD_AND_FIX}"
            ),
        )
    # the run form's `cfg` with a field of the wrong type: Prefect refuses the parameters before the flow runs
    bad = {**cfg, "trainer": {**cfg["trainer"], "total_steps": "abc"}}
    return (
        {"cfg": bad},
        CFG_FIELD,
        (
            "Validation of flow parameters failed with error: ParameterTypeError: Flow run received invalid parameters: "
            f"- {CFG_FIELD}"
        ),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["set", "cfg"])
def test_a_refused_config_is_one_line_on_the_workers_terminal(prefect_server, tiny_model_dir, task_file, tmp_path, how):
    from flows.rendezvous import synchronous

    storage = tmp_path / "runs"
    cfg = validate_config(small_config(tiny_model_dir, task_file, str(storage), total_steps=2)).model_dump(mode="json")
    parameters, problem, line = refused(cfg, how)
    res, state = run_in_own_process(synchronous, parameters, f"{REPO}/flows/rendezvous.py:synchronous")
    out = res.stdout + res.stderr
    assert state.is_failed() and problem in state.message, state  # the UI's state message says it whole
    assert res.returncode == 1 and "Traceback" not in out, out
    # The field and its fix on one line of its own (Prefect's closing "Finished in state Failed(...)" quotes the state)
    said = [ln for ln in out.splitlines() if problem in ln and "Finished in state" not in ln]
    assert len(said) == 1 and said[0].endswith(line), out
    assert len(out.strip().splitlines()) <= 8, out
    assert not storage.exists() or not list(storage.iterdir())  # nothing of a run was created
