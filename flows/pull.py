"""The deployments' pull step (prefect.yaml `pull`), run by a worker's flow-run process before the flow.

It makes the checkout that the worker's Python environment has the project installed from (`make
setup` installs it editable) the run's working directory, where relative config paths (`runs/...`)
resolve as with `rft run`. It is found at run time, on the worker, so nothing depends on where
`prefect deploy` ran; one step, so the worker's terminal gets four lines of it per flow run.
"""

from __future__ import annotations

import os
from pathlib import Path


def enter_checkout() -> dict[str, str]:
    """chdir into the checkout this module lives in; its path as the step's output `directory`."""
    directory = str(Path(__file__).resolve().parents[1])
    os.chdir(directory)
    return {"directory": directory}
