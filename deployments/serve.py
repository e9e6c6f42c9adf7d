"""Serve a config's mode flow and the role flows as Prefect deployments from this process (no work pool).

    python -m deployments.serve configs/demo.yaml [--cron "0 3 * * *"] [--name default]

The alternative to a work pool and `prefect deploy --all` (prefect.yaml at the repo root): this
process polls the server and runs the flow runs itself. It serves four deployments:

* `<mode flow>/<name>` for the config's `synchronizer.mode`, e.g. 'one-step-off-policy/default',
  with the config as its `cfg` parameter (a form in the Prefect UI), so a run started from the UI
  or the API (`prefect deployment run 'one-step-off-policy/default' --param cfg=...`) can change
  any field. Parameters replace the deployment's defaults per top-level key, so pass whole
  sections. A cron schedule retrains periodically; each scheduled run gets a fresh run name.
* `rft-explorer/<name>`, `rft-trainer/<name>` and `rft-reward/<name>`: the roles, which a mode's
  flow run starts as flow runs of their own when its config says `placement: {type: deployments}`
  (that section's defaults name the `default` deployments; the reward role only for a run whose
  reward is `{type: model}`).
"""

from __future__ import annotations

import argparse
from typing import Any


def build_deployments(cfg: Any, name: str = "default", cron: str | None = None) -> list[Any]:
    """The RunnerDeployments to serve for `cfg` (an RFTConfig): its mode's flow and the roles."""
    from flows.decoupled import fully_async, multi_explorer
    from flows.rendezvous import one_step_off_policy, synchronous
    from flows.roles import explorer_role, reward_role, trainer_role

    modes = {
        "synchronous": synchronous,
        "one_step_off_policy": one_step_off_policy,
        "fully_async": fully_async,
        "multi_explorer": multi_explorer,
    }
    mode_flow = modes[cfg.synchronizer.mode]
    return [
        mode_flow.to_deployment(name=name, parameters={"cfg": cfg.model_dump(mode="json")}, cron=cron),
        explorer_role.to_deployment(name=name),
        trainer_role.to_deployment(name=name),
        reward_role.to_deployment(name=name),
    ]


if __name__ == "__main__":
    from prefect import serve

    from rl_engine.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument(
        "--name", default="default", help="deployment name (the roles' too; placement's defaults expect 'default')"
    )
    ap.add_argument("--cron", default=None, help="schedule for the mode's deployment, e.g. '0 3 * * *'")
    a = ap.parse_args()
    serve(*build_deployments(load_config(a.config), a.name, a.cron))
