"""The run form of a mode's deployment, as Prefect draws it from the flow's parameter schema:
`set` first (the UI orders parameters by `position`), described, with an example; `cfg` still
required; no description loses a `<placeholder>` to the UI's markdown. Callers name `cfg` and
`resume` (keyword-only), so the reordering changes no call."""

from __future__ import annotations

import inspect

import pytest
from prefect.utilities.callables import parameter_schema

from flows.common import SET_EXAMPLE
from flows.decoupled import fully_async, multi_explorer
from flows.rendezvous import one_step_off_policy, synchronous
from rl_engine.config import validate_config
from tests.rl_engine.config.test_config import bare_placeholders, descriptions


@pytest.mark.parametrize(
    "mode_flow", [synchronous, one_step_off_policy, fully_async, multi_explorer], ids=lambda f: f.name
)
def test_set_comes_first_in_the_run_form_with_an_example(mode_flow):
    schema = parameter_schema(mode_flow).model_dump()
    props = schema["properties"]
    assert sorted(props, key=lambda k: props[k]["position"]) == ["set", "cfg", "resume"]
    assert props["set"]["examples"] == [SET_EXAMPLE] and all(str(x) in props["set"]["description"] for x in SET_EXAMPLE)
    assert (
        props["set"]["description"].startswith("Dotted overrides applied on top of `cfg`")
        and props["resume"]["description"]
        and props["cfg"]["description"]
    )
    assert schema["required"] == ["cfg"]
    assert not [text for _, text in descriptions(schema) if bare_placeholders(text)]
    params = inspect.signature(mode_flow.fn).parameters
    assert params["cfg"].kind is params["resume"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_example_is_a_valid_override(tiny_model_dir, task_file):
    from flows.common import with_overrides

    cfg = validate_config({"model": {"path": tiny_model_dir}, "taskset": {"path": task_file}})
    changed = with_overrides(cfg, SET_EXAMPLE)
    assert changed.trainer.total_steps == 50 and changed.algorithm.preset == "dapo"


def test_a_flow_run_named_after_its_run_at_creation_keeps_that_name(tiny_model_dir, task_file):
    """A mode flow run's name (`flow_run_name`, applied when the run starts) is its run's: a name
    its creator gave it after the run (`prefect deployment run --flow-run-name synchronous-nightly`,
    REST's `name`) is kept, and an unnamed run takes it, instead of a drawn one replacing it at
    the start (issue 44: Prefect's random names until the run starts, then another name)."""
    import re

    from flows.common import run_label

    cfg = validate_config({"model": {"path": tiny_model_dir}, "taskset": {"path": task_file}}).model_dump(mode="json")
    assert run_label("synchronous", {"cfg": cfg}, "synchronous-nightly") == "synchronous-nightly"
    drawn = run_label("synchronous", {"cfg": cfg}, "jolly-crane")  # Prefect's own name at creation: a name is drawn
    assert re.fullmatch(r"synchronous-\d{8}-\d{6}-[0-9a-f]{6}", drawn), drawn
    assert run_label("synchronous", {"cfg": {**cfg, "name": "weekly"}}, "synchronous-nightly") == "synchronous-weekly"
    assert run_label("fully_async", {"cfg": cfg}, "synchronous-nightly") != "synchronous-nightly"  # not this mode's
    assert run_label("synchronous", {"cfg": cfg, "resume": "runs/nightly/"}, "x") == "synchronous-nightly-resume"
    assert run_label("synchronous", {"cfg": cfg, "set": ["trainer.total_stepz=1"]}, "y") == "synchronous-invalid-config"
