"""`rft eval`: the held-out evaluation standalone, on a model directory or on every saved version of a run.

    rft eval runs/models/tiny-arith-sft --config configs/demo.yaml --taskset runs/data/arith-heldout.jsonl --n 4
    rft eval runs/my-run                                   # the run's eval.tasksets, every saved version
    rft eval runs/my-run --taskset heldout.jsonl --png curve.png

A run's saved versions: 0 (the model it started from), the weights kept under `<run>/eval/`
(the best version with `eval.keep_best`), the weight checkpoints of checkpoint sync
(`<run>/checkpoints/version=<v>/`, those retention kept) and the final model (`<run>/model/`).
One engine, set up as the run's explorers (the run's config.yaml, or --config for a model
directory), loads each version's weights in place and scores every set exactly as evaluation
during training does (rl_engine.roles.evaluation.score_set: the same workflow, reward,
samples and seeds). The terminal shows a line per version and set, then a final JSON line; the
engine's and libraries' output goes to a log file (`eval_output` names it first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any, TextIO

from rl_engine.errors import UserError
from rl_engine.model_dir import is_model_dir
from rl_engine.run.versions import saved_versions
from rl_engine.storage import join, local_dir, open_storage


def evaluate_versions(
    cfg: Any,
    versions: list[tuple[int, str]],
    sets: list[Any],
    storage_options: dict[str, Any] | None = None,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Score every set at every (version, weights) with one engine built on the first version's
    weights; a record per version, as evaluation during training writes them."""
    import time

    from rl_engine.roles.evaluation import eval_tasks, score_set
    from rl_engine.roles.explorer import build_user_code_pool
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.rollout.workflow import build_workflow

    data = {s.name: eval_tasks(cfg, s, storage_options) for s in sets}  # a bad set fails before any engine starts
    workflow = build_workflow(cfg.taskset.workflow)
    first = versions[0][1]
    engine = build_rollout_engine(
        cfg.model_copy(
            update={
                "model": cfg.model.model_copy(
                    update={"path": first, "tokenizer_path": cfg.model.tokenizer_path or first}
                )
            }
        )
    )
    pool = build_user_code_pool(cfg.taskset, "eval")
    out = []
    try:
        for i, (v, url) in enumerate(versions):
            if i > 0:
                with local_dir(url, storage_options) as path:
                    engine.rpc("rft_load_checkpoint", path, v)
                engine.mark_synced(v)
            started = time.time()
            results = {s.name: score_set(engine, cfg, s, data[s.name], v, workflow, pool) for s in sets}
            record = {
                "version": v,
                "weights": url,
                "seconds": time.time() - started,
                **{f"{k}/{m}": x for k, r in results.items() for m, x in r.items()},
            }
            out.append(record)
            for name, r in results.items():
                headline = "  ".join(
                    f"{m}={x:.4g}"
                    for m, x in r.items()
                    if m.startswith(("avg@", "pass@")) or m in ("reward_mean", "response_len_mean")
                )
                log(f"v{v:<5} {name:<12} {headline}")
    finally:
        if pool is not None:
            pool.close()
        engine.close()
    return out


@contextlib.contextmanager
def eval_output(target: str, storage_options: dict[str, Any] | None, run_target: bool) -> Iterator[TextIO]:
    """While the block runs, the engine's and libraries' output (vLLM, Triton, warnings) goes to a
    log file, named first on the terminal: a run's `<run>/logs/engines-eval.log` (the rft-eval
    flow's), or for a model directory `<tmp>/rft-logs/eval-<model>.log`. Yields the terminal, for
    the progress lines; an error leaving the block says where the log is."""
    import os
    import tempfile

    from rl_engine.proc.logfile import output_logged
    from rl_engine.run.logs import role_log_name, run_log

    if run_target:
        log_cm: Any = run_log(target, storage_options, role_log_name("eval"))
    else:
        path = os.path.join(tempfile.gettempdir(), "rft-logs", f"eval-{target.rstrip('/').rsplit('/', 1)[-1]}.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        log_cm = contextlib.nullcontext(path)
    with (
        log_cm as log,
        output_logged(
            log,
            f"rft eval {target}: engine and library output in {log}",
            f"rft eval: engine and library output in {log}",
        ) as term,
    ):
        yield term


def main(argv: list[str] | None = None) -> int:
    from rl_engine.config import EvalTasksetConfig, load_config
    from rl_engine.run.context import open_run

    ap = argparse.ArgumentParser(
        prog="rft eval", description="Held-out evaluation of a model directory, or of every saved version of a run."
    )
    ap.add_argument("target", help="a Hugging Face model directory, or a run's directory or URL")
    ap.add_argument(
        "--config",
        help="for a model directory: the YAML config whose explorer settings, template, workflow and reward to use",
    )
    ap.add_argument(
        "--taskset",
        action="append",
        default=[],
        metavar="PATH",
        help="held-out task file (repeatable); default: the config's eval.tasksets",
    )
    ap.add_argument("--n", type=int, default=4, help="samples per task with --taskset (default 4)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature with --taskset (default 1.0)")
    ap.add_argument("--max-tasks", type=int, default=None, help="score only the first N tasks of each --taskset")
    ap.add_argument("--png", default=None, help="write the held-out curve (pass@1 by version) to this PNG")
    a = ap.parse_args(argv)
    if is_model_dir(a.target):
        from rl_engine.run.preflight import check_model_dir

        check_model_dir(a.target, "rft eval's model directory")  # vLLM's own refusal is a traceback, seconds later
        if a.config is None:
            raise UserError(
                f"rft eval {a.target}: a model directory needs --config (the run config whose explorer settings, template and reward to use)"
            )
        cfg = load_config(a.config, [f"model.path={a.target}"])
        versions, opts = [(0, a.target)], cfg.buffer.storage.fs_options()
    else:
        fs, root = open_storage(a.target)
        if not fs.exists(join(root, "config.yaml")):
            raise UserError(
                f"rft eval {a.target}: neither a model directory (no config.json) nor a run (no config.yaml); give a model directory with --config, or a run directory"
            )
        run = open_run(a.target)
        cfg, versions, opts = run.cfg, saved_versions(run), run.storage_options
    sets = [
        EvalTasksetConfig(
            name=f"set{i}" if len(a.taskset) > 1 else "heldout",
            path=p,
            n=a.n,
            temperature=a.temperature,
            max_tasks=a.max_tasks,
        )
        for i, p in enumerate(a.taskset)
    ]
    sets = sets or cfg.eval.tasksets
    if not sets:
        raise UserError("rft eval: no task set to score: give --taskset PATH, or a config with eval.tasksets")
    with eval_output(a.target, opts, run_target=not is_model_dir(a.target)) as term:
        print(f"scoring {len(versions)} version(s) on {', '.join(s.name for s in sets)} ...", file=term, flush=True)
        records = evaluate_versions(cfg, versions, sets, opts, log=lambda line: print(line, file=term, flush=True))
    if a.png:
        from rl_engine.run.report import heldout_curve_png

        with open(a.png, "wb") as f:
            f.write(heldout_curve_png(records))
    print(json.dumps({"versions": records}))
    return 0


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
