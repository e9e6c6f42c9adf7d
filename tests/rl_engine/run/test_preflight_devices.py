"""rl_engine.run.devices and preflight.check_devices: the device plan of every placement for 0, 1,
2, 4 and 8 visible GPUs (the count stubbed: no GPU needed), and what NCCL or vLLM would refuse
refused before any engine starts, naming the field and the fix.

    .venv/bin/python -m pytest tests/rl_engine/run/test_preflight_devices.py
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from rl_engine.config import ConfigError, RFTConfig, validate_config
from rl_engine.errors import UserError
from rl_engine.run.devices import (
    PLAN_FILE,
    DevicePlan,
    check_plan,
    cuda_visible,
    device_plan,
    record_plan,
)
from rl_engine.run.preflight import check_devices

MODES = ("synchronous", "one_step_off_policy", "fully_async", "multi_explorer")


def _cfg(
    sync_method: str = "collective",
    num_ranks: int = 1,
    placement: str | dict = "local",
    mode: str = "synchronous",
    count: int | None = None,
    tp: int = 1,
    nodes: int = 1,
) -> RFTConfig:
    count = count or (2 if mode == "multi_explorer" else 1)
    return RFTConfig.model_validate(
        {
            "model": {"path": "m"},
            "taskset": {"path": "t.jsonl"},
            "explorer": {"batch_size": 4, "count": count, "engine": {"tensor_parallel_size": tp}},
            "trainer": {
                "micro_batch_size": 1,
                "num_ranks": num_ranks,
                "nodes": nodes,
                **({"rendezvous": "node0:29400"} if nodes > 1 else {}),
            },
            "synchronizer": {
                "mode": mode,
                "sync_method": sync_method,
                **({"sync_offset": 1} if mode == "one_step_off_policy" else {}),
            },
            "placement": {"type": placement} if isinstance(placement, str) else placement,
        }
    )


# --------------------------------------------------------------------------- plans


@pytest.mark.parametrize("visible", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_local_split_trainer_first_explorers_after(visible, mode):
    cfg = _cfg("checkpoint", mode=mode)
    plan = device_plan(cfg, visible)
    n = cfg.explorer.count
    if visible == 0:
        assert (plan.trainer, plan.explorers, plan.source) == (None, [None] * n, "cpu")
        assert (plan.trainer_env(), plan.trainer_device(), plan.engine_visible(0)) == (
            {},
            None,
            None,
        )  # CPU: nothing set
    elif visible == 1:
        assert (plan.trainer, plan.explorers) == ([0], [[0]] * n)  # colocated: checkpoint sync only
    elif visible == 2:
        assert (plan.trainer, plan.explorers) == ([0], [[1]] * n)  # two explorers share the second GPU
    else:
        assert (plan.trainer, plan.explorers) == ([0], [[1 + i] for i in range(n)])
    check_plan(plan, "checkpoint")  # every one runs with checkpoint sync
    assert plan.describe().startswith("devices")


@pytest.mark.parametrize(
    "visible, ranks, count, tp, trainer, explorers",
    [
        (8, 4, 4, 1, [0, 1, 2, 3], [[4], [5], [6], [7]]),  # README's worked 8-GPU config
        (8, 2, 3, 2, [0, 1], [[2, 3], [4, 5], [6, 7]]),
        (8, 1, 2, 4, [0], [[1, 2, 3, 4], [5, 6, 7, 1]]),  # the rest holds one engine and a half: wraps
        (4, 2, 2, 1, [0, 1], [[2], [3]]),
        (4, 1, 1, 4, [0], [[0, 1, 2, 3]]),  # the rest is too small for one engine: all devices
        (2, 2, 1, 1, [0, 1], [[0]]),
        (2, 1, 1, 2, [0], [[0, 1]]),
    ],
)
def test_local_split_with_ranks_and_tensor_parallel(visible, ranks, count, tp, trainer, explorers):
    plan = device_plan(
        _cfg("checkpoint", num_ranks=ranks, mode="multi_explorer" if count > 1 else "synchronous", count=count, tp=tp),
        visible,
    )
    assert (plan.trainer, plan.explorers, plan.trainer_ranks, plan.tensor_parallel_size) == (
        trainer,
        explorers,
        ranks,
        tp,
    )


def test_the_plan_is_what_the_roles_apply(monkeypatch):
    """torchrun gets the trainer's devices, a trainer alone in its process its index, each engine
    its own CUDA_VISIBLE_DEVICES: mapped through this process's own CUDA_VISIBLE_DEVICES."""
    plan = device_plan(_cfg(num_ranks=4, mode="multi_explorer", count=4), 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert plan.trainer_env() == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert [plan.engine_visible(i) for i in range(4)] == ["4", "5", "6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")  # this process sees a permutation
    assert plan.trainer_env() == {"CUDA_VISIBLE_DEVICES": "7,6,5,4"} and plan.engine_visible(0) == "3"
    assert cuda_visible([0, 2]) == "7,5"
    one = device_plan(_cfg(), 2)
    assert (one.trainer_device(), one.engine_visible(0)) == (
        0,
        "6",
    )  # in-process trainer on index 0; the engine on this process's device 1
    split = device_plan(_cfg(placement={"type": "local", "devices": {"trainer": [1], "explorers": [[0]]}}), 2)
    assert (split.trainer_device(), split.source) == (1, "placement.devices")


def test_devices_per_role_from_placement(tmp_path):
    cfg = _cfg(
        num_ranks=2,
        mode="multi_explorer",
        count=2,
        placement={"type": "local", "devices": {"trainer": [6, 7], "explorers": [[0], [3]]}},
    )
    plan = device_plan(cfg, 8)
    assert (plan.trainer, plan.explorers) == ([6, 7], [[0], [3]])
    check_plan(plan, "collective")
    assert "unused: GPU 1,2,4,5" in plan.describe()
    assert device_plan(cfg, 0).source == "cpu"  # a GPU config validated on a laptop: every role on the CPU
    with pytest.raises(
        UserError, match=r"placement.devices.trainer names GPU 7, but this machine shows 4 GPU\(s\) \(0..3\)"
    ):
        device_plan(cfg, 4)


@pytest.mark.parametrize(
    "devices, error",
    [
        (
            {"trainer": [0, 1], "explorers": [[2]]},
            r"placement.devices.trainer lists 2 device\(s\) for the trainer's 1 rank\(s\).*one device per rank",
        ),
        (
            {"trainer": [0], "explorers": [[1], [2]]},
            r"placement.devices.explorers lists 2 engine\(s\) for explorer.count = 1",
        ),
        (
            {"trainer": [0], "explorers": [[1, 2]]},
            r"placement.devices.explorers\[0\] lists 2 device\(s\), explorer.engine.tensor_parallel_size = 1",
        ),
        ({"trainer": [-1], "explorers": [[1]]}, r"device indices start at 0"),
        ({"trainer": [0], "explorers": [[1]], "gpus": 2}, r"gpus"),
    ],
)
def test_placement_devices_must_fit_the_roles(devices, error):
    with pytest.raises(ConfigError, match=error):
        validate_config(
            {"model": {"path": "m"}, "taskset": {"path": "t.jsonl"}, "placement": {"type": "local", "devices": devices}}
        )


@pytest.mark.parametrize("visible", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_deployments_take_each_roles_devices_from_its_job_variables(visible, mode):
    env = lambda v: {"env": {"CUDA_VISIBLE_DEVICES": v}}  # noqa: E731
    jv = {"trainer": env("0,1"), "explorer": env("2"), "explorer-1": env("GPU-5e2a, 3")}
    cfg = _cfg(num_ranks=2, mode=mode, placement={"type": "deployments", "job_variables": jv})
    plan = device_plan(cfg, visible)  # this machine's GPUs do not matter: each role has its worker's
    assert (plan.visible, plan.trainer) == (None, [0, 1])
    assert plan.explorers == ([[2], ["GPU-5e2a", 3]] if mode == "multi_explorer" else [[2]])
    assert (plan.trainer_env(), plan.engine_visible(0)) == ({}, None)  # the worker set them already
    check_plan(plan, "collective")
    assert "CUDA_VISIBLE_DEVICES=0,1" in plan.describe()
    bare = device_plan(_cfg(placement="deployments", mode=mode), visible)
    assert (bare.trainer, bare.explorers[0]) == (None, None) and "what its worker shows" in bare.describe()
    check_plan(bare, "collective")  # roles on other machines: nothing to compare


# --------------------------------------------------------------------------- refusals


def test_collective_sync_on_one_gpu_is_refused_with_checkpoint_as_the_fix():
    with pytest.raises(
        UserError, match=r"sync_method = collective on a single GPU.*NCCL refuses.*use sync_method: checkpoint"
    ):
        check_devices(_cfg(), gpus=1)
    check_devices(_cfg("checkpoint"), gpus=1)  # colocated: weights go through storage


def test_collective_group_sharing_a_device_is_refused():
    """The case the old test passed: 2 trainer ranks on 2 GPUs leave the engine on GPU 0, with rank 0."""
    with pytest.raises(
        UserError,
        match=r"collective puts the trainer's rank 0 and explorer 0's engine on GPU 0 \(the default split.*NCCL refuses.*use sync_method: checkpoint.*3 GPUs in all.*shows 2",
    ):
        check_devices(_cfg(num_ranks=2), gpus=2)
    check_devices(_cfg("checkpoint", num_ranks=2), gpus=2)
    # Two explorers on one device are two members of the group too.
    with pytest.raises(UserError, match=r"explorer 0's engine and explorer 1's engine on GPU 1"):
        check_devices(_cfg(mode="multi_explorer", count=2), gpus=2)
    # Given by hand.
    with pytest.raises(UserError, match=r"the trainer's rank 0 and explorer 0's engine on GPU 3 \(placement.devices\)"):
        check_devices(_cfg(placement={"type": "local", "devices": {"trainer": [3], "explorers": [[3]]}}), gpus=4)
    check_devices(_cfg(num_ranks=2, mode="multi_explorer", count=2), gpus=4)


def test_more_trainer_ranks_than_gpus_is_refused():
    with pytest.raises(
        UserError,
        match=r"trainer.num_ranks = 4 but this machine shows 2 GPU.*one rank per GPU.*lower trainer.num_ranks to at most 2",
    ):
        check_devices(_cfg("checkpoint", num_ranks=4), gpus=2)
    check_devices(_cfg("checkpoint", num_ranks=4, nodes=2), gpus=2)  # 2 ranks on this machine, 2 on the other
    with pytest.raises(UserError, match=r"placement.devices.trainer gives two trainer ranks GPU 1: NCCL refuses"):
        check_devices(
            _cfg(
                "checkpoint",
                num_ranks=2,
                placement={"type": "local", "devices": {"trainer": [1, 1], "explorers": [[0]]}},
            ),
            gpus=2,
        )
    jv = {"trainer": {"env": {"CUDA_VISIBLE_DEVICES": "0"}}}
    with pytest.raises(
        UserError,
        match=r"placement.job_variables.trainer.env.CUDA_VISIBLE_DEVICES = 0 gives the trainer 1 device\(s\) for its 2 rank\(s\)",
    ):
        check_devices(_cfg(num_ranks=2, placement={"type": "deployments", "job_variables": jv}), gpus=0)


def test_an_engine_with_fewer_devices_than_its_tensor_parallel_size_is_refused():
    with pytest.raises(
        UserError,
        match=r"tensor_parallel_size = 4, but explorer 0's engine gets 2 distinct device\(s\) \(this machine shows 2 GPU\(s\)\).*lower explorer.engine.tensor_parallel_size to 2",
    ):
        check_devices(_cfg("checkpoint", tp=4), gpus=2)
    with pytest.raises(
        UserError,
        match=r"explorer 0's engine gets 1 distinct device\(s\) \(placement.devices.explorers\[0\] gives it 2,2\)",
    ):
        check_devices(
            _cfg("checkpoint", tp=2, placement={"type": "local", "devices": {"trainer": [0], "explorers": [[2, 2]]}}),
            gpus=4,
        )
    jv = {"explorer": {"env": {"CUDA_VISIBLE_DEVICES": "1"}}}
    with pytest.raises(
        UserError, match=r"placement.job_variables.explorer-0 \(or explorer\).env.CUDA_VISIBLE_DEVICES gives it 1"
    ):
        check_devices(_cfg(tp=2, placement={"type": "deployments", "job_variables": jv}), gpus=0)


def test_what_fits_passes():
    check_devices(_cfg(num_ranks=2), gpus=0)  # CPU: gloo, any number of ranks and engines per machine
    check_devices(_cfg(), gpus=2)  # trainer on GPU 0, the engine on GPU 1
    check_devices(_cfg(num_ranks=2), gpus=3)
    check_devices(_cfg(placement="deployments"), gpus=1)  # each role's devices come from its job variables


@pytest.mark.parametrize(
    "visible, mode, method, ranks, tp",
    list(itertools.product([1, 2, 4, 8], MODES, ("collective", "checkpoint"), (1, 2, 4), (1, 2))),
)
def test_every_plan_preflight_passes_is_one_nccl_accepts(visible, mode, method, ranks, tp):
    """Over 1..8 GPUs, every mode, method, rank count and tensor parallel size: what check_plan lets
    through has one device per trainer rank, tp distinct devices per engine, indices that exist, and
    under collective sync no device shared within the group; what it refuses names a fix."""
    plan = device_plan(_cfg(method, num_ranks=ranks, mode=mode, tp=tp), visible)
    try:
        check_plan(plan, method)
    except UserError as e:
        assert any(
            fix in str(e)
            for fix in (
                "sync_method: checkpoint",
                "lower trainer.num_ranks",
                "lower explorer.engine.tensor_parallel_size",
            )
        ), e
        return
    used = plan.trainer + [d for e in plan.explorers for d in e]
    assert len(set(plan.trainer)) == ranks and all(len(set(e)) == tp for e in plan.explorers) and max(used) < visible
    if method == "collective":
        group = [plan.trainer[0]] + [d for e in plan.explorers for d in e]
        assert len(group) == len(set(group))


# --------------------------------------------------------------------------- the record and the CLI


def test_the_plan_is_recorded_as_json(tmp_path):
    import fsspec

    plan = device_plan(_cfg(num_ranks=2, mode="multi_explorer", count=2), 4)
    record_plan(fsspec.filesystem("file"), str(tmp_path), plan, attempt="a1")
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    assert (doc["attempt"], doc["trainer"], doc["explorers"], doc["visible"]) == ("a1", [0, 1], [[2], [3]], 4)
    assert DevicePlan.model_validate({k: v for k, v in doc.items() if k not in ("attempt", "summary")}) == plan
    assert doc["summary"] == plan.describe()


def test_rft_validate_print_shows_the_plan(tmp_path, monkeypatch, capsys):
    """`rft validate CONFIG --print`: the YAML on stdout, the plan of this machine's GPUs (stubbed) with the summary on stderr."""
    from cli.main import main as rft
    from rl_engine.run import preflight

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{path: {model}}}\ntaskset: {{path: t.jsonl}}\nsynchronizer: {{mode: multi_explorer, sync_method: collective}}\nexplorer: {{count: 2}}\n"
    )
    monkeypatch.setattr(preflight, "visible_gpus", lambda: 4)
    assert rft(["validate", str(cfg), "--print"]) == 0
    out, err = capsys.readouterr()
    assert (
        "placement:" in out
        and "devices (local, 4 GPU(s) visible, split): trainer rank 0 on GPU 0; explorer 0 (tensor parallel 1) on GPU 1; explorer 1 (tensor parallel 1) on GPU 2; unused: GPU 3"
        in err
    )
    monkeypatch.setattr(
        preflight, "visible_gpus", lambda: 2
    )  # the same config on 2 GPUs: the explorers would share GPU 1
    assert rft(["validate", str(cfg)]) == 2
    assert "explorer 0's engine and explorer 1's engine on GPU 1" in capsys.readouterr().err


