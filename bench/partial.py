"""Benchmark of partial rollouts: the same trainer steps on the long-tail countdown task with them off and on.

    python -m bench.partial [--quick | --smoke] [--steps N] [--seeds 0,1,2] [--model DIR]

--smoke (CI smoke test) is the same path at the smallest size: a warm start of 2 SFT steps, answers
cut at 32 tokens in 16-token segments (so the pipeline fills in 2 steps), 5 trainer steps, seed 0;
its figures say nothing about partial rollouts.

Workload: configs/partial.yaml (one-step off-policy; 8 tasks x 8 rollouts per step; countdown
"n..1=" with P(n) ~ 1/n on 1..40, answers of up to 111 tokens) on the countdown warm start
(`rft warmstart --task countdown`, built here unless --model names one). Each seed runs the
config twice as real Prefect flows (vLLM CPU explorer and DeepSpeed CPU trainer, one core each):
`explorer.partial.enabled` false (every generation in one go, up to sampling.max_tokens = 128)
and true (segments of segment_max_tokens per explorer step, continuations resumed in later steps).

Per run, over the steady state (bench.modes.steady_state, from the end of trainer step 8 to the
end of the last: the longest answers take max_response_tokens / segment_max_tokens steps, and
until then partial rollouts' batches lean to short tasks): explorer step time (mean rollout span: generate + score),
its write time (buffer commit; with partial rollouts also staging and retiring continuations),
generate calls per step (rounds of segments), trainer step time, trainer idle fraction (share of
the window the trainer spent waiting), generated tokens per rollout-second, generations cut per
step, mean response length, the trained tokens' mean version gap (trainer version minus the
version that generated a token: 1 without partial rollouts in this mode); at the end the trained batches' mean reward (last quarter of trainer
steps) and the final policy's expected exact-match at temperature 1 over the task distribution
(`rl_engine.demos.warmstart.evaluate_dir`: exact, no sampling noise). The batch reward is not
comparable between off and on (short groups finish first, and only partial rollouts stop
repeats, with a penalty), so `reward_off` / `reward_on` are the final policy's expected
exact-match (the expected `correct` reward), averaged over seeds, and `reward_spread` is
max - min of reward_off over the seeds.

Also per run the wall time of its training after start-up (`wall_s`: engine start-up is excluded,
since the off run of a seed starts the engine its on run reuses). JSON keys: step_time_speedup
(explorer step time off / on), trainer_step_speedup, wall_speedup, reward_off,
reward_on, reward_spread, reward_gap (on - off), reward_on_within_spread (min <= reward_on <= max
of the off seeds; null with one seed), plus per-setting means. Last, `alone_step_s` (off, on)
and `alone_speedup`: the first seed's explorer steps replayed with the explorer alone on the
machine (`isolated_step_s`: the same engine and config, no trainer, no buffer writes).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from statistics import mean

from bench._report import scratch_dir
from rl_engine.storage import open_storage

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "partial.yaml"
# --smoke: short answers in two segments, so the pipeline fills in 2 steps and a run needs 5.
SMOKE = {"sampling": {"max_tokens": 32}, "partial": {"segment_max_tokens": 16, "max_response_tokens": 32}}
SMOKE_WARMSTART_STEPS = 2  # each step below 20 is evaluated: 2 steps, 3 evaluations (10 took 11)


def load_config(smoke: bool = False) -> dict:
    """configs/partial.yaml, with --smoke's smaller response budget."""
    import yaml

    data = yaml.safe_load(CONFIG.read_text())
    if smoke:
        for section, values in SMOKE.items():
            data["explorer"][section].update(values)
    return data


