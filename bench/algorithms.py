"""Benchmark of the algorithm presets: each preset trains the demo model synchronously and fully async (staleness 4).

    python -m bench.algorithms [--quick | --smoke] [--presets grpo,dapo] [--steps N] [--seeds 0,1,2] [--model DIR] [--png FILE]

--quick: 2 seeds, presets grpo, dapo, gspo and decoupled_ppo, 12 trainer steps. --smoke (CI smoke
test) is the same path at the smallest size: a warm start of 2 SFT steps, presets grpo and
decoupled_ppo, 2 trainer steps, seed 0; its figures say nothing about the presets.

Workload: bench.learning's (the demo's arithmetic task and tiny warm-started model, real Prefect
flows, warm engines shared by all runs, one core each for the explorer's engine and the trainer),
run by its `run_one`. Each preset (`algorithm.preset`; the shipped configs' own algorithm knobs
are dropped, all but repeat_times 8, so that the preset's settings apply) runs in `synchronous`
(configs/synchronous.yaml) and in `fully_async` (configs/fully_async.yaml, which bounds staleness
at `synchronizer.max_staleness: 4`; the run's stored config is checked to have it), with the same
seeds and number of trainer steps for all.

Per run: wall time of the training itself (after engine start-up, as bench.learning), final
held-out reward (`final_reward`: expected exact-answer rate at temperature 1 over all 441 problems,
`rl_engine.demos.warmstart.evaluate_dir`), reward gained per wall-clock second ((final - start model's) /
wall_s), the per-step means of the trainer's clip fraction (`clip_frac`) and of the off-policy
correction's clamped / masked token fractions (decoupled_ppo only; 0 where a preset has none), dapo's
experiences filtered out (zero-variance groups, summed over steps) and the largest staleness any
trained experience had. Over seeds: mean and spread (max - min).

The JSON line: `presets` {preset: {mode: reward_final, reward_spread, reward_per_s, clipped_fraction,
clamped_fraction, masked_fraction, filtered_experiences, max_staleness, wall_s}};
`stale4_plain_vs_sync` = grpo's mean final reward fully async / synchronous (a ratio: 1 = staleness
4 costs nothing); `stale4_corrected_vs_sync` = decoupled_ppo fully async / grpo synchronous;
`corrected_within_sync_spread` = decoupled_ppo async's mean lies within synchronous grpo's seed range
widened by its own spread (bench.learning's `reward_within_spread` check); each null when --presets
leaves out a preset it needs. The PNG (--png, default `runs/bench-algorithms.png`) draws each
preset's final held-out reward, synchronous and fully async side by side, the bar the mean over
seeds and the error bar the seeds' range, against the start model's reward.

Size and cost: 120 trainer steps by default. The start model's 0.35 reaches 0.456 (grpo synchronous,
seed 0), 0.47 (fully async); the shipped config gains ~0.09 in 60 steps (seeds 0, 1: 0.447, 0.438)
and 0.12 / 0.14 in 200 (seed 0, synchronous / fully async): little more past 120. Measured on the
2-core dev machine while another job ran (load ~3), seed 0 at 120 steps: training wall 12.5 s (grpo
synchronous), 9.2 s (grpo fully async), 16.8 / 11.6 s (decoupled_ppo: its trainer recomputes the
logprobs), 16.6 / 13.8 s (dapo); a run in all (flow, report, held-out evaluation) 11-21 s, ~33 s a
preset and seed for both modes, plus ~16 s of engine start-up per seed (the engines are keyed by the
run's seed). The full size (8 presets x 2 modes x 3 seeds = 48 runs) took 679 s on the quiet
machine (2026-11-27) plus the warm start (~1 min); --quick ~3 min; --smoke ~1 min.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from statistics import mean

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rl_engine.config.algorithm import PRESETS as PRESET_KNOBS  # noqa: E402

PRESETS = tuple(PRESET_KNOBS)  # grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, kimi, decoupled_ppo
QUICK_PRESETS = ("grpo", "dapo", "gspo", "decoupled_ppo")
SMOKE_PRESETS = ("grpo", "decoupled_ppo")
MODES = ("synchronous", "fully_async")
STALENESS = 4  # configs/fully_async.yaml's max_staleness, which the comparison is about


def run_preset(
    preset: str, mode: str, model: str, tasks: str, root: str, steps: int, seed: int, reward_start: float
) -> dict:
    """One run of `preset` in `mode` (bench.learning.run_one), with its reward gained per second."""
    from bench.learning import run_one

    r = run_one(mode, model, tasks, f"{root}/runs/{preset}", steps, seed, algorithm={"preset": preset})
    if mode == "fully_async" and r["staleness_bound"] != STALENESS:
        raise RuntimeError(
            f"{preset} fully_async ran with synchronizer.max_staleness {r['staleness_bound']}, not {STALENESS}: configs/fully_async.yaml changed?"
        )
    return {"preset": preset, **r, "reward_per_s": (r["final_reward"] - reward_start) / r["wall_s"]}


def summarize(rows: list[dict]) -> dict:
    """The JSON line's figures: per preset and mode, means and spreads over seeds; the staleness-4 ratios."""
    from bench.learning import within_spread

    by: dict[str, dict[str, list[dict]]] = {}
    for r in rows:
        by.setdefault(r["preset"], {}).setdefault(r["mode"], []).append(r)

    def avg(rs: list[dict], k: str, digits: int = 4) -> float:
        return round(mean(r[k] for r in rs), digits)

    presets = {
        p: {
            m: {
                "reward_final": avg(rs, "final_reward"),
                "reward_spread": round(max(r["final_reward"] for r in rs) - min(r["final_reward"] for r in rs), 4),
                "reward_per_s": avg(rs, "reward_per_s", 6),
                "clipped_fraction": avg(rs, "clip_frac"),
                "clamped_fraction": avg(rs, "offpolicy_clamped_frac"),
                "masked_fraction": avg(rs, "offpolicy_masked_frac"),
                "filtered_experiences": avg(rs, "filtered_experiences", 1),
                "max_staleness": max(r["max_staleness"] for r in rs),
                "wall_s": avg(rs, "wall_s", 2),
            }
            for m, rs in modes.items()
        }
        for p, modes in by.items()
    }

    def rewards(preset: str, mode: str) -> list[float] | None:
        return [r["final_reward"] for r in by[preset][mode]] if preset in by else None

    def over_sync(rs: list[float] | None) -> float | None:
        return round(mean(rs) / mean(sync), 4) if sync and rs and mean(sync) > 0 else None

    sync, plain, corrected = (
        rewards("grpo", "synchronous"),
        rewards("grpo", "fully_async"),
        rewards("decoupled_ppo", "fully_async"),
    )
    return {
        "presets": presets,
        "stale4_plain_vs_sync": over_sync(plain),
        "stale4_corrected_vs_sync": over_sync(corrected),
        "corrected_within_sync_spread": within_spread(corrected, sync) if sync and corrected else None,
    }