def test_the_readmes_gpu_configs_validate_with_the_plans_it_shows(tmp_path, monkeypatch, capsys):
    """docs/guides/gpus.md: `gpu8.yaml` (4 trainer ranks, 4 explorers) on 8 GPUs gets the plan the guide
    shows, is refused on 4 (the engines would share the trainer's devices under collective sync),
    and `gpu8-two-machines.yaml` gives every role its job variables' devices."""
    import re

    import yaml

    from cli.main import main as rft
    from rl_engine.run import preflight

    readme = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "gpus.md").read_text()
    section = readme[readme.index("## On GPUs") :]
    section = section[: section.index("\n## ")]
    base, placement = (yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)[:2])
    shown = re.search(r"rft validate gpu8.yaml +# \.\.\. (.*?) \.\.\.", section).group(1)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base["model"]["path"] = str(model)
    gpu8, two = tmp_path / "gpu8.yaml", tmp_path / "gpu8-two-machines.yaml"
    gpu8.write_text(yaml.safe_dump(base))
    two.write_text(yaml.safe_dump({**base, **placement}))

    monkeypatch.setattr(preflight, "visible_gpus", lambda: 8)
    assert rft(["validate", str(gpu8)]) == 0
    out = capsys.readouterr().out
    assert shown in out and "explorer 3 (tensor parallel 1) on GPU 7" in out
    assert rft(["validate", str(two)]) == 0
    out = capsys.readouterr().out
    assert "trainer ranks 0-3 on CUDA_VISIBLE_DEVICES=0,1,2,3" in out and all(
        f"explorer {i} (tensor parallel 1) on CUDA_VISIBLE_DEVICES={i}" in out for i in range(4)
    )
    monkeypatch.setattr(preflight, "visible_gpus", lambda: 4)
    assert rft(["validate", str(gpu8)]) == 2
    assert "the trainer's rank 0 and explorer 0's engine on GPU 0" in capsys.readouterr().err
