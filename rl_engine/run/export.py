"""`rft export`: a run's trained model as a directory of its own, for transformers, vLLM or peft.

    rft export runs/my-run out/model                    # the final model: a Hugging Face directory (no peft needed)
    rft export runs/my-run out/best --version best      # the best evaluated version (eval.keep_best)
    rft export runs/my-run out/v20 --version 20         # a version whose weights the run kept (eval/version=20/)
    rft export runs/my-run out/adapter --adapter        # a LoRA run's adapter in peft's layout, on model.path

A run keeps Hugging Face directories for its final model (`<run>/model/`) and for the evaluated
versions it kept (`<run>/eval/version=<v>/model/`); version 0 is the model it started from
(`model.path`). A LoRA run's directories hold the merged model, loadable without peft, and
`adapter/` beside it (rl_engine.adapter): an export is the merged model alone, or with
`--adapter` the adapter alone, its `base_model_name_or_path` set to the run's `model.path` so
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), DIR)` finds its base.
Checkpoint sync's `checkpoints/version=<v>/` are not exported: they are sync payloads (a LoRA
run's hold the adapter only, a delta holds differences), not models. The run may be on S3 (its
credentials from the environment); DIR is a new local directory, written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

from rl_engine.adapter import CONFIG_FILE, MODEL_SUBDIR
from rl_engine.errors import UserError
from rl_engine.run.versions import saved_versions
from rl_engine.storage import download_dir, join, open_storage


def model_versions(run: Any) -> dict[int, str]:
    """{version: Hugging Face directory URL} of every version of `run` kept as a model."""
    return {v: url for v, url in saved_versions(run) if "/checkpoints/version=" not in url}


def pick_version(run: Any, version: str) -> tuple[int, str]:
    """(version, model directory URL) that `--version` (final, best, or a number) names in `run`."""
    from rl_engine.run.report import read_best

    kept = model_versions(run)
    final = max((v for v, url in kept.items() if url == f"{run.url}/model"), default=None)
    if version == "final":
        if final is None:
            raise UserError(
                f"rft export {run.url}: the run has no final model yet (<run>/model/ is written when its trainer finishes); "
                f"resume it to the end (rft run {run.url}/config.yaml --resume {run.url}), or export a kept version: {sorted(kept)}"
            )
        return final, kept[final]
    if version == "best":
        best = read_best(run)
        if best is None:
            raise UserError(
                f"rft export {run.url} --version best: the run keeps no best version (eval.keep_best is off, or nothing was evaluated yet); "
                f"export one of the kept versions instead: {sorted(kept)}"
            )
        return int(best["version"]), best["model"]
    if not version.isdigit() or int(version) not in kept:
        raise UserError(
            f"rft export {run.url} --version {version}: no model of that version was kept; the run has versions {sorted(kept)} "
            "(final, best, or one of these numbers)"
        )
    return int(version), kept[int(version)]


def export(run_url: str, out_dir: str, version: str = "final", adapter: bool = False) -> dict[str, Any]:
    """Write the model (or with `adapter` the LoRA adapter) of `version` of the run at `run_url`
    to the new directory `out_dir`; returns what was written."""
    from rl_engine.run.context import open_run

    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"rft export: {out_dir} exists and is not an empty directory; give a new directory")
    run = open_run(run_url)
    v, url = pick_version(run, version)
    if adapter and run.cfg.model.lora is None:
        raise UserError(
            f"rft export {run_url} --adapter: the run trained the whole model (model.lora is null), so it has no adapter; "
            "export the model without --adapter"
        )
    if adapter and v == 0:
        raise UserError(
            f"rft export {run_url} --adapter: version 0 is the base model ({run.cfg.model.path}), trained no adapter yet"
        )
    source = join(url, MODEL_SUBDIR) if adapter else url
    fs, root = open_storage(source, run.storage_options)
    if not fs.exists(root):
        raise UserError(f"rft export {run_url}: {source} is missing (the run's files were moved or pruned)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".rft-export-", dir=parent)
    try:
        # the merged model alone, or the adapter alone
        download_dir(fs, root, tmp, skip=lambda rel: not adapter and rel.split("/", 1)[0] == MODEL_SUBDIR)
        if adapter:
            _point_at_base(os.path.join(tmp, CONFIG_FILE), run.cfg.model.path)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above): replaced whole
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"run": run.url, "version": v, "from": source, "to": out_dir, "what": "adapter" if adapter else "model"}


def _point_at_base(config_path: str, base: str) -> None:
    """The adapter's config names the run's base model (the trainer loaded it from a copy)."""
    with open(config_path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="rft export", description="Copy a run's trained model, or a LoRA run's adapter, to a new directory."
    )
    ap.add_argument("run", help="the run's directory or URL")
    ap.add_argument("out", help="a new local directory to write")
    ap.add_argument(
        "--version", default="final", help="final (default), best (eval.keep_best), or a kept version's number"
    )
    ap.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapter in peft's layout instead of the merged model",
    )
    a = ap.parse_args(argv)
    done = export(a.run, a.out, a.version, a.adapter)
    print(f"version {done['version']} of {done['run']}: {done['what']} written to {done['to']}")
    print(json.dumps(done))
    return 0
