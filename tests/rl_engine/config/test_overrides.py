"""Overrides that change a union's variant (issue 44, item 1): for every union of the config
(rl_engine/config/unions.py finds them in the models) and every variant, `set <union>.<key>=<variant>`
alone validates, from every shipped config (configs/*.yaml), on the file (`rft validate FILE --set`)
and on its validated dump (a deployment's `cfg` with a flow run's `set`: flows.common.with_overrides),
to the same config; the section starts from the new variant's defaults and keeps only the fields it
has. Where it does not validate alone, EXCEPTIONS says why, the error names the field, and the
fix the error proposes makes it validate. Variants that need more than their key get it in the
same list (REQUIRED; a plugin's registered name: `plugins=[my_plugin]`, the README's plugin).

    .venv/bin/python -m pytest tests/rl_engine/config/test_overrides.py -q
"""

from __future__ import annotations

import glob
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.main import main as rft
from flows.rendezvous import synchronous
from harness.plugin import write_readme_plugin
from rl_engine.config import ConfigError, RFTConfig, apply_overrides, load_config, read_yaml, validate_config
from rl_engine.config.unions import VariantUnion, unions, variant_defaults
from rl_engine.registry import ESTIMATORS, LOSSES, REWARDS, TASKS, WORKFLOWS
from tests.deployments.test_prefect_yaml import server_accepts

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted(Path(p).name for p in glob.glob(str(REPO / "configs" / "*.yaml")))
UNIONS: dict[str, VariantUnion] = {".".join(path): u for path, u in unions()}

# The union sections of the config; a union added to the models shows up here first.
EXPECTED_UNIONS = {
    "placement": "type",
    "synchronizer": "mode",
    "algorithm.advantage": "type",
    "algorithm.loss": "type",
    "taskset.reward": "type",
    "taskset.workflow": "type",
    "eval.tasksets.0.reward": "type",
    "monitor.trackers.0": "type",
}
# A list's union item, made by the same `set` list (no shipped config has one); each is of a
# variant with fields of its own at their defaults, which a switch drops.
ITEM = {
    "eval.tasksets.0.reward": ["eval.tasksets=[{name: heldout, path: heldout.jsonl, reward: {type: countdown}}]"],
    "monitor.trackers.0": ["monitor.trackers=[mlflow]"],
}
# The name a plugin registers, for a union whose `other` variant takes one (the README's my_plugin).
REGISTERED = {
    "algorithm.advantage": "centred",
    "algorithm.loss": "reinforce",
    "taskset.reward": "digits",
    "eval.tasksets.0.reward": "digits",
    "taskset.workflow": "two_tries",
}
# A value for each field a variant requires besides its key (`type: python`'s function).
REQUIRED = {
    "function": "my_plugin:reinforce",
    "path": "runs/models/rm",  # the model reward: a classifier
    "base_url": "http://127.0.0.1:8100/v1",  # the judge: an endpoint and its model
    "model": "judge",
}
# Fields a variant needs by a rule across its fields rather than one by one: the judge needs an
# endpoint (base_url and model) or a model directory of its own (path); the switch gives the first.
NEEDED = {"judge": ("base_url", "model")}


@dataclass(frozen=True)
class Exception_:
    why: str
    names: str  # what the error names
    fix: tuple[str, ...]  # overrides put before the switch that make it validate (what the error proposes)


_CLIP_HIGHER = Exception_(
    "every shipped config chooses clip_eps_high: 0.28 (clip-higher) for its ppo_clip loss, and this loss has no "
    "clip_eps_high: the rule refuses the choice the switch would drop, naming it",
    "algorithm.loss.clip_eps_high",
    ("algorithm.loss.clip_eps_high=0.2",),
)
_BATCH_STD = Exception_(
    "the real-model configs choose advantage.std: batch, which an estimator without a std field cannot keep: "
    "the rule refuses the choice the switch would drop, naming it",
    "algorithm.advantage.std",
    ("algorithm.advantage.std=group",),
)
_STALENESS = Exception_(
    "the config chooses max_staleness: 4, which the rendezvous modes have no field for: refused naming it",
    "synchronizer.max_staleness",
    ("synchronizer.max_staleness=null",),
)
_PARTIAL = Exception_(
    "partial.yaml enables explorer.partial, which continues single-turn generations only: another section's "
    "check, not the union's",
    "explorer.partial.enabled",
    ("explorer.partial.enabled=false",),
)
_ONE_EXPLORER = Exception_(
    "multi_explorer needs explorer.count >= 2 (the explorer section's, not the synchronizer's)",
    "explorer.count",
    ("explorer.count=2",),
)
_TWO_EXPLORERS = Exception_(
    "multi_explorer.yaml runs explorer.count: 2, which only multi_explorer does (the explorer section's)",
    "explorer.count",
    ("explorer.count=1",),
)


