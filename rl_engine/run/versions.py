"""A run's saved versions: where the weights of each version the run kept are (`rft eval`, `rft export`).

Version 0 is the model the run started from (`model.path`); then the weight checkpoints of
checkpoint sync that retention kept (`<run>/checkpoints/version=<v>/`, sync payloads: a LoRA run's
hold the adapter only), the evaluated versions' saved models (`<run>/eval/version=<v>/model/`) and
the final model (`<run>/model/`).
"""

from __future__ import annotations

from typing import Any

from rl_engine.storage import join


def saved_versions(run: Any) -> list[tuple[int, str]]:
    """(version, weights directory URL) of every version of `run` whose weights are there, by version."""
    from rl_engine.run.report import EVAL_COMMITTED, EVAL_DIR, load_metrics
    from rl_engine.sync.checkpoint import COMMIT

    fs, root = run.fs()
    fs.invalidate_cache()
    found: dict[int, str] = {0: run.cfg.model.path}
    for marker in fs.glob(join(root, "checkpoints", "version=*", COMMIT)):
        v = int(marker.split("version=")[1].split("/")[0])
        found[v] = f"{run.url}/checkpoints/version={v}"
    for marker in fs.glob(join(root, EVAL_DIR, "version=*", EVAL_COMMITTED)):
        v = int(marker.split("version=")[1].split("/")[0])
        found[v] = f"{run.url}/{EVAL_DIR}/version={v}/model"
    if fs.exists(join(root, "model", "config.json")):
        trainer, _ = load_metrics(run)
        found[max((m["version"] for m in trainer), default=run.cfg.trainer.total_steps)] = f"{run.url}/model"
    return sorted(found.items())
