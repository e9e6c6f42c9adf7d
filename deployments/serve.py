"""Serve every mode's flow as a Prefect deployment from this process (no work pool needed).

    python -m deployments.serve configs/demo.yaml [--cron "0 3 * * *"]

Each deployment takes the config as its `cfg` parameter (a form in the Prefect UI), so a run
started from the UI or the API (`prefect deployment run 'one-step-off-policy/demo' --param ...`)
can change any field. Parameters replace the deployment's defaults per top-level key, so pass
whole sections. A cron schedule retrains periodically; each scheduled run gets a fresh run name.
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":
    from prefect import serve

    from flows.decoupled import fully_async, multi_explorer
    from flows.rendezvous import one_step_off_policy, synchronous
    from rl_engine.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--name", default="default", help="deployment name")
    ap.add_argument("--cron", default=None, help="schedule for the configured mode's deployment, e.g. '0 3 * * *'")
    a = ap.parse_args()
    cfg = load_config(a.config)
    params = {"cfg": cfg.model_dump(mode="json")}
    flows = {"synchronous": synchronous, "one_step_off_policy": one_step_off_policy, "fully_async": fully_async, "multi_explorer": multi_explorer}
    serve(
        *(
            f.to_deployment(name=a.name, parameters=params, cron=a.cron if mode == cfg.synchronizer.mode else None)
            for mode, f in flows.items()
            if mode == cfg.synchronizer.mode
        )
    )
