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
