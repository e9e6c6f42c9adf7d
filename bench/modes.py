"""Benchmark of the four sync modes on one workload: step time, busy fractions, measured/ideal.

    python -m bench.modes [--quick | --smoke] [--synthetic] [--placements local,deployments]

--quick runs 6 trainer steps per mode instead of 12; --smoke (CI smoke test) runs 3.

Each mode runs as a real Prefect flow (ephemeral server, buffer on local disk, control board,
timeline). Without --synthetic the explorer is the vLLM engine and the trainer DeepSpeed on the
tiny model, each pinned to one core. With --synthetic both are swapped for a COST MODEL (labeled
as such in the output): rollout takes R s, train T s, a weight load S s, by sleeping; everything
else (flows, tasks, buffer writes and reads, checkpoints, waits) is the real code, so the gap to
the ideal is the orchestration overhead.

Performance model (bench/cost_model.py): ideal step time R + T + S (synchronous), max(R, T) + S
(one-step off-policy), max(R, T) (fully async), max(R / N, T) (multi-explorer, N explorers).
R, T, S are the configured costs (synthetic) or the mean measured span durations (real).
efficiency = ideal / measured step time; orchestration_overhead = (measured - ideal) / measured
of the synchronous mode, where every cost is on the critical path.

Placement axis (real workload only: the cost model patches this process): every mode runs with
`placement: local` (roles as tasks of one flow run) and `placement: deployments` (each role its
own flow run and OS process, on a real `prefect server start` and process worker started by the
benchmark). cross_process_overhead = (steady step time with deployments - with local) / local,
per mode; the table shows what a step is made of in each (rollout R, train T, sync S, the
trainer's wait for experiences) and the start-up each placement pays before the first step.

Start-up is not a step: each role's engine start (vLLM engine + first-call warm-up, DeepSpeed) is
its own `engine_start` span, outside the steady state and the busy fractions. The JSON reports
`engine_start_s` (first span -> the last engine up) and `first_step_over_steady` (explorer-0's
first rollout over the mean of its later ones: about 1 when the first step pays no warm-up).
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import mean

from bench._report import scratch_dir
from rl_engine.run.timeline import STARTUP

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODES = {
    "synchronous": {"mode": "synchronous", "sync_method": "collective"},
    "one_step_off_policy": {"mode": "one_step_off_policy", "sync_offset": 1, "sync_method": "collective"},
    "fully_async": {"mode": "fully_async", "sync_method": "checkpoint"},
    "multi_explorer": {"mode": "multi_explorer", "sync_method": "checkpoint", "count": 2},
}


def ideal_step(mode: str, r: float, t: float, s: float, n: int) -> float:
    return {
        "synchronous": r + t + s,
        "one_step_off_policy": max(r, t) + s,
        "fully_async": max(r, t),
        "multi_explorer": max(r / n, t),
    }[mode]


def steady_state(spans: list, skip: int = 1) -> tuple[float, float, float, list]:
    """(t0, t1, trainer step time, the spans within): from the end of trainer step `skip` to the end
    of the last step, so engine start-up (the engine_start spans, which end before step 1) is
    not counted."""
    train_spans = sorted((s for s in spans if s.component == "trainer" and s.kind == "train"), key=lambda s: s.start)
    t0, t1 = train_spans[skip - 1].end, train_spans[-1].end
    steady = [s for s in spans if s.start >= t0 and s.end <= t1 and s.kind != STARTUP]
    return t0, t1, (t1 - t0) / max(len(train_spans) - skip, 1), steady


def busy_fraction(steady: list, lane: str, t0: float, t1: float) -> float:
    """Share of [t0, t1] that `lane` spent on work (not waiting, not starting an engine)."""
    return sum(s.duration for s in steady if s.component == lane and s.kind not in ("wait", STARTUP)) / (t1 - t0)


def first_step_over_steady(spans: list) -> float:
    """Explorer-0's first rollout over the mean of its later ones: about 1 when engine start-up and
    first-call warm-up stay out of rollout 1 (they are its engine_start span)."""
    d = [
        s.duration
        for s in sorted(
            (s for s in spans if s.component == "explorer-0" and s.kind == "rollout"), key=lambda s: s.start
        )
    ]
    return d[0] / mean(d[1:]) if len(d) > 1 and mean(d[1:]) > 0 else float("nan")


def run_mode(
    name: str, model: str, tasks: str, root: str, steps: int, synthetic: bool, placement: str = "local"
) -> dict:
    from cli.run import run_config
    from harness.runs import small_config
    from rl_engine.config import validate_config
    from rl_engine.run.timeline import load_spans, startup_end

    spec = dict(MODES[name])
    if synthetic:
        spec["sync_method"] = "checkpoint"  # the cost model has no inference workers to join a process group
    data = small_config(
        model, tasks, root, total_steps=steps, checkpoint_interval=steps, name=f"bench-{name}-{placement}", **spec
    )
    data["placement"] = {"type": placement}
    if not synthetic:  # a workload where compute, not bookkeeping, dominates a step
        data["explorer"].update(batch_size=8, sampling={"max_tokens": 8})
        data["algorithm"]["repeat_times"] = 8
        data["trainer"]["micro_batch_size"] = 32
    data["explorer"]["engine"]["num_threads"] = 1
    data["trainer"]["num_threads"] = 1
    data["synchronizer"]["collective"].pop("port")  # the trainer picks a free one when it binds and publishes it
    cfg = validate_config(data)
    started = time.time()
    summary = run_config(cfg)
    wall = time.time() - started
    spans = load_spans(summary["run"])
    t0, t1, step_time, steady = steady_state(spans)

    def mean_of(kind: str, lane: str) -> float:
        xs = [s.duration for s in steady if s.kind == kind and s.component.startswith(lane)]
        return mean(xs) if xs else 0.0

    r, t, s = mean_of("rollout", "explorer"), mean_of("train", "trainer"), mean_of("sync", "explorer")
    ideal = ideal_step(name, r, t, s, cfg.explorer.count)
    return {
        "mode": name,
        "placement": placement,
        "step_s": step_time,
        "ideal_s": ideal,
        "efficiency": ideal / step_time if step_time > 0 else 0.0,
        "R_s": r,
        "T_s": t,
        "S_s": s,
        "explorer_busy": mean(busy_fraction(steady, f"explorer-{i}", t0, t1) for i in range(cfg.explorer.count)),
        "trainer_busy": busy_fraction(steady, "trainer", t0, t1),
        "trainer_wait_s": mean_of("wait", "trainer"),
        "startup_s": min(x.start for x in spans) - started,  # flow start -> first recorded span (the engines' start)
        "engine_start_s": startup_end(spans) - min(x.start for x in spans),  # first span -> the last engine up
        "first_step_over_steady": first_step_over_steady(spans),
        "wall_s": wall,
    }


def run_with_roles_on_a_worker(names: list[str], model: str, tasks: str, root: str, steps: int) -> list[dict]:
    """Every mode with placement `deployments`: a real Prefect server, a process worker and the
    role deployments (`prefect deploy --all`), started here and stopped afterwards."""
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from harness.prefect_live import DEPLOY_ALL, start_server, start_worker

    server = start_server(Path(root) / "prefect-live", ui=False)
    try:
        worker = start_worker(server, "rft-cpu", Path(root) / "prefect-live")
        try:
            server.cli(*DEPLOY_ALL, timeout=300)
            with temporary_settings({PREFECT_API_URL: server.api_url}):
                return [run_mode(name, model, tasks, f"{root}/runs", steps, False, "deployments") for name in names]
        finally:
            worker.stop()
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer steps")
    size.add_argument("--smoke", action="store_true", help="CI smoke test: the fewest steps that have a steady state")
    ap.add_argument(
        "--synthetic",
        action="store_true",
        help="cost model instead of vLLM/DeepSpeed (measures the orchestration alone)",
    )
    ap.add_argument("--rollout-s", type=float, default=0.6, help="synthetic rollout time R")
    ap.add_argument("--train-s", type=float, default=0.6, help="synthetic train time T")
    ap.add_argument("--sync-s", type=float, default=0.05, help="synthetic weight-load time S")
    ap.add_argument(
        "--placements",
        default=None,
        help="comma-separated: local,deployments (default: both for the real workload, local with --synthetic)",
    )
    a = ap.parse_args()
    placements = (a.placements or ("local" if a.synthetic else "local,deployments")).split(",")
    if a.synthetic and placements != ["local"]:
        ap.error("--synthetic patches this process's engine and trainer: it measures placement local only")

    from prefect.testing.utilities import prefect_test_harness

    from bench._report import emit_json, print_table
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.tiny_model import make_tiny_model

    steps = 3 if a.smoke else 6 if a.quick else 12
    root = scratch_dir("bench-modes-")
    model = str(make_tiny_model(f"{root}/model"))
    tasks = f"{root}/tasks.jsonl"
    write_arithmetic_taskset(tasks, n=500, seed=0)
    if a.synthetic:
        from bench import cost_model

        cost_model.install(a.rollout_s, a.train_s, a.sync_s)
        label = f"SYNTHETIC COST MODEL: R={a.rollout_s}s T={a.train_s}s S={a.sync_s}s (sleeps), real flows/buffer/checkpoints"
    else:
        os.environ["RFT_KEEP_ENGINES"] = "1"
        label = "real tiny model: vLLM CPU explorer(s) and DeepSpeed CPU trainer, one core each"
    rows = []
    if "local" in placements:
        with prefect_test_harness(server_startup_timeout=120):
            for name in MODES:
                rows.append(run_mode(name, model, tasks, f"{root}/runs", steps, a.synthetic))
    if "deployments" in placements:
        rows += run_with_roles_on_a_worker(list(MODES), model, tasks, root, steps)
    print_table(rows, title=f"bench.modes ({label}); {steps} trainer steps per mode")
    by = {(r["mode"], r["placement"]): r for r in rows}
    out = {"workload": "synthetic" if a.synthetic else "tiny-model", "steps": steps}
    for placement in placements:
        mine = [r for r in rows if r["placement"] == placement]
        key = "" if placement == "local" else f"_{placement}"
        out[f"efficiency{key}"] = {r["mode"]: round(r["efficiency"], 3) for r in mine}
        out[f"step_s{key}"] = {r["mode"]: round(r["step_s"], 3) for r in mine}
        out[f"first_step_over_steady{key}"] = {r["mode"]: round(r["first_step_over_steady"], 2) for r in mine}
        out[f"engine_start_s{key}"] = {r["mode"]: round(r["engine_start_s"], 1) for r in mine}
    if "local" in placements:
        sync = by[("synchronous", "local")]
        out["orchestration_overhead"] = round(max(0.0, (sync["step_s"] - sync["ideal_s"]) / sync["step_s"]), 3)
    if {"local", "deployments"} <= set(placements):
        out["cross_process_overhead"] = {
            m: round((by[(m, "deployments")]["step_s"] - by[(m, "local")]["step_s"]) / by[(m, "local")]["step_s"], 3)
            for m in MODES
        }
        out["startup_s"] = {
            f"{m}/{p}": round(by[(m, p)]["startup_s"], 1) for m in MODES for p in ("local", "deployments")
        }
    emit_json(out)


if __name__ == "__main__":
    main()
