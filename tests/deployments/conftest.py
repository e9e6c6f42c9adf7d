"""Fixtures of the live deployment tests (shared by the session): the README's work pool with a
worker polling it, and `prefect deploy --all` from the repo root, both against the session's real
Prefect server (harness/prefect_live.py)."""

from __future__ import annotations

import pytest

from harness.prefect_live import CREATE_POOL, DEPLOY_ALL, REPO, LiveServer


@pytest.fixture(scope="session")
def rft_worker(prefect_live, prefect_worker):
    """The README's pool (`prefect work-pool create rft-cpu --type process`) and a worker polling it."""
    if prefect_live.api("GET", "/work_pools/rft-cpu", ok=(200, 404)).get("name") != "rft-cpu":
        prefect_live.cli(*CREATE_POOL, timeout=60)
    return prefect_worker("rft-cpu")


@pytest.fixture(scope="session")
def deployed(prefect_live: LiveServer, rft_worker) -> dict[str, dict]:
    """`prefect deploy --all` from the repo root; {'flow-name/deployment-name': deployment}."""
    prefect_live.cli(*DEPLOY_ALL, cwd=REPO, timeout=300)
    rows = prefect_live.api("POST", "/deployments/filter", json={})
    flows = {f["id"]: f["name"] for f in prefect_live.api("POST", "/flows/filter", json={})}
    return {f"{flows[d['flow_id']]}/{d['name']}": d for d in rows}
