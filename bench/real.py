"""Benchmark of a real pretrained model end to end: SmolLM2-135M-Instruct learning word arithmetic.

    python -m bench.real [--quick] [--steps N] [--heldout N] [--root DIR] [--set KEY=VALUE ...]

The run is `make demo-real`'s: configs/smollm2.yaml (synchronous GRPO, collective sync, the engine on every core,
4 tasks x 8 rollouts of up to 32 tokens per step, 30 trainer steps) as a real Prefect flow, on the
model `rft fetch-model` converts and the word-arithmetic tasks, run by `rft demo --model smollm2`'s
own code (cli.demo_real.demo_real, whose lines come first on stdout), measured on the way;
`--set KEY=VALUE` changes the config as `rft demo --set` does (the JSON says the run's `mode` and
the `overrides`). Reported:

- held-out exact match (rl_engine.evaluate: the run's reward on the 320 held-out problems no train
  task asks), greedy and at temperature 1, before and after (`held_out_before` / `held_out_after`
  are greedy; `_t1` the temperature-1 ones);
- `s_per_step`: wall time from the engine being up to the last trainer step's end, per step;
  `startup_s` apart; `gen_tokens_per_s`: response tokens over the rollout spans' time;
  `train_tokens_per_s`: the trained tokens over the train spans' time; `sync_s_trainer` /
  `sync_s_explorer`: the median weight sync (the trainer's send; an explorer's receive and load);
- the trainer against the machine's FLOP rate (`trainer_flops`): `padding_fraction` (padding's
  share of the batch positions), `trainer_gflops` (6 x parameters x real tokens over the train
  spans' time), `matmul_gflops` (an fp32 2048^3 GEMM on the trainer's threads, measured in the
  same run) and `trainer_flops_fraction`, the ratio (issue 48's goal: >= 0.6);
- `logprob_gap_fp32` / `logprob_gap_bf16`: mean |vLLM - trainer| logprob per response token with
  both in that dtype (harness.real_model.logprob_gap);
- `peak_rss_gb`: the largest resident memory of this process and all its children together
  (engines, trainer), sampled every 0.5 s over the whole benchmark;
- the step against its floor on this machine (bench.step_floor's `step_floor`, after the run, on its
  kept engine): `floor_generate_s` (vLLM's own generate of the run's typical step),
  `floor_train_s` (the faster of the DeepSpeed trainer's step, `trainer_step_s`, and a plain
  torch/transformers step, `reference_step_s`: AdamW, the same GRPO loss, the same
  micro-batches, full logits; both on the run's typical batch, the step of median tokens, at the trainer's threads),
  `floor_reload_s` (the engine's in-place reload of the weights, which every weight sync ends
  with: `sync_s_explorer` cannot go below it), their sum `step_floor_s`, and `step_over_floor`
  (`s_per_step` over it; a synchronous step runs the three one after another);
  `sync_over_reload_floor`: `sync_s_explorer` over `floor_reload_s` (issue 48's goal: <= 1.2);
  `train_step_over_reference`: `trainer_step_s` over `reference_step_s`, timed one after the
  other (median of 3 after a warm-up).

--quick: 3 trainer steps, 32 held-out problems; --smoke (CI): 1 step of 2 tasks x 4 rollouts of up to
16 tokens, 4 held-out problems, the bf16 gap only (on 2 prompts; `logprob_gap_fp32` is null: each gap
starts an engine and a trainer, about a minute here, and tests/rl_engine/sync/test_real_model.py holds
the fp32 one), one timed step each; their scores say nothing about learning.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


class PeakRss:
    """Largest summed RSS of this process and its descendants, sampled in a daemon thread; also
    the largest of this process alone (`peak_self`: the trainer and the flows of a local run) and of
    its descendants alone (`peak_children`: the engines), each at its own moment."""

    def __init__(self, every_s: float = 0.5):
        import psutil

        self.peak = self.peak_self = self.peak_children = 0
        self._me, self._every, self._stop = psutil.Process(), every_s, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-peak-rss")

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(self._every):
            own, children = 0, 0
            for p in [self._me, *self._me.children(recursive=True)]:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue  # a child that just exited
                if p is self._me:
                    own = rss
                else:
                    children += rss
            self.peak = max(self.peak, own + children)
            self.peak_self, self.peak_children = max(self.peak_self, own), max(self.peak_children, children)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def run_figures(summary: dict[str, Any], spans: list | None = None) -> dict[str, float | None]:
    """s_per_step, startup_s, gen_tokens_per_s, train_tokens_per_s, and the weight sync's median
    seconds on each side (sync_s_trainer: the send; sync_s_explorer: receive and load) of a finished run."""
    from rl_engine.run.context import open_run
    from rl_engine.run.report import load_metrics
    from rl_engine.run.timeline import load_spans, startup_end

    spans = load_spans(summary["run"]) if spans is None else spans  # a caller that has them already
    t0 = startup_end(spans)
    train = [s for s in spans if s.component == "trainer" and s.kind == "train"]
    rollout = [s for s in spans if s.kind == "rollout"]
    run = open_run(summary["run"])
    trainer_metrics, explorer_metrics = load_metrics(run)
    return {
        "s_per_step": (max(s.end for s in train) - t0) / len(train),
        "startup_s": t0 - min(s.start for s in spans),
        "gen_tokens_per_s": sum(m["tokens"] for m in explorer_metrics) / sum(s.duration for s in rollout),
        "train_tokens_per_s": sum(m["tokens"] for m in trainer_metrics) / sum(s.duration for s in train),
        **{f"sync_s_{side}": _median_sync(spans, side) for side in ("trainer", "explorer")},
        **trainer_flops(run.cfg, trainer_metrics, train),
    }


def trainer_flops(cfg: Any, trainer_metrics: list[dict], train: list) -> dict[str, float | None]:
    """The trainer against this machine's FLOP rate (issue 48), of a finished run of `cfg` (its trainer step metrics and train spans, as run_figures reads them):
    `padding_fraction` (the batch positions that were padding, over all trainer steps),
    `trainer_gflops` (6 x parameters x attended tokens, a forward and a backward of every real
    token, over the train spans' time: a lower bound where the algorithm adds forwards, a
    recomputed proximal policy or a KL reference), `matmul_gflops` (`matmul_gflops` of the run's
    dtype on the trainer's threads, measured now) and their ratio `trainer_flops_fraction`. Null for a run whose trainer recorded no positions."""
    import math

    from rl_engine.adapter import model_shapes

    steps = [m for m in trainer_metrics if m.get("positions")]
    if not steps:
        return dict.fromkeys(("padding_fraction", "trainer_gflops", "matmul_gflops", "trainer_flops_fraction"))
    attended = sum(m["attended"] for m in steps)
    params = sum(math.prod(shape) for shape in model_shapes(cfg.model.path).values())
    achieved = 6 * params * attended / sum(s.duration for s in train) / 1e9
    peak = matmul_gflops(cfg.trainer.num_threads or os.cpu_count() or 1, cfg.model.dtype)
    return {
        "padding_fraction": 1 - attended / sum(m["positions"] for m in steps),
        "trainer_gflops": achieved,
        "matmul_gflops": peak,
        "trainer_flops_fraction": achieved / peak,
    }


def matmul_gflops(threads: int, dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` n x n x n matrix products in `dtype` on `threads` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
        a @ b  # the first call allocates and picks its kernel
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(before)


def _median_sync(spans: list, side: str) -> float | None:
    d = [s.duration for s in spans if s.kind == "sync" and s.component.startswith(side)]
    return statistics.median(d) if d else None  # a 1-step run syncs nothing


class RealBench:
    """What bench.real measures around `rft demo --model smollm2`'s run (cli.demo_real.demo_real's `bench`)."""

    def __init__(self, repeats: int):
        self.repeats = repeats

    def engines(self) -> Any:
        from bench.learning import shared_engines

        return shared_engines()  # the run's engine is kept for its floor, then closed

    def run_done(self, summary: dict[str, Any]) -> None:
        from bench.step_floor import step_floor

        self.summary, self.figures, self.floor = summary, run_figures(summary), step_floor(summary["run"], self.repeats)

    def scored(self, cfg: Any, before: dict[str, float], after: dict[str, float]) -> None:
        self.cfg, self.before, self.after = cfg, before, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="3 trainer steps, 32 held-out problems")
    size.add_argument(
        "--smoke", action="store_true", help="CI smoke test: 1 step, 4 held-out problems, the smallest of everything"
    )
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default 30; 3 with --quick)")
    ap.add_argument(
        "--heldout", type=int, default=None, help="held-out problems scored (default all 320; 32 with --quick)"
    )
    ap.add_argument(
        "--root",
        default="runs",
        help="where the model, tasks and run go (default ./runs, as `make demo-real`: the model is fetched once)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override on top of configs/smollm2.yaml, as `rft run --set` (repeatable), e.g. synchronizer.mode=synchronous",
    )
    a = ap.parse_args()
    steps = a.steps or (1 if a.smoke else 3 if a.quick else 30)
    heldout_n = a.heldout or (4 if a.smoke else 32 if a.quick else None)
    gap_prompts, repeats = (2, 1) if a.smoke else (8, 3)
    gap_dtypes = ("bfloat16",) if a.smoke else ("float32", "bfloat16")

    from bench._report import emit_json, print_table
    from cli.demo_real import demo_real
    from harness.real_model import logprob_gap
    from rl_engine.config.base import redact_overrides
    from rl_engine.proc.logfile import terminal_to
    from rl_engine.run.logs import run_log

    shrink = (
        [
            "explorer.batch_size=2",
            "algorithm.repeat_times=4",
            "trainer.micro_batch_size=8",
            "explorer.sampling.max_tokens=16",
        ]
        if a.smoke
        else []
    )
    bench = RealBench(repeats)
    started = time.time()
    with PeakRss() as rss:
        # `rft demo --model smollm2`'s own code path (its lines are printed above the tables), measured on the way
        rc = demo_real(
            a.root,
            [f"trainer.total_steps={steps}", f"trainer.checkpoint_interval={steps}", *shrink, *a.set],
            heldout_n,
            bench=bench,
        )
        if rc != 0:
            raise SystemExit(rc)
        cfg, before, after, summary, figures, floor = (
            bench.cfg,
            bench.before,
            bench.after,
            bench.summary,
            bench.figures,
            bench.floor,
        )
        # The gap's engines and trainers print as the run's did: into the run's log, off the terminal.
        with run_log(summary["run"], cfg.buffer.storage.fs_options()) as log, terminal_to(log):
            gaps = {dtype: logprob_gap(cfg.model.path, dtype, n_prompts=gap_prompts) for dtype in gap_dtypes}
    rows = [
        {
            "model": "before",
            "greedy_exact": before["greedy_exact"],
            "t1_exact": before["t1_exact"],
            "greedy_tokens": before["greedy_response_tokens"],
        },
        {
            "model": "after",
            "greedy_exact": after["greedy_exact"],
            "t1_exact": after["t1_exact"],
            "greedy_tokens": after["greedy_response_tokens"],
        },
    ]
    print_table(
        rows,
        title=f"bench.real: SmolLM2-135M-Instruct, word arithmetic, {steps} trainer steps, {int(before['tasks'])} held-out problems",
    )
    print_table(
        [{**figures, "reward_first": summary["reward_first"], "reward_last": summary["reward_last"]}], title="run"
    )
    print_table(
        [{"s_per_step": figures["s_per_step"], **floor}],
        title="the step against its floor on this machine (generate + train + reload, each measured alone)",
    )
    print_table(
        [{"dtype": d, **g} for d, g in gaps.items()], title="vLLM vs trainer logprobs (mean |diff| per response token)"
    )
    emit_json(
        {
            "steps": steps,
            "mode": cfg.synchronizer.mode,
            "overrides": redact_overrides(a.set),  # the report is shared: a credential given by --set is not in it
            "heldout_tasks": int(before["tasks"]),
            "held_out_before": round(before["greedy_exact"], 4),
            "held_out_after": round(after["greedy_exact"], 4),
            "held_out_before_t1": round(before["t1_exact"], 4),
            "held_out_after_t1": round(after["t1_exact"], 4),
            "held_out_gain_points": round(100 * (after["greedy_exact"] - before["greedy_exact"]), 1),
            **{k: None if v is None else round(v, 3) for k, v in figures.items()},
            "logprob_gap_fp32": gaps["float32"]["mean"] if "float32" in gaps else None,
            "logprob_gap_bf16": gaps["bfloat16"]["mean"],
            "peak_rss_gb": round(rss.peak / 2**30, 2),
            **{k: round(v, 3) for k, v in floor.items()},
            "step_over_floor": round(figures["s_per_step"] / floor["step_floor_s"], 3),
            "sync_over_reload_floor": None
            if figures["sync_s_explorer"] is None
            else round(figures["sync_s_explorer"] / floor["floor_reload_s"], 3),
            "train_step_over_reference": round(floor["trainer_step_s"] / floor["reference_step_s"], 3),
            "bench_s": round(time.time() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
