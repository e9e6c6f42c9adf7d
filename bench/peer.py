"""Benchmark: rft against the simplest peer, a reference GRPO loop, on the real model (issue 48, item 1).

    python -m bench.peer [--quick | --smoke] [--seeds 42,43,44] [--steps N] [--heldout N] [--root DIR]

For each seed, back to back: rft's real-model demo (cli.demo_real.demo_real, configs/smollm2.yaml
with `seed` set: synchronous GRPO, vLLM explorer, DeepSpeed trainer, collective sync) and the
reference loop (bench/reference_loop.py: one process, `transformers.generate` and the plain torch
step of bench/reference.py, no vLLM, no DeepSpeed, no sync) given the same config: the same model
(SmolLM2-135M-Instruct), tasks in the same order, prompts, reward, batch (4 tasks x 8 rollouts),
sampling (T=1, 32 tokens), lr and warm-up, loss (PPO-clip 0.2 / 0.28, token-mean) and steps.
Both trained models are scored by the same scorer on the same held-out problems (the demo's
`held_out`: rl_engine.evaluate, greedy exact match on the problems no train task asks); the
score before is the demo's own (both start from that model, and greedy decoding is seed-free).

Reported per seed and system: held-out before / after and the gain (points), the step time
(rft: `s_per_step`, engine up to the last trainer step, per step; the reference: its mean
generate + reward + update), the start-up (rft: the run's start, Prefect and the engines, to
the end of its start-up, `rl_engine.run.timeline.startup_end`; the reference: model load to its
first step), the end-to-end time (rft: the run from its start, Prefect and the
engine included, to its summary, the final model written; the reference: model load to the
trained model written; neither includes the held-out scoring), and the held-out gain per second
of that. The JSON line: `heldout_gain_vs_reference` (mean gain over mean gain; null when the
reference's mean gain is not positive), `heldout_spread` (rft's held-out after, max - min over
seeds, points; `heldout_spread_reference` the reference's), `step_over_reference_step` (mean
step time over the reference's), `end_to_end_over_reference`, `startup_over_reference` (goal
<= 1), `heldout_gain_per_s_vs_reference`
(mean over seeds of gain / end-to-end seconds, over the reference's; null when the reference's is
not positive), and the figures they come from.

The machine's bounds on those goals, measured in the same bench run (`bounds`): rft's step floor
(bench.step_floor, on the last seed's run and its kept engine) against the reference's step, the
gain per second rft would reach at that floor if it learned as much as the reference, the vLLM
engine's own start against the reference's start-up, and the reference's `transformers.generate`
against rft's rollout and sync (what a colocated generator would trade).

Not in this JSON line: `trainer_flops_fraction`, `padding_fraction` and `sync_over_reload_floor`
are bench.real's (issue 48 asks them of either).

--quick: 1 seed (the first), 3 steps, 32 held-out problems; --smoke (CI): 1 seed, 1 step of
2 tasks x 4 rollouts of up to 16 tokens (bench.real's smoke sizes), no held-out scoring (the gains
are null): it checks that both sides run, and says nothing about learning. Even --smoke runs the
real model through vLLM (a minute and a half): tests/flows/test_demo_real.py runs it in the
real-model turn; tests/bench/test_reference_loop.py covers the reference loop on the tiny model
and these figures, tests/rl_engine/trainer/test_reference_step.py its step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


class PeerBench:
    """What bench.peer keeps of one `demo_real` run (its `bench` hooks): the run's wall time, from
    entering `engines()` (just before the run starts) to `run_done`, and its figures. With
    `floor_repeats`, the run's engine is kept past the run and the step's floor on this machine
    measured on it (bench.step_floor), then the engine is closed."""

    def __init__(self, floor_repeats: int | None = None):
        self.floor_repeats = floor_repeats
        self.floor: dict[str, float] | None = None

    def engines(self) -> PeerBench:
        return self

    def __enter__(self) -> PeerBench:
        if self.floor_repeats:
            os.environ["RFT_KEEP_ENGINES"] = "1"  # the floor's generate and reload run on the run's warm engine
        self.started, self.started_wall = time.perf_counter(), time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.floor_repeats:
            from rl_engine.roles.explorer import ENGINES

            os.environ.pop("RFT_KEEP_ENGINES", None)
            ENGINES.close_all()

    def run_done(self, summary: dict[str, Any]) -> None:
        from bench.real import run_figures
        from rl_engine.run.timeline import load_spans, startup_end

        self.end_to_end_s = time.perf_counter() - self.started
        spans = load_spans(summary["run"])
        self.summary, self.figures = summary, run_figures(summary, spans)
        self.startup_s = startup_end(spans) - self.started_wall  # the run's clock: time.time()
        self.phases = phase_means(spans)
        if self.floor_repeats:
            from bench.step_floor import step_floor

            self.floor = step_floor(summary["run"], self.floor_repeats)

    def scored(self, cfg: Any, before: dict[str, float] | None, after: dict[str, float] | None) -> None:
        self.cfg, self.before, self.after = cfg, before, after


def phase_means(spans: list) -> dict[str, float | None]:
    """Mean seconds of a run's rollouts (`generate_s`), trainer steps (`train_s`) and explorer
    engine starts (`engine_start_s`), from its timeline."""

    def mean(durations: list[float]) -> float | None:
        return statistics.mean(durations) if durations else None

    explorers = [s for s in spans if s.component.startswith("explorer")]
    return {
        "generate_s": mean([s.duration for s in spans if s.kind == "rollout"]),
        "train_s": mean([s.duration for s in spans if s.component == "trainer" and s.kind == "train"]),
        "engine_start_s": mean([s.duration for s in explorers if s.kind == "engine_start"]),
    }


def rft_row(
    seed: int, root: str, steps: int, heldout_n: int | None, shrink: list[str], floor_repeats: int | None = None
) -> tuple[dict[str, Any], Any]:
    """One rft run of the demo at `seed`: (its row, its PeerBench); with `floor_repeats` the step's
    floor is measured after it (PeerBench)."""
    from cli.demo_real import demo_real

    bench = PeerBench(floor_repeats)
    overrides = [f"seed={seed}", f"trainer.total_steps={steps}", f"trainer.checkpoint_interval={steps}", *shrink]
    if demo_real(root, overrides, heldout_n, bench=bench) != 0:
        raise SystemExit(1)
    before, after = bench.before, bench.after
    row = {
        "system": "rft",
        "seed": seed,
        "held_out_before": None if before is None else before["greedy_exact"],
        "held_out_after": None if after is None else after["greedy_exact"],
        "s_per_step": bench.figures["s_per_step"],
        "startup_s": bench.startup_s,
        "end_to_end_s": bench.end_to_end_s,
        **bench.phases,
        "sync_s_explorer": bench.figures["sync_s_explorer"],
        "step_floor_s": None if bench.floor is None else bench.floor["step_floor_s"],
    }
    return row, bench


def reference_row(rft: PeerBench, seed: int, root: str, steps: int, heldout_n: int | None) -> dict[str, Any]:
    """The reference loop on rft's run config (its seed, model, tasks, knobs), scored as the demo scores."""
    from bench.reference_loop import reference_loop
    from cli.demo_real import held_out, prepare_real

    out_dir = str(Path(root, "peer", f"reference-seed{seed}"))
    out = reference_loop(rft.cfg, steps, out_dir)
    after = None
    if rft.before is not None:
        after = held_out(rft.cfg, out_dir, prepare_real(root)[2], heldout_n)["greedy_exact"]
    return {
        "system": "reference",
        "seed": seed,
        "held_out_before": None if rft.before is None else rft.before["greedy_exact"],
        "held_out_after": after,
        "s_per_step": statistics.mean(out["step_s"]),
        "startup_s": out["startup_s"],
        "end_to_end_s": out["end_to_end_s"],
        "generate_s": statistics.mean(out["generate_s"]),
        "train_s": statistics.mean(out["train_s"]),
    }


