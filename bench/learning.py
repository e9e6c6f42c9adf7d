"""Benchmark of learning per wall-clock second: the four sync modes train the same model to the same step.

    python -m bench.learning [--quick | --smoke] [--steps N] [--seeds 0,1,2] [--model DIR] [--png FILE]

--smoke (CI smoke test) is the same path at the smallest size: a warm start of 2 SFT steps, 3 trainer
steps per mode, seed 0; its figures say nothing about the modes.

Workload: the demo's task and model. The arithmetic warm start (`rft warmstart`, built here unless
--model names one: tiny Qwen2, ~0.3M parameters) trains with GRPO on `a+b=` problems; each mode runs
its shipped config (configs/<mode>.yaml: 8 tasks x 8 rollouts per step, collective sync for the
rendezvous modes, checkpoint for fully async, max_staleness 4 in the decoupled ones, 2 explorers in
multi-explorer) as a real Prefect flow, with the same seed, task file and number of trainer steps.
The explorer's vLLM engine and the DeepSpeed trainer get one core each (two cores in all, so
multi-explorer's second explorer shares a core), which puts rollout and train time per step in the
same order (R ~ T, printed below).

Per run: wall time of the training itself (first step's start to the last trainer step's end; engine
start-up is reported apart, as `startup_s`, since a warm engine skips it, and the explorers' vLLM
engine start within it as `engine_start_s` (the longest explorer's; ~0 on an engine kept warm); `step_s_median`, the median
time between two trainer steps' ends, is what a step costs once running), trainer and explorer busy
fractions over that window, the experiences generated / trained / dropped as stale / left untrained
(`wasted_fraction` = generated but never trained), and the final reward on a held-out evaluation: the
trained policy's expected exact-answer rate at temperature 1 over all 441 problems (exact, no sampling
noise: `rl_engine.demos.warmstart.evaluate_dir`, as `make demo` prints); the rows also carry the
algorithm's per-step trainer metrics that bench.algorithms compares presets by. Over seeds: mean and spread
(max - min). `speedup_vs_sync` = synchronous wall / mode wall at equal steps; `reward_within_spread`
says whether the mode's mean final reward lies within synchronous' seed range widened by the mode's
own spread (the "same quality" check). The PNG draws each mode's batch reward against wall-clock
seconds (seed 0), the figure a user picks a mode by; it is written to --png (default
`runs/bench-learning.png`; docs/concepts/modes.md shows a copy, docs/bench-learning.png).

The synchronous step against its floor (bench.step_floor's `step_floor`, after the runs, on the synchronous run of the
first seed): `step_floor_s` = `floor_generate_s` (vLLM's own generate of the run's typical step on its
warm engine) + `floor_train_s` (the faster of a plain torch step, `reference_step_s`, and the
DeepSpeed trainer's step, `trainer_step_s`, on the run's typical batch at its trainer threads)
+ `floor_reload_s` (the engine's in-place reload of the weights), each measured alone here;
`sync_step_over_floor` is the synchronous `step_s_median` over the floor. A synchronous step runs
the three one after another, so no synchronous step on this machine is shorter than their sum
(2-core dev machine, --quick: 0.085 s = 0.041 + 0.033 + 0.011, the train part then the plain
torch step's, against a step of 0.12 s).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import mean, median

from bench._report import scratch_dir

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODES = ("synchronous", "one_step_off_policy", "fully_async", "multi_explorer")
SMOKE_WARMSTART_STEPS = 2  # each step below 20 is evaluated: 2 steps, 3 evaluations (10 took 11)
# Trainer metrics of the algorithm (per-step means in each row): PPO clip, and the decoupled correction's
# clamped / masked importance weights (proximal policy vs the explorer's behavior logprobs).
ALGORITHM_METRICS = ("clip_frac", "offpolicy_clamped_frac", "offpolicy_masked_frac")


def run_one(
    mode: str,
    model: str,
    tasks: str,
    root: str,
    steps: int,
    seed: int,
    algorithm: dict | None = None,
    evaluation: dict | None = None,
) -> dict:
    """One real flow run of configs/<mode>.yaml; its wall time, busy fractions, accounting and final reward.

    `algorithm` is merged into the config's `algorithm` section; with a `preset` in it, the shipped
    knobs other than repeat_times are dropped first, since explicit knobs override a preset's.
    Besides the per-step means of the algorithm metrics (trainer metrics; 0.0 where a step has none)
    the row says the run's own staleness bound (`staleness_bound`, from its stored config).
    """
    import yaml

    from bench.modes import busy_fraction
    from cli.run import run_config
    from rl_engine.config import validate_config
    from rl_engine.demos.warmstart import evaluate_dir
    from rl_engine.run.context import open_run
    from rl_engine.run.report import load_metrics
    from rl_engine.run.timeline import load_spans, startup_end

    data = yaml.safe_load((CONFIGS / f"{mode}.yaml").read_text())
    data.update(seed=seed, name=f"bench-learning-{mode}-s{seed}")
    data["model"]["path"], data["taskset"]["path"] = model, tasks
    data["buffer"] = {"storage": {"url": root}}
    data["explorer"]["engine"].update(num_threads=1, kv_cache_space_gib=0.25)
    data["trainer"].update(total_steps=steps, checkpoint_interval=steps, num_threads=1)
    if algorithm:
        shipped = {"repeat_times": data["algorithm"]["repeat_times"]} if "preset" in algorithm else data["algorithm"]
        data["algorithm"] = {**shipped, **algorithm}
    if evaluation:
        k = data["synchronizer"].get("sync_interval", 1)  # explorers hold every k-th version only (collective sync)
        data["eval"] = {**evaluation, "every_versions": -(-evaluation["every_versions"] // k) * k}
    summary = run_config(validate_config(data))
    spans = load_spans(summary["run"])
    t0 = startup_end(spans)  # the last engine up: the training proper starts here
    train = sorted((s for s in spans if s.component == "trainer" and s.kind == "train"), key=lambda s: s.end)
    t1 = train[-1].end
    window = [s for s in spans if s.start >= t0 and s.end <= t1]
    explorers = sorted({s.component for s in spans if s.component.startswith("explorer-")})
    run = open_run(summary["run"])
    trainer_metrics, _ = load_metrics(run)
    ends = {s.step: s.end for s in train}
    x = summary["experiences"]
    final = evaluate_dir(f"{summary['run']}/model")
    return {
        "mode": mode,
        "seed": seed,
        "run": summary["run"],
        "wall_s": t1 - t0,
        "startup_s": t0 - min(s.start for s in spans),
        "engine_start_s": max(
            (s.duration for s in spans if s.kind == "engine_start" and s.component in explorers), default=0.0
        ),
        "step_s_median": median(b.end - a.end for a, b in itertools.pairwise(train))
        if len(train) > 1
        else train[-1].end - t0,
        "R_s": mean(s.duration for s in window if s.kind == "rollout")
        if any(s.kind == "rollout" for s in window)
        else 0.0,
        "T_s": mean(s.duration for s in train),
        "trainer_busy": busy_fraction(window, "trainer", t0, t1),
        "explorer_busy": mean(busy_fraction(window, e, t0, t1) for e in explorers),
        "generated": x["generated"],
        "trained": x["trained"],
        "dropped_stale": x["dropped_stale"],
        "untrained": x["untrained"],
        "wasted_fraction": x["wasted_fraction"],
        "max_staleness": summary["max_staleness_seen"],
        "final_reward": final["expected_exact_t1"],
        "final_greedy": final["greedy_exact"],
        "staleness_bound": getattr(run.cfg.synchronizer, "max_staleness", None),
        **{k: mean(m.get(k, 0.0) for m in trainer_metrics) for k in ALGORITHM_METRICS},
        "filtered_experiences": float(sum(m.get("filtered_experiences", 0.0) for m in trainer_metrics)),
        "curve": [(ends[m["step"]] - t0, m["reward_mean"]) for m in trainer_metrics if m["step"] in ends],
        **(_evaluation_figures(run, spans, t0, t1) if evaluation else {}),
    }


def _evaluation_figures(run, spans: list, t0: float, t1: float) -> dict:
    """What the run's held-out evaluations cost and found: `eval_s` (explorer 0's eval spans),
    `eval_overhead_fraction` (their share of the training window's wall time: while it evaluates,
    explorer 0 generates nothing), and the held-out pass@1 by version."""
    from rl_engine.run.report import load_evaluations

    evals = [s for s in spans if s.kind == "eval"]
    inside = sum(min(s.end, t1) - max(s.start, t0) for s in evals if s.end > t0 and s.start < t1)
    records = load_evaluations(run)
    curve = [(r["version"], r["heldout/pass@1"]) for r in records]
    return {
        "eval_s": round(sum(s.duration for s in evals), 2),
        "eval_overhead_fraction": round(inside / (t1 - t0), 4),
        "evaluations": len(records),
        "heldout_pass1_final": curve[-1][1] if curve else None,
        "eval_curve": curve,
    }


def demo_workload(prefix: str, model: str | None, smoke: bool) -> tuple[str, str, str, dict]:
    """The demo task, set up once for many runs: (root, model, tasks, start). A fresh temporary
    root; the arithmetic warm start built there unless `model` names one (2 SFT steps when
    `smoke`); the task file; the start model's held-out evaluation."""
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.demos.warmstart import evaluate_dir
    from rl_engine.demos.warmstart import main as warmstart

    root = scratch_dir(prefix)
    if model is None:
        model = f"{root}/tiny-arith-sft"
        warmstart([model] + (["--steps", str(SMOKE_WARMSTART_STEPS)] if smoke else []))
    start = evaluate_dir(model)
    tasks = f"{root}/arith-train.jsonl"
    write_arithmetic_taskset(tasks, n=2000, seed=1)
    return root, model, tasks, start