def fill_steps(partial: dict) -> int:
    """Steps until partial rollouts' pipeline is full: a group of the longest answers needs
    max_response_tokens / segment_max_tokens of them, and until then batches lean to short tasks."""
    return -(-partial["max_response_tokens"] // partial["segment_max_tokens"])


def run_one(model: str, tasks: str, root: str, steps: int, seed: int, partial: bool, smoke: bool = False) -> dict:
    """One real flow run of configs/partial.yaml; its steady-state figures."""
    from bench.modes import busy_fraction, steady_state
    from cli.run import run_config
    from rl_engine.config import validate_config
    from rl_engine.demos.warmstart import evaluate_dir
    from rl_engine.run.context import open_run
    from rl_engine.run.report import load_metrics
    from rl_engine.run.timeline import load_spans, startup_end

    data = load_config(smoke)
    data.update(seed=seed, name=f"bench-partial-{'on' if partial else 'off'}-s{seed}")
    data["model"]["path"], data["taskset"]["path"] = model, tasks
    data["buffer"] = {"storage": {"url": root}}
    data["explorer"]["partial"]["enabled"] = partial
    data["explorer"]["engine"].update(num_threads=1, kv_cache_space_gib=0.25)
    data["trainer"].update(total_steps=steps, checkpoint_interval=steps, num_threads=1)
    summary = run_config(validate_config(data))
    fill = fill_steps(data["explorer"]["partial"])
    if steps < fill + 3:
        raise SystemExit(
            f"bench.partial: --steps {steps} leaves no steady state; use at least {fill + 3} (the pipeline fills in {fill} steps)"
        )
    spans = load_spans(summary["run"])
    # The whole run's training, after start-up (off runs first per seed and start the engine on() reuses).
    up = startup_end(spans)
    wall = max(s.end for s in spans if s.component == "trainer" and s.kind == "train") - up
    t0, t1, step_s, steady = steady_state(spans, skip=fill)
    rollouts = {s.step: s for s in steady if s.component == "explorer-0" and s.kind == "rollout"}
    writes = [s.duration for s in steady if s.component == "explorer-0" and s.kind == "write"]
    trainer_metrics, explorer_metrics = load_metrics(open_run(summary["run"]))
    steady_trainer = [m for m in trainer_metrics if m["step"] > fill]
    by_step = {m["explorer_step"]: m for m in explorer_metrics}
    # Tokens generated in the step (a partial step's segments, not the finished groups' totals).
    generated = {e: (m["partial"]["tokens"] if partial else m["tokens"]) for e, m in by_step.items()}
    final = evaluate_dir(f"{summary['run']}/model", task="countdown")
    return {
        "partial": "on" if partial else "off",
        "seed": seed,
        "explorer_step_s": mean(s.duration for s in rollouts.values()),
        "write_s": mean(writes) if writes else 0.0,
        "generate_calls": mean(by_step[e]["partial"]["rounds"] if partial else 1 for e in rollouts),
        "trainer_step_s": step_s,
        "trainer_idle": 1.0 - busy_fraction(steady, "trainer", t0, t1),
        "tokens_per_s": sum(generated[e] for e in rollouts) / sum(s.duration for s in rollouts.values()),
        "resp_len": mean(by_step[e]["response_len_mean"] for e in rollouts),
        "cut_per_step": mean(s.cut or 0 for s in rollouts.values()),
        "version_gap": mean(m["version_gap_mean"] for m in steady_trainer),
        "batch_reward_last": summary["reward_last"],
        "exact_t1_final": final["expected_exact_t1"],
        "greedy_final": final["greedy_exact"],
        "steady_steps": len(rollouts),
        "wall_s": wall,
    }


def isolated_step_s(run_url: str, steps: int, skip: int) -> float:
    """Mean explorer step (generate + score) of a finished run's config with the engine alone on
    the machine: no trainer beside it, no buffer writes, the warm start's weights. The prefix
    cache is dropped before every step, as a weight sync does, so continuations re-prefill."""
    from rl_engine.buffer import ContinuationStore
    from rl_engine.rewards import TaskIterator, build_reward, load_taskset
    from rl_engine.roles.explorer import ENGINES, generate_experiences, partial_settings
    from rl_engine.roles.partial import PartialRollouts
    from rl_engine.run.context import open_run

    run = open_run(run_url)
    cfg = run.cfg
    engine = ENGINES.acquire(run, 0)
    try:
        tasks = TaskIterator(
            load_taskset(cfg.taskset), cfg.explorer.batch_size, seed=cfg.seed, shuffle=cfg.taskset.shuffle
        )
        reward_fn = build_reward(cfg.taskset.reward)
        partial = None
        if cfg.explorer.partial.enabled:
            store = ContinuationStore(*open_storage(scratch_dir("bench-partial-isolated-"), {}), 0, fsync=False)
            partial = PartialRollouts(engine, store, tasks, reward_fn, partial_settings(cfg, 0), first_step=1)
        times = []
        for e in range(1, steps + 1):
            engine.mark_synced(engine.version)
            t0 = time.perf_counter()
            if partial is not None:
                partial.generate(e)
            else:
                generate_experiences(engine, tasks.next_batch(), reward_fn, cfg, 0, e)
            times.append(time.perf_counter() - t0)
        return mean(times[skip:])
    finally:
        ENGINES.release(run, 0, engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI size: 1 seed, 12 trainer steps")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke test: 1 seed, 5 trainer steps, short answers, a 2-step warm start",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="trainer steps per run (default 24, 12 with --quick, 5 with --smoke)"
    )
    ap.add_argument(
        "--seeds", default=None, help="comma-separated run seeds (default 0,1,2; 0 with --quick or --smoke)"
    )
    ap.add_argument(
        "--model",
        default=None,
        help="a countdown warm start to use (default: build one, `rft warmstart --task countdown`, seed 0)",
    )
    a = ap.parse_args()
    steps = a.steps or (5 if a.smoke else 12 if a.quick else 24)
    seeds = [int(s) for s in (a.seeds or ("0" if a.quick or a.smoke else "0,1,2")).split(",")]

    from prefect.testing.utilities import prefect_test_harness

    from bench._report import emit_json, print_table
    from rl_engine.demos.countdown import write_countdown_taskset
    from rl_engine.demos.warmstart import COUNTDOWN, DEFAULTS, evaluate_dir, warmstart
    from rl_engine.roles.explorer import ENGINES

    root = scratch_dir("bench-partial-")
    model = a.model
    if model is None:
        model = f"{root}/tiny-countdown-sft"
        d = {**DEFAULTS, **COUNTDOWN}
        warmstart(
            model,
            SMOKE_WARMSTART_STEPS if a.smoke else d["steps"],
            d["batch_size"],
            d["lr"],
            d["warmup_steps"],
            seed=0,
            max_operand=d["max_operand"],
            threads=2,
            task="countdown",
        )
    start = evaluate_dir(model, task="countdown")
    tasks = write_countdown_taskset(f"{root}/countdown.jsonl", n=2000, seed=0)
    os.environ["RFT_KEEP_ENGINES"] = "1"  # off and on of a seed share one warm engine
    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        for seed in seeds:
            for partial in (False, True):
                rows.append(run_one(model, tasks, f"{root}/runs", steps, seed, partial, a.smoke))
    # The first seed's two settings again with the explorer alone on the machine (no trainer beside it):
    # what partial rollouts gain on this CPU when nothing competes for the cores.
    fill = fill_steps(load_config(a.smoke)["explorer"]["partial"])
    alone = {s: isolated_step_s(f"{root}/runs/bench-partial-{s}-s{seeds[0]}", steps, fill) for s in ("off", "on")}
    ENGINES.close_all()  # their shutdown logs would follow the JSON line
    print_table(
        rows,
        title=f"bench.partial (real tiny model: vLLM CPU explorer, DeepSpeed CPU trainer, one core each; configs/partial.yaml, "
        f"{steps} trainer steps per run; warm start exact@T=1 {start['expected_exact_t1']:.3f})",
    )

    def avg(setting: str, key: str) -> float:
        return mean(r[key] for r in rows if r["partial"] == setting)

    off = [r["exact_t1_final"] for r in rows if r["partial"] == "off"]
    on = [r["exact_t1_final"] for r in rows if r["partial"] == "on"]
    spread = max(off) - min(off)
    out = {
        "steps": steps,
        "seeds": seeds,
        "step_time_speedup": round(avg("off", "explorer_step_s") / avg("on", "explorer_step_s"), 3),
        "trainer_step_speedup": round(avg("off", "trainer_step_s") / avg("on", "trainer_step_s"), 3),
        "reward_start": round(start["expected_exact_t1"], 4),
        "reward_off": round(mean(off), 4),
        "reward_on": round(mean(on), 4),
        "reward_spread": round(spread, 4),
        "reward_on_range": [round(min(on), 4), round(max(on), 4)],
        "reward_gap": round(mean(on) - mean(off), 4),
        "reward_on_within_spread": min(off) <= mean(on) <= max(off) if len(off) > 1 else None,
    }
    out["wall_speedup"] = round(avg("off", "wall_s") / avg("on", "wall_s"), 3)
    out["alone_step_s"] = {k: round(v, 3) for k, v in alone.items()}
    out["alone_speedup"] = round(alone["off"] / alone["on"], 3)
    for key in (
        "explorer_step_s",
        "trainer_step_s",
        "trainer_idle",
        "tokens_per_s",
        "version_gap",
        "batch_reward_last",
        "wall_s",
    ):
        out[key] = {s: round(avg(s, key), 3) for s in ("off", "on")}
    emit_json(out)


if __name__ == "__main__":
    main()