def with_gains(row: dict[str, Any]) -> dict[str, Any]:
    """The row with gain_points and gain_per_s (None without held-out scores)."""
    scored = row["held_out_after"] is not None
    gain = 100 * (row["held_out_after"] - row["held_out_before"]) if scored else None
    return {**row, "gain_points": gain, "gain_per_s": None if gain is None else gain / row["end_to_end_s"]}


def summarise(rows: list[dict[str, Any]], steps: int | None = None) -> dict[str, Any]:
    """The JSON figures of the per-seed rows of both systems (module docstring); the bounds need
    `steps` and a row with the step's floor."""

    def of(system: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["system"] == system and r.get(key) is not None]

    def mean(system: str, key: str) -> float | None:
        values = of(system, key)
        return statistics.mean(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else round(a / b, 3)

    def spread(system: str) -> float | None:
        after = of(system, "held_out_after")
        return round(100 * (max(after) - min(after)), 1) if after else None

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    out = {
        "heldout_gain_vs_reference": ratio(mean("rft", "gain_points"), mean("reference", "gain_points")),
        "heldout_spread": spread("rft"),
        "heldout_spread_reference": spread("reference"),
        "step_over_reference_step": ratio(mean("rft", "s_per_step"), mean("reference", "s_per_step")),
        "end_to_end_over_reference": ratio(mean("rft", "end_to_end_s"), mean("reference", "end_to_end_s")),
        "startup_over_reference": ratio(mean("rft", "startup_s"), mean("reference", "startup_s")),
        "heldout_gain_per_s_vs_reference": ratio(mean("rft", "gain_per_s"), mean("reference", "gain_per_s")),
        **bounds(mean, ratio, steps),
    }
    for system in ("rft", "reference"):
        out[f"held_out_after_{system}"] = [r3(x) for x in of(system, "held_out_after")]
        out[f"heldout_gain_{system}"] = r3(mean(system, "gain_points"))
        out[f"heldout_gain_per_s_{system}"] = None if (g := mean(system, "gain_per_s")) is None else round(g, 5)
        out[f"s_per_step_{system}"] = r3(mean(system, "s_per_step"))
        out[f"end_to_end_s_{system}"] = r3(mean(system, "end_to_end_s"))
        out[f"startup_s_{system}"] = r3(mean(system, "startup_s"))
    return out


def bounds(mean: Any, ratio: Any, steps: int | None) -> dict[str, float | None]:
    """This machine's bounds on the goals, from the same bench run (`summarise`'s helpers `mean` and
    `ratio`): `step_floor_over_reference_step` (rft's step floor, bench.step_floor's generate +
    train + reload measured after its last run, over the reference's mean step);
    `heldout_gain_per_s_bound_vs_reference` (the gain per second rft would have against the
    reference if it learned exactly as much and every step ran at its floor: the reference's mean
    end-to-end over rft's with each step at the floor); `startup_floor_s` (the vLLM engine's own
    start in rft's runs, which a first rollout waits for) and `startup_floor_over_reference`;
    `colocated_generate_over_rollout_and_sync` (the reference's transformers.generate of a step,
    what colocated generation by the trainer's weights would run, over rft's vLLM rollout plus its
    weight sync, what it would replace: above 1, colocating is slower)."""
    floor = mean("rft", "step_floor_s")
    e2e, step = mean("rft", "end_to_end_s"), mean("rft", "s_per_step")
    at_floor = None if None in (floor, e2e, step, steps) else e2e - steps * (step - floor)
    engine = mean("rft", "generate_s"), mean("rft", "sync_s_explorer")
    return {
        "step_floor_s": None if floor is None else round(floor, 3),
        "step_floor_over_reference_step": ratio(floor, mean("reference", "s_per_step")),
        "heldout_gain_per_s_bound_vs_reference": ratio(mean("reference", "end_to_end_s"), at_floor),
        "startup_floor_s": None if (f := mean("rft", "engine_start_s")) is None else round(f, 3),
        "startup_floor_over_reference": ratio(mean("rft", "engine_start_s"), mean("reference", "startup_s")),
        "colocated_generate_over_rollout_and_sync": ratio(
            mean("reference", "generate_s"), None if None in engine else sum(engine)
        ),
    }


PER_SEED = [
    "system",
    "seed",
    "held_out_before",
    "held_out_after",
    "gain_points",
    "s_per_step",
    "startup_s",
    "end_to_end_s",
    "gain_per_s",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="1 seed, 3 trainer steps, 32 held-out problems")
    size.add_argument("--smoke", action="store_true", help="CI smoke: 1 seed, 1 small step, no held-out scoring")
    ap.add_argument("--seeds", default="42,43,44", help="comma-separated run seeds (default 42,43,44)")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 30; 3 with --quick)")
    ap.add_argument("--heldout", type=int, default=None, help="held-out problems scored (default all 320)")
    ap.add_argument("--root", default="runs", help="where the model, tasks and runs go (default ./runs)")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    if a.quick or a.smoke:
        seeds = seeds[:1]
    steps = a.steps or (1 if a.smoke else 3 if a.quick else 30)
    heldout_n = 0 if a.smoke else a.heldout or (32 if a.quick else None)

    from bench._report import emit_json, print_table
    from bench.lora import SMOKE

    started, rows = time.time(), []
    for seed in seeds:
        floor = None if a.smoke or seed != seeds[-1] else 3  # the floor once, after the last rft run
        shrink = SMOKE if a.smoke else []  # bench.lora's smoke sizes
        row, bench = rft_row(seed, a.root, steps, heldout_n, shrink, floor)
        rows += [with_gains(row), with_gains(reference_row(bench, seed, a.root, steps, heldout_n))]
        print_table(rows[-2:], columns=PER_SEED, title=f"bench.peer: seed {seed} done")  # kept if a later seed fails
    tasks = None if bench.before is None else int(bench.before["tasks"])
    print_table(
        rows,
        columns=PER_SEED,
        title=f"bench.peer: SmolLM2-135M-Instruct, word arithmetic, {steps} steps, {tasks or 0} held-out problems",
    )
    print_table(
        rows,
        columns=["system", "seed", "generate_s", "sync_s_explorer", "train_s", "step_floor_s"],
        title="where a step goes (rft: mean rollout and train spans, median sync, its floor after the last run)",
    )
    emit_json(
        {
            "steps": steps,
            "seeds": seeds,
            "heldout_tasks": tasks,
            "held_out_before": None if bench.before is None else round(bench.before["greedy_exact"], 4),
            **summarise(rows, steps),
            "bench_s": round(time.time() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