def exception(config: str, union: str, variant: str) -> Exception_ | None:
    """Why `set <union>.<key>=<variant>` alone does not validate from `config`, or None: it does."""
    registered = variant == REGISTERED.get(union)
    if union == "algorithm.loss" and (variant in ("kimi", "python") or registered):
        return _CLIP_HIGHER
    if union == "algorithm.advantage" and config.startswith("smollm2") and (variant == "python" or registered):
        return _BATCH_STD
    if union == "synchronizer" and config in ("fully_async.yaml", "multi_explorer.yaml"):
        if variant in ("synchronous", "one_step_off_policy"):
            both = _STALENESS.fix + _TWO_EXPLORERS.fix if config == "multi_explorer.yaml" else _STALENESS.fix
            return Exception_(_STALENESS.why, _STALENESS.names, both)
        if variant == "fully_async" and config == "multi_explorer.yaml":
            return _TWO_EXPLORERS
    if union == "synchronizer" and variant == "multi_explorer" and config != "multi_explorer.yaml":
        return _ONE_EXPLORER
    if union == "taskset.workflow" and config == "partial.yaml" and variant != "single_turn":
        return _PARTIAL
    return None


def variants(union: str) -> list[str]:
    u = UNIONS[union]
    return sorted(u.members) + ([REGISTERED[union]] if u.other is not None else [])


CASES = [(c, union, v) for c in CONFIGS for union in UNIONS for v in variants(union)]


@pytest.fixture(scope="module", autouse=True)
def my_plugin(tmp_path_factory):
    """The README's plugin importable (its registered names are what `plugins=[my_plugin]` brings);
    the registries as they were afterwards (later tests list the registered names)."""
    registries = (ESTIMATORS, LOSSES, REWARDS, WORKFLOWS, TASKS)
    saved = [(dict(r._paths), dict(r._objects)) for r in registries]
    where = str(tmp_path_factory.mktemp("plugin"))
    write_readme_plugin(Path(where))
    sys.path.insert(0, where)
    had = sys.modules.pop("my_plugin", None)
    yield
    sys.path.remove(where)
    sys.modules.pop("my_plugin", None)
    if had is not None:
        sys.modules["my_plugin"] = had
    for r, (paths, objects) in zip(registries, saved, strict=True):
        r._paths, r._objects = paths, objects


def switch(union: str, variant: str) -> list[str]:
    """The `set` list that switches `union` to `variant`: its key, and what the variant needs besides."""
    u = UNIONS[union]
    model = u.member(variant)
    plugins = ["plugins=[my_plugin]"] if model is u.other else []
    required = [
        f"{union}.{name}={REQUIRED[name]}"
        for name, f in model.model_fields.items()
        if (f.is_required() or name in NEEDED.get(variant, ())) and name != u.key
    ]
    return [*plugins, f"{union}.{u.key}={variant}", *required]


def section(data: Any, union: str) -> Any:
    for part in union.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def test_the_unions_are_found_in_the_models():
    assert {path: u.key for path, u in UNIONS.items()} == EXPECTED_UNIONS
    assert set(REGISTERED) == {path for path, u in UNIONS.items() if u.other is not None}
    assert set(ITEM) == {path for path in UNIONS if ".0" in path}


@pytest.mark.parametrize("config,union,variant", CASES, ids=["-".join(c) for c in CASES])
def test_set_the_key_of_a_union_alone_validates(config, union, variant):
    from flows.common import with_overrides

    path = REPO / "configs" / config
    item, sets = ITEM.get(union, []), switch(union, variant)
    source = load_config(path, item)
    why = exception(config, union, variant)
    if why is not None:
        for refused in (lambda: load_config(path, item + sets), lambda: with_overrides(source, sets)):
            with pytest.raises(ConfigError) as e:
                refused()
            assert why.names in str(e.value), (why.why, str(e.value))
        sets = [*why.fix, *sets]

    on_file = load_config(path, item + sets)  # `rft validate FILE --set ...`
    on_dump = with_overrides(source, sets)  # a deployment's cfg (every field given) with a flow run's `set`
    assert on_file == on_dump
    # A deployment made from it passes the server's check of its parameters (REST, the UI's form).
    server_accepts(synchronous, {"cfg": on_dump.model_dump(mode="json"), "set": sets})
    got, before = section(on_file.model_dump(mode="json"), union), section(source.model_dump(mode="json"), union)
    u = UNIONS[union]
    assert got[u.key] == variant
    # From the new variant's defaults: every other field holds its default, a value the same list
    # set, or the source's own choice for a field both variants have.
    defaults = variant_defaults(u.member(variant), u.key, variant)
    listed = {s.split("=", 1)[0].removeprefix(f"{union}.") for s in sets}
    for name, value in got.items():
        if name != u.key and value != defaults.get(name) and name not in listed:
            assert name in before and before[name] == value, (name, value, before)


def test_a_choice_the_new_variant_has_no_field_for_is_refused_naming_it():
    data = read_yaml(REPO / "configs" / "demo.yaml")
    with pytest.raises(ConfigError) as e:
        apply_overrides(data, ["placement.devices={trainer: [0], explorers: [[1]]}", "placement.type=deployments"])
    msg = str(e.value)
    assert "placement.devices = {'trainer': [0], 'explorers': [[1]]} was given for type 'local'" in msg
    assert "type 'deployments' has no devices" in msg and "--set 'placement={type: deployments}'" in msg


