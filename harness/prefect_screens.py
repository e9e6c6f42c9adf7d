"""The Prefect UI screenshots of docs/guides/prefect.md (docs/img/prefect-*.png), made the way that
page's steps make what they show, so that they can be made again after a change to the flows or
to Prefect:

1. `prefect server start` on a free loopback port, its home and SQLite database in a temporary
   directory (the page's first command; harness/prefect_live.py starts it as for the tests);
2. `prefect work-pool create rft-cpu --type process`, `prefect worker start --pool rft-cpu`, and
   `prefect deploy --all` from the repo root (prefect.yaml);
3. `prefect deployment run 'synchronous/synchronous' --param set='["trainer.total_steps=3"]'`:
   the demo's config (the tiny model, `make demo`'s runs/models/tiny-arith-sft and
   runs/data/arith-train.jsonl, built here if missing) for 3 steps, run by the worker;
4. headless Chromium (Debian's `chromium` package: `apt-get install chromium`) photographs the
   deployments list, the deployment's custom-run form, the finished flow run's page, and its
   summary and reward-curve artifacts, at 1400x900, with the UI's promotional content
   off (a sign-up dialog); each PNG is reduced to a 256-colour palette to stay small.

Everything started is stopped at the end (the worker's and the server's process groups).

    .venv/bin/python -m harness.prefect_screens              # writes docs/img/prefect-*.png
    .venv/bin/python -m harness.prefect_screens --out /tmp/shots
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.prefect_live import REPO, flow_run_id_from_cli, start_server, start_worker, wait_flow_run

POOL = "rft-cpu"
DEPLOYMENT = "synchronous/synchronous"
SET = '["trainer.total_steps=3"]'
WINDOW = "1400,900"
# Each screenshot: its file under docs/img and the UI page it shows, filled in per capture. The flow
# run page opens on its Logs tab whatever ?tab= says (its Artifacts tab is hidden until the run has
# loaded), and the Artifacts list draws no card in headless Chromium: two of the run's artifacts
# are shown on their own pages instead.
SHOTS = {
    "prefect-deployments.png": "/deployments",
    "prefect-run-form.png": "/deployments/deployment/{deployment}/run",
    "prefect-flow-run.png": "/runs/flow-run/{flow_run}",
    "prefect-summary-artifact.png": "/artifacts/artifact/{summary}",
    "prefect-reward-curve-artifact.png": "/artifacts/artifact/{curve}",
}
# The UI is a single-page app: Chromium's virtual time lets its scripts fetch and draw before the shot.
RENDER_BUDGET_MS = "20000"


def screenshot(url: str, path: Path, timeout_s: float = 120) -> None:
    """One headless Chromium screenshot of `url`, reduced to a 256-colour PNG at `path`."""
    from PIL import Image

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH: `apt-get install chromium` (Debian's package)")
    raw = path.with_suffix(".raw.png")
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # as root, Chromium refuses to start with its sandbox
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={WINDOW}",
            f"--virtual-time-budget={RENDER_BUDGET_MS}",
            f"--screenshot={raw}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=timeout_s,
    )
    Image.open(raw).convert("RGB").quantize(colors=256).save(path, optimize=True)
    raw.unlink()


def capture(out: Path) -> dict[str, Path]:
    """Start the server, worker and deployments, run the deployment, and take the screenshots."""
    from cli.run import demo_inputs

    demo_inputs(str(REPO / "runs"))  # the deployment's cfg reads the demo's model and tasks (prefect.yaml)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="prefect-screens-"))
    server = start_server(
        tmp / "server",
        db="sqlite",
        # The UI asks the API at this address: relative, so at the server's own port (by default
        # it asks at port 4200, the setting's, whatever port the server was started on).
        PREFECT_UI_API_URL="/api",
        # Off: the UI's "Join the Prefect Community" dialog would cover the middle of every shot.
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
    )
    worker = None
    try:
        worker = start_worker(server, POOL, tmp)
        server.cli("deploy", "--all", timeout=300)
        run = server.cli("deployment", "run", DEPLOYMENT, "--param", f"set={SET}")
        flow_run = flow_run_id_from_cli(run.stdout)
        wait_flow_run(server, flow_run, timeout_s=600, worker=worker)
        ui = server.api_url.removesuffix("/api")
        deployment = server.deployment(DEPLOYMENT)["id"]
        artifacts = server.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run]}}})
        by_key = {a["key"]: a["id"] for a in artifacts if a.get("key")}
        summary, curve = (
            next(i for k, i in by_key.items() if k.endswith(end)) for end in ("-summary", "-reward-curve")
        )
        ids = {"deployment": deployment, "flow_run": flow_run, "summary": summary, "curve": curve}
        pages = {name: ui + path.format(**ids) for name, path in SHOTS.items()}
        for name, url in pages.items():
            screenshot(url, out / name)
            print(f"{out / name}: {url} ({(out / name).stat().st_size // 1024} KB)")
        return {name: out / name for name in pages}
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.prefect_screens", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "img"), help="folder for the PNGs (default docs/img)")
    args = ap.parse_args(argv)
    capture(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