def plot(rows: list[dict], reward_start: float, path: str, title: str) -> None:
    """Final held-out reward per preset: synchronous and fully async bars side by side (the mean
    over seeds), the seeds' range as error bars, the start model's reward as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["preset"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 4), dpi=110)
    width = 0.38
    for i, (mode, label) in enumerate(
        (("synchronous", "synchronous"), ("fully_async", f"fully async (max_staleness {STALENESS})"))
    ):
        finals = [[r["final_reward"] for r in rows if r["preset"] == p and r["mode"] == mode] for p in names]
        ys = [mean(f) for f in finals]
        below, above = [y - min(f) for y, f in zip(ys, finals)], [max(f) - y for y, f in zip(ys, finals)]
        ax.bar(
            [j + (i - 0.5) * width for j in range(len(names))], ys, width, yerr=[below, above], capsize=3, label=label
        )
    ax.axhline(reward_start, color="grey", linestyle="--", linewidth=1, label=f"start model ({reward_start:.3f})")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_xlabel("algorithm.preset")
    ax.set_ylabel("final held-out exact match at T=1\n(mean over seeds; error bars: seed range)", fontsize=8)
    values = [r["final_reward"] for r in rows] + [reward_start]
    pad = max(0.02, 0.15 * (max(values) - min(values)))
    ax.set_ylim(max(0.0, min(values) - pad), min(1.0, max(values) + pad))
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help=f"CI size: 2 seeds, presets {','.join(QUICK_PRESETS)}, 12 trainer steps"
    )
    size.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI smoke test: 1 seed, presets {','.join(SMOKE_PRESETS)}, 2 trainer steps, a 2-step warm start",
    )
    ap.add_argument("--presets", default=None, help=f"comma-separated presets (default all: {','.join(PRESETS)})")
    ap.add_argument(
        "--steps", type=int, default=None, help="trainer steps per run (default 120, 12 with --quick, 2 with --smoke)"
    )
    ap.add_argument(
        "--seeds", default=None, help="comma-separated run seeds (default 0,1,2; 0,1 with --quick; 0 with --smoke)"
    )
    ap.add_argument(
        "--model", default=None, help="an arithmetic warm start to use (default: build one, `rft warmstart`, seed 0)"
    )
    ap.add_argument("--png", default="runs/bench-algorithms.png", help="where to write the final-reward figure")
    a = ap.parse_args()
    presets = (
        a.presets.split(",") if a.presets else list(SMOKE_PRESETS if a.smoke else QUICK_PRESETS if a.quick else PRESETS)
    )
    if unknown := sorted(set(presets) - set(PRESETS)):
        ap.error(f"--presets: unknown {unknown}; the presets are {','.join(PRESETS)}")
    steps = a.steps or (2 if a.smoke else 12 if a.quick else 120)
    seeds = [int(s) for s in (a.seeds or ("0" if a.smoke else "0,1" if a.quick else "0,1,2")).split(",")]

    from bench._report import emit_json, print_table
    from bench.learning import demo_workload, shared_engines

    root, model, tasks, start = demo_workload("bench-algorithms-", a.model, a.smoke)
    reward_start = start["expected_exact_t1"]
    rows = []
    started = time.time()
    with shared_engines():
        for seed in seeds:
            for preset in presets:
                for mode in MODES:
                    rows.append(run_preset(preset, mode, model, tasks, root, steps, seed, reward_start))
    title = f"bench.algorithms: demo task, tiny arithmetic warm start, {steps} trainer steps, seeds {seeds}"
    columns = [
        "preset",
        "mode",
        "seed",
        "wall_s",
        "final_reward",
        "reward_per_s",
        "clip_frac",
        "offpolicy_clamped_frac",
        "offpolicy_masked_frac",
        "filtered_experiences",
        "max_staleness",
    ]
    print_table(rows, columns, title=f"{title} (warm start exact@T=1 {reward_start:.3f})")
    out = summarize(rows)
    print_table(
        [{"preset": p, "mode": m, **s} for p, modes in out["presets"].items() for m, s in modes.items()],
        title="over seeds: means (reward_spread: max - min)",
    )
    plot(
        rows,
        reward_start,
        a.png,
        f"bench.algorithms: final held-out reward per preset\ndemo task, tiny arithmetic warm start, {steps} trainer steps, seeds {seeds}",
    )
    emit_json(
        {
            "steps": steps,
            "seeds": seeds,
            "reward_start": round(reward_start, 4),
            "png": a.png,
            "bench_s": round(time.time() - started, 1),
            **out,
        }
    )


if __name__ == "__main__":
    main()