def test_a_field_both_variants_have_is_kept_when_chosen_and_reset_when_not():
    raw = {"model": {"path": "/m"}, "taskset": {"path": "/t"}}
    # ppo_clip's default 0.2 stands for no choice: gspo's 3e-4 applies; 0.28 is a choice: kept.
    loss = validate_config(
        apply_overrides(
            {**raw, "algorithm": {"loss": {"type": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28}}},
            ["algorithm.loss.type=gspo"],
        )
    ).algorithm.loss
    assert (loss.type, loss.clip_eps_low, loss.clip_eps_high) == ("gspo", 3e-4, 0.28)
    # The same value set by an override before the switch is a choice, whatever its value.
    loss = validate_config(
        apply_overrides(dict(raw), ["algorithm.loss.clip_eps_low=0.2", "algorithm.loss.type=gspo"])
    ).algorithm.loss
    assert (loss.clip_eps_low, loss.clip_eps_high) == (0.2, 4e-4)
    # A preset's value stands for no choice either: dapo's clip_eps_high 0.28 does not follow into gspo.
    dapo = validate_config({**raw, "algorithm": {"preset": "dapo"}}).model_dump(mode="json")
    loss = validate_config(apply_overrides(dapo, ["algorithm.loss.type=gspo"])).algorithm.loss
    assert (loss.clip_eps_low, loss.clip_eps_high) == (3e-4, 4e-4)
    # one_step_off_policy's own default offset is 1; back to synchronous it is 0 again.
    sync = validate_config(apply_overrides(dict(raw), ["synchronizer.mode=one_step_off_policy"])).synchronizer
    assert sync.sync_offset == 1
    back = apply_overrides(validate_config({**raw, "synchronizer": sync.model_dump()}).model_dump(mode="json"), [])
    assert validate_config(apply_overrides(back, ["synchronizer.mode=synchronous"])).synchronizer.sync_offset == 0


def test_an_unknown_variant_is_named_by_validation_not_by_the_switch():
    data = read_yaml(REPO / "configs" / "demo.yaml")
    with pytest.raises(ConfigError) as e:
        validate_config(apply_overrides(data, ["algorithm.loss.type=ppo_clp"]), "demo.yaml")
    assert "algorithm.loss.type = 'ppo_clp': no loss of that name; registered: " in str(e.value)


def test_a_list_item_by_index():
    raw = {"model": {"path": "/m"}, "taskset": {"path": "/t"}, "monitor": {"trackers": ["tensorboard", "mlflow"]}}
    cfg = validate_config(apply_overrides(raw, ["monitor.trackers.1.experiment=x", "monitor.trackers.0.type=wandb"]))
    assert [t.type for t in cfg.monitor.trackers] == ["wandb", "mlflow"] and cfg.monitor.trackers[1].experiment == "x"
    with pytest.raises(
        ConfigError, match=r"'monitor.trackers' is a list of 2 item\(s\): name an item by its index \(0..1\)"
    ):
        apply_overrides(raw, ["monitor.trackers.2.type=wandb"])
    with pytest.raises(ConfigError, match=r"'monitor.trackers' is a list of 2 item\(s\)"):
        apply_overrides(raw, ["monitor.trackers.first.type=wandb"])


# One case per union kind through the CLI, as a user types it: `rft validate FILE --set ...`.
CLI = {
    "placement": "deployments",
    "synchronizer": "fully_async",
    "algorithm.advantage": "rloo",
    "algorithm.loss": "gspo",
    "taskset.reward": "countdown",
    "taskset.workflow": "calculator",
    "eval.tasksets.0.reward": "final_answer",
    "monitor.trackers.0": "wandb",
}


@pytest.mark.parametrize("union", sorted(CLI))
def test_rft_validate_with_set_switches_each_union(union, tiny_model_dir, capsys):
    assert set(CLI) == set(UNIONS)
    path = str(REPO / "configs" / "demo.yaml")
    sets = [f"model.path={tiny_model_dir}", *ITEM.get(union, []), *switch(union, CLI[union])]
    assert rft(["validate", path, *(a for s in sets for a in ("--set", s)), "--print"]) == 0
    printed = capsys.readouterr().out
    assert (
        section(RFTConfig.model_validate(yaml.safe_load(printed)).model_dump(), union)[UNIONS[union].key] == CLI[union]
    )


def test_rft_validate_refuses_a_dropped_choice_naming_it(capsys):
    path = str(REPO / "configs" / "fully_async.yaml")
    assert rft(["validate", path, "--set", "synchronizer.mode=synchronous"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set 'synchronizer.mode=synchronous': synchronizer.max_staleness = 4 was given")
    assert "--set synchronizer.max_staleness=null before the switch" in err and "Traceback" not in err