HELDOUT = {"tasks": 100, "n": 4}  # the evaluation's default size: 100 problems x 4 samples at temperature 1


def heldout_eval(root: str, every: int, tasks: int = HELDOUT["tasks"], n: int = HELDOUT["n"]) -> dict:
    """The `eval` section of the runs: a held-out file of the demo task (its own seed; the task
    space is 441 problems, so train and held-out share problems: it measures the policy, not
    generalisation), scored every `every` versions, at the start and the end."""
    from rl_engine.demos.arithmetic import write_arithmetic_taskset

    path = f"{root}/arith-heldout.jsonl"
    write_arithmetic_taskset(path, n=tasks, seed=99)
    return {"tasksets": [{"name": "heldout", "path": path, "n": n}], "every_versions": every}


@contextmanager
def shared_engines() -> Iterator[None]:
    """The runs inside share warm engines (start-up is not what is compared) and one Prefect test
    server; the engines are closed at the end."""
    from prefect.testing.utilities import prefect_test_harness

    from rl_engine.roles.explorer import ENGINES

    os.environ["RFT_KEEP_ENGINES"] = "1"
    with prefect_test_harness(server_startup_timeout=120):
        yield
    ENGINES.close_all()  # their shutdown logs would follow the JSON line


def plot(rows: list[dict], path: str, title: str) -> None:
    """Batch reward against wall-clock seconds, one line per mode (the lowest seed of each); with
    evaluations, the held-out pass@1 by trainer version beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = any(r.get("eval_curve") for r in rows)
    fig, axes = plt.subplots(1, 2 if evaluated else 1, figsize=(12 if evaluated else 7, 4), dpi=110, squeeze=False)
    ax = axes[0][0]
    for mode in MODES:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["seed"])
        if mine:
            xs, ys = zip(*mine[0]["curve"])
            w = 8  # a trailing mean over 8 steps: one batch's reward is noisy
            smooth = [mean(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, label=f"{mode} ({mine[0]['wall_s']:.0f} s)")
            if evaluated and mine[0].get("eval_curve"):
                vs, ps = zip(*mine[0]["eval_curve"])
                axes[0][1].plot(vs, ps, marker="o", label=mode)
    ax.set_xlabel("wall-clock seconds since the engines were up")
    ax.set_ylabel("batch reward (trailing mean of 8 steps)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if evaluated:
        ax2 = axes[0][1]
        ax2.set_xlabel("trainer version")
        ax2.set_ylabel("held-out pass@1")
        ax2.set_title("held-out evaluation (explorer 0, exactly that version)", fontsize=9)
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def within_spread(rewards: list[float], reference: list[float]) -> bool:
    """The "same quality" check: the mean of `rewards` (over seeds) lies within the range of
    `reference` widened on both sides by the spread (max - min) of `rewards` itself."""
    slack = max(rewards) - min(rewards)
    return min(reference) - slack <= mean(rewards) <= max(reference) + slack


def summarize(rows: list[dict]) -> dict:
    """The JSON line: per mode means and spreads over seeds, speedups against synchronous."""
    by = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    wall = {m: mean(r["wall_s"] for r in rs) for m, rs in by.items()}
    reward = {m: [r["final_reward"] for r in rs] for m, rs in by.items()}
    return {
        "seeds": sorted({r["seed"] for r in rows}),
        "wall_s": {m: round(w, 2) for m, w in wall.items()},
        "step_s_median": {m: round(median(r["step_s_median"] for r in rs), 4) for m, rs in by.items()},
        "startup_s": {m: round(median(r["startup_s"] for r in rs), 2) for m, rs in by.items()},
        "engine_start_s": {m: round(median(r["engine_start_s"] for r in rs), 2) for m, rs in by.items()},
        "speedup_vs_sync": {m: round(wall["synchronous"] / w, 3) for m, w in wall.items()},
        "final_reward": {m: round(mean(v), 4) for m, v in reward.items()},
        "final_reward_spread": {m: round(max(v) - min(v), 4) for m, v in reward.items()},
        "reward_within_spread": {m: within_spread(reward[m], reward["synchronous"]) for m in MODES},
        "wasted_fraction": {m: round(mean(r["wasted_fraction"] for r in rs), 4) for m, rs in by.items()},
        "trainer_busy": {m: round(mean(r["trainer_busy"] for r in rs), 3) for m, rs in by.items()},
        "explorer_busy": {m: round(mean(r["explorer_busy"] for r in rs), 3) for m, rs in by.items()},
        **(
            {
                "eval_overhead_fraction": {
                    m: round(mean(r["eval_overhead_fraction"] for r in rs), 4) for m, rs in by.items()
                },
                "heldout_pass1_final": {
                    m: round(mean(r["heldout_pass1_final"] for r in rs), 4) for m, rs in by.items()
                },
            }
            if all("eval_overhead_fraction" in r for r in rows)
            else {}
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI size: 2 seeds, 12 trainer steps")
    size.add_argument(
        "--smoke", action="store_true", help="CI smoke test: 1 seed, 3 trainer steps, a 2-step warm start"
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="trainer steps per run (default 60, 12 with --quick, 3 with --smoke)"
    )
    ap.add_argument(
        "--seeds", default=None, help="comma-separated run seeds (default 0,1,2; 0,1 with --quick; 0 with --smoke)"
    )
    ap.add_argument(
        "--model", default=None, help="an arithmetic warm start to use (default: build one, `rft warmstart`, seed 0)"
    )
    ap.add_argument("--png", default="runs/bench-learning.png", help="where to write the reward / wall-clock figure")
    ap.add_argument(
        "--eval-every", type=int, default=5, help="held-out evaluation every N trainer versions (0: none; default 5)"
    )
    ap.add_argument(
        "--eval-tasks",
        type=int,
        default=HELDOUT["tasks"],
        help=f"held-out problems per evaluation (default {HELDOUT['tasks']})",
    )
    ap.add_argument(
        "--eval-n", type=int, default=HELDOUT["n"], help=f"samples per held-out problem (default {HELDOUT['n']})"
    )
    a = ap.parse_args()
    steps = a.steps or (3 if a.smoke else 12 if a.quick else 60)
    seeds = [int(s) for s in (a.seeds or ("0" if a.smoke else "0,1" if a.quick else "0,1,2")).split(",")]

    from bench._report import emit_json, print_table
    from bench.step_floor import step_floor

    root, model, tasks, start = demo_workload("bench-learning-", a.model, a.smoke)
    evaluation = heldout_eval(root, a.eval_every, a.eval_tasks, a.eval_n) if a.eval_every else None
    rows = []
    started = time.time()
    with shared_engines():
        for seed in seeds:
            for mode in MODES:
                rows.append(run_one(mode, model, tasks, f"{root}/runs", steps, seed, evaluation=evaluation))
        floor = step_floor(next(r["run"] for r in rows if r["mode"] == "synchronous"), repeats=1 if a.smoke else 5)
    title = f"bench.learning: demo task, tiny arithmetic warm start, {steps} trainer steps, seeds {seeds}"
    print_table(
        [{k: v for k, v in r.items() if k not in ("curve", "eval_curve", "run")} for r in rows],
        title=f"{title} (warm start exact@T=1 {start['expected_exact_t1']:.3f})",
    )
    sync_step = median(r["step_s_median"] for r in rows if r["mode"] == "synchronous")
    print_table(
        [{"synchronous step_s_median": sync_step, **floor}],
        title="the synchronous step against its floor on this machine (step_floor: generate + train + reload, each measured alone)",
    )
    plot(rows, a.png, title)
    out = {
        "steps": steps,
        "reward_start": round(start["expected_exact_t1"], 4),
        "png": a.png,
        "bench_s": round(time.time() - started, 1),
        **summarize(rows),
    }
    out.update(
        {k: round(v, 4) for k, v in floor.items()}, sync_step_over_floor=round(sync_step / floor["step_floor_s"], 3)
    )
    if evaluation:
        # What sets the overhead: an evaluation's samples against the samples trained between two
        # (8 tasks x 8 rollouts a step); generating one costs the same either way.
        out["eval_samples"] = a.eval_tasks * a.eval_n
        out["eval_samples_per_trained_sample"] = round(a.eval_tasks * a.eval_n / (a.eval_every * 64), 3)
    emit_json(out)


if __name__ == "__main__":
    main()
