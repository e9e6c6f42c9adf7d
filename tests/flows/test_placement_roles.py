"""flows/placement.py's choices without a server: which deployment and job variables each role
gets (the reward role's included), and when the reward role has nobody left to serve. The roles
on a real worker: tests/flows/test_placement_deployments.py."""

from __future__ import annotations

from prefect.states import Cancelled, Completed, Failed, Running

from flows.placement import _deployment, _job_variables, _nothing_left_to_serve
from rl_engine.config import DeploymentsPlacement


def test_each_role_gets_its_deployment_and_job_variables():
    p = DeploymentsPlacement(
        type="deployments",
        reward_deployment="rft-reward/gpu",
        job_variables={"explorer": {"env": {"A": "1"}}, "reward": {"env": {"CUDA_VISIBLE_DEVICES": "0"}}},
    )
    assert [_deployment(p, r) for r in ("trainer", "explorer-1", "reward")] == [
        "rft-trainer/default",
        "rft-explorer/default",
        "rft-reward/gpu",
    ]
    assert _job_variables(p, "reward") == {"env": {"CUDA_VISIBLE_DEVICES": "0"}}  # not the explorers'
    assert _job_variables(p, "explorer-1") == {"env": {"A": "1"}} and _job_variables(p, "trainer") == {}


def test_the_reward_role_is_stopped_only_once_every_role_it_serves_ended():
    ended = {"trainer": Completed(), "explorer-0": Completed(), "explorer-1": Failed()}
    assert _nothing_left_to_serve({**ended, "reward": Running()})
    assert not _nothing_left_to_serve({**ended, "explorer-1": Running(), "reward": Running()})
    assert not _nothing_left_to_serve({**ended, "reward": Cancelled()})  # ended already
    assert not _nothing_left_to_serve(ended)  # a run without a reward role
