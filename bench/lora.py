"""Benchmark: LoRA against full fine-tuning, back to back in one invocation (issue 46).

    python -m bench.lora [--quick | --smoke] [--steps N] [--heldout N] [--root DIR] [--png FILE]

Two runs of the real model's demo, the same tasks, seed, steps and held-out problems:
configs/smollm2.yaml (full fine-tuning) and configs/smollm2-lora.yaml (rank-8 adapters on every
linear projection, the learning rate twenty times full's), each through `rft demo --model
smollm2`'s own code (cli.demo_real.demo_real: held-out greedy exact match before and after, on
problems no train task asks). Reported per run: `s_per_step`, the median weight sync
(`sync_s_trainer`: the trainer's send; `sync_s_explorer`: an explorer's receive and install),
`trainer_step_s` (the median train span), the peak RSS of this process and its children over the
run, and the held-out gain in points; then:

- `adapter_sync_bytes_ratio`: the bytes one weight sync sends under LoRA (the adapter's tensors,
  what the trainer's `named_weights` yields) over full fine-tuning's (every parameter), both in
  model.dtype, from the model's safetensors headers and the adapter's shapes;
- `sync_s_lora` / `sync_s_full`: the median sync, trainer's send plus explorer's install, per run;
- `peak_rss_ratio`: LoRA's peak RSS over full's, each run in a process of its own (the run's
  trainer and flows, and its children: the vLLM engine); `peak_trainer_gb_*` (the process) and
  `peak_engine_gb_*` (its children) split it, each part's own peak; `peak_rss_ratio_bound` is what
  the ratio would be with the trainer's saving alone, the engine as large as full fine-tuning's
  (vLLM's LoRA buffers and kernels are the difference);
- `trainer_rss_gb_*`, `trainer_rss_ratio`: each trainer alone, in a process of its own, after two
  steps of the config's batch shape (not with --smoke);
- `heldout_gain_lora` / `heldout_gain_full`: greedy exact-match gain, points;
- `engine_mem_growth_mb`: a LoRA engine on the model installs 200 adapter versions in place (two
  alternating adapters of random values, by `rft_load_checkpoint` as a checkpoint sync does, after 5
  warm-up installs): the resident memory of its worker after, minus before; `install_s` the median
  install.

The PNG (--png, default runs/bench-lora.png) draws each figure of both runs side by side: sync
bytes, sync time, trainer step, peak RSS and held-out gain.

--quick: 8 trainer steps, 64 held-out problems; --smoke (CI): the LoRA run alone (bench.real's smoke
runs the full one: the same code), 1 step of 2 tasks x 4 rollouts of up to 16 tokens (bench.real's
smoke sizes), no held-out scoring (the gains are null), 20 installs; the full run's figures are
null but its sync bytes, which come from the model's shapes. Its figures say nothing about learning.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

SMOKE = [  # bench.real's smoke sizes (tests/flows/test_demo_real.py), the KV cache as small
    "explorer.batch_size=2",
    "algorithm.repeat_times=4",
    "trainer.micro_batch_size=8",
    "explorer.sampling.max_tokens=16",
    "explorer.engine.kv_cache_space_gib=0.25",
]


class LoraBench:
    """What bench.lora keeps of one `demo_real` run (its `bench` hooks): the peak RSS is sampled over
    the run alone (its engine and trainer), not over the held-out scorings around it."""

    def engines(self) -> Any:
        from bench.real import PeakRss

        self.rss = PeakRss()
        return self.rss

    def run_done(self, summary: dict[str, Any]) -> None:
        from bench.real import run_figures
        from rl_engine.run.timeline import load_spans

        self.summary, self.figures = summary, run_figures(summary)
        train = [s.duration for s in load_spans(summary["run"]) if s.component == "trainer" and s.kind == "train"]
        self.figures["trainer_step_s"] = statistics.median(train)

    def scored(self, cfg: Any, before: dict[str, float], after: dict[str, float]) -> None:
        self.cfg, self.before, self.after = cfg, before, after


def sync_bytes(model: Any) -> int:
    """Bytes of one weight sync of a run of `model` (a config's `model` section): every parameter,
    or with LoRA's `sync: adapter` the adapter's tensors."""
    import math

    import torch

    from rl_engine.adapter import adapter_shapes, model_shapes, synced_adapter

    shapes = model_shapes(model.path)
    if (lora := synced_adapter(model.lora)) is not None:
        shapes = adapter_shapes(shapes, lora)
    size = torch.empty(0, dtype=getattr(torch, model.dtype)).element_size()
    return sum(size * math.prod(s) for s in shapes.values())


def engine_growth(cfg: Any, installs: int, root: str) -> dict[str, float]:
    """A LoRA engine on `cfg`'s model installing `installs` adapter versions in place: its worker's
    resident memory growth (MB) and the median install (s)."""
    import torch
    from safetensors.torch import save_file

    from rl_engine.adapter import WEIGHTS_FILE, adapter_shapes, model_shapes, wire_name
    from rl_engine.rollout.engine import build_rollout_engine

    shapes = adapter_shapes(model_shapes(cfg.model.path), cfg.model.lora)
    dirs = []
    for i in range(2):  # two adapters of random values, installed by turns
        d, g = os.path.join(root, f"bench-lora-adapter-{i}"), torch.Generator().manual_seed(i)
        os.makedirs(d, exist_ok=True)
        save_file(
            {wire_name(n): torch.randn(s, generator=g) * 0.01 for n, s in shapes.items()}, os.path.join(d, WEIGHTS_FILE)
        )
        dirs.append(d)
    engine = build_rollout_engine(cfg)
    try:
        for v in range(1, 6):
            engine.rpc("rft_load_checkpoint", dirs[v % 2], v)
        before, times = engine.worker_rss(), []
        for v in range(6, 6 + installs):
            t0 = time.perf_counter()
            engine.rpc("rft_load_checkpoint", dirs[v % 2], v)
            times.append(time.perf_counter() - t0)
        return {"engine_mem_growth_mb": (engine.worker_rss() - before) / 2**20, "install_s": statistics.median(times)}
    finally:
        engine.close()


def trainer_rss(config: str, steps: int = 2) -> float:
    """Resident memory (GB) of this process after `steps` trainer steps of `config` on its real
    batch shape (explorer.batch_size x repeat_times sequences of a 45-token prompt and the
    sampling's max_tokens), the trainer alone: what LoRA saves on the trainer's side. Run in a
    process of its own (`--trainer-rss CONFIG`), so nothing else's memory is counted."""
    import psutil

    from bench.train import synthetic_batch
    from rl_engine.config import load_config
    from rl_engine.trainer import build_trainer, trainer_settings

    cfg = load_config(config, ["model.path=runs/models/smollm2-135m", "taskset.path=unused.jsonl"])
    trainer = build_trainer(trainer_settings(cfg))
    rows, prompt = cfg.explorer.batch_size * cfg.algorithm.repeat_times, 45
    length = prompt + cfg.explorer.sampling.max_tokens
    batch = synthetic_batch(rows, length, trainer.pad_token_id, prompt=prompt, group=cfg.algorithm.repeat_times)
    peak = 0
    for _ in range(steps):
        trainer.train_step(batch)
        peak = max(peak, psutil.Process().memory_info().rss)
    return peak / 2**30


def trainer_rss_alone(config: str) -> float:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "bench.lora", "--trainer-rss", str(config)],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["trainer_rss_gb"]


RESULT = "bench.lora run: "  # the line a run's process ends with (its row as JSON)


def one_run(name: str, root: str, steps: int, heldout_n: int | None, smoke: bool) -> dict[str, Any]:
    """One `demo_real` run of `name`'s config (full or lora) measured: its table row, its run
    directory and the held-out problems scored."""
    from cli.demo_real import LORA_CONFIG, REAL_CONFIG, demo_real

    bench = LoraBench()
    rc = demo_real(
        root,
        [f"trainer.total_steps={steps}", f"trainer.checkpoint_interval={steps}", *(SMOKE if smoke else [])],
        heldout_n,
        bench=bench,
        config={"full": REAL_CONFIG, "lora": LORA_CONFIG}[name],
    )
    if rc != 0:
        raise SystemExit(rc)
    f, scored = bench.figures, bench.before is not None
    row = {
        "run": name,
        "held_out_before": bench.before["greedy_exact"] if scored else None,
        "held_out_after": bench.after["greedy_exact"] if scored else None,
        "gain_points": 100 * (bench.after["greedy_exact"] - bench.before["greedy_exact"]) if scored else None,
        "s_per_step": f["s_per_step"],
        "trainer_step_s": f["trainer_step_s"],
        "sync_s_trainer": f["sync_s_trainer"],
        "sync_s_explorer": f["sync_s_explorer"],
        "sync_mb": sync_bytes(bench.cfg.model) / 2**20,
        "peak_rss_gb": bench.rss.peak / 2**30,
        "peak_trainer_gb": bench.rss.peak_self / 2**30,
        "peak_engine_gb": bench.rss.peak_children / 2**30,
    }
    return {"row": row, "run": bench.summary["run"], "heldout_tasks": int(bench.before["tasks"]) if scored else 0}


PANELS = (  # (JSON key stem, axis label): a panel each, full fine-tuning beside LoRA
    ("sync_mb", "MB a weight sync sends"),
    ("sync_s", "s a weight sync (send + install)"),
    ("trainer_step_s", "s a trainer step"),
    ("peak_rss_gb", "peak RSS of the run, GB"),
    ("heldout_gain", "held-out gain, points"),
)


COLOURS = {"full": "tab:gray", "lora": "tab:blue"}


def write_png(figures: dict[str, Any], title: str, path: str) -> None:
    """One bar panel per PANELS figure (`<stem>_full`, `<stem>_lora` of the JSON line); a figure a
    run lacks (--smoke's full run) is left out of its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.2 * len(PANELS), 3.4))
    for ax, (stem, label) in zip(axes, PANELS):
        bars = [(name, figures[f"{stem}_{name}"]) for name in ("full", "lora") if figures[f"{stem}_{name}"] is not None]
        ax.bar([n for n, _ in bars], [v for _, v in bars], color=[COLOURS[n] for n, _ in bars])
        for i, (_, v) in enumerate(bars):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
        if not bars:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([]), ax.set_yticks([])
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_alone(name: str, argv: list[str]) -> dict[str, Any]:
    """`one_run(name)` in a process of its own (this command's arguments, and `--one name`), its
    output passed through; what it measured."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.lora", *argv, "--one", name], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    last = None
    for line in proc.stdout:
        if line.startswith(RESULT):
            last = json.loads(line[len(RESULT) :])
        else:
            sys.stdout.write(line)
    if proc.wait() != 0 or last is None:
        raise SystemExit(f"bench.lora: the {name} run failed (exit code {proc.returncode}); its output is above")
    return last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="8 trainer steps, 64 held-out problems")
    size.add_argument("--smoke", action="store_true", help="CI smoke test: 1 step, no held-out scoring, 20 installs")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 30; 8 with --quick)")
    ap.add_argument("--heldout", type=int, default=None, help="held-out problems scored (default all 320)")
    ap.add_argument("--root", default="runs", help="where the model, tasks and runs go (default ./runs)")
    ap.add_argument(
        "--png", default="runs/bench-lora.png", help="the figures as bar charts (default runs/bench-lora.png)"
    )
    ap.add_argument("--trainer-rss", metavar="CONFIG", help=argparse.SUPPRESS)  # one trainer's memory alone
    ap.add_argument("--one", choices=("full", "lora"), help=argparse.SUPPRESS)  # one run, in a process of its own
    a = ap.parse_args()
    if a.trainer_rss:
        print(json.dumps({"trainer_rss_gb": trainer_rss(a.trainer_rss)}))
        return
    steps = a.steps or (1 if a.smoke else 8 if a.quick else 30)
    heldout_n = 0 if a.smoke else a.heldout or (64 if a.quick else None)
    installs = 20 if a.smoke else 200

    from bench._report import emit_json, print_table
    from cli.demo_real import LORA_CONFIG, REAL_CONFIG
    from rl_engine.run.context import open_run

    if a.one:  # one run in this process of its own: its row on the last line
        print(RESULT + json.dumps(one_run(a.one, a.root, steps, heldout_n, a.smoke)), flush=True)
        return
    started = time.time()
    # Each run in a process of its own, so its peak RSS is its own: one after another in one
    # process, the second carried what the first left allocated (1.11x for LoRA after full).
    results = {name: run_alone(name, sys.argv[1:]) for name in (("lora",) if a.smoke else ("full", "lora"))}
    rows = {name: r["row"] for name, r in results.items()}
    lora_cfg = open_run(results["lora"]["run"]).cfg
    if "full" not in rows:  # --smoke: the full run's sync bytes alone, from the model's shapes
        rows["full"] = dict.fromkeys(rows["lora"]) | {
            "run": "full (not run)",
            "sync_mb": sync_bytes(lora_cfg.model.model_copy(update={"lora": None})) / 2**20,
        }
    engine = engine_growth(lora_cfg, installs, a.root)
    alone = (
        {}
        if a.smoke
        else {name: trainer_rss_alone(config) for name, config in (("full", REAL_CONFIG), ("lora", LORA_CONFIG))}
    )
    full, lora = rows["full"], rows["lora"]
    heldout_tasks = results["lora"]["heldout_tasks"]
    print_table(
        [full, lora],
        title=f"bench.lora: SmolLM2-135M-Instruct, word arithmetic, {steps} trainer steps, {heldout_tasks} held-out problems",
    )
    print_table([engine], title=f"a LoRA engine installing {installs} adapter versions in place")

    def sync_s(row: dict[str, Any]) -> float | None:  # a 1-step run syncs nothing
        parts = (row["sync_s_trainer"], row["sync_s_explorer"])
        return None if None in parts else round(sum(parts), 3)

    def points(x: float | None) -> float | None:
        return None if x is None else round(x, 1)

    def num(x: float | None, digits: int = 2) -> float | None:  # --smoke's full figures are null
        return None if x is None else round(x, digits)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b, 3)

    figures = {
        "steps": steps,
        "heldout_tasks": heldout_tasks,
        "adapter_sync_bytes_ratio": round(lora["sync_mb"] / full["sync_mb"], 4),
        "sync_mb_lora": round(lora["sync_mb"], 2),
        "sync_mb_full": round(full["sync_mb"], 2),
        "sync_s_lora": sync_s(lora),
        "sync_s_full": sync_s(full),
        "trainer_step_s_lora": round(lora["trainer_step_s"], 3),
        "trainer_step_s_full": num(full["trainer_step_s"], 3),
        "s_per_step_lora": round(lora["s_per_step"], 3),
        "s_per_step_full": num(full["s_per_step"], 3),
        "peak_rss_ratio": ratio(lora["peak_rss_gb"], full["peak_rss_gb"]),
        "peak_rss_gb_lora": round(lora["peak_rss_gb"], 2),
        "peak_rss_gb_full": num(full["peak_rss_gb"]),
        "peak_trainer_gb_lora": round(lora["peak_trainer_gb"], 2),
        "peak_trainer_gb_full": num(full["peak_trainer_gb"]),
        "peak_engine_gb_lora": round(lora["peak_engine_gb"], 2),
        "peak_engine_gb_full": num(full["peak_engine_gb"]),
        # The bound of peak_rss_ratio on this engine: LoRA's run with the plain engine's memory (its
        # trainer-side saving alone), against full's. The engine's LoRA buffers are the difference.
        "peak_rss_ratio_bound": None
        if full["peak_engine_gb"] is None
        else ratio(lora["peak_trainer_gb"] + full["peak_engine_gb"], full["peak_trainer_gb"] + full["peak_engine_gb"]),
        **(
            {
                "trainer_rss_gb_full": round(alone["full"], 2),
                "trainer_rss_gb_lora": round(alone["lora"], 2),
                "trainer_rss_ratio": round(alone["lora"] / alone["full"], 3),
            }
            if alone
            else {}
        ),
        "heldout_gain_lora": points(lora["gain_points"]),
        "heldout_gain_full": points(full["gain_points"]),
        "held_out_before": full["held_out_before"],
        "engine_mem_growth_mb": round(engine["engine_mem_growth_mb"], 2),
        "install_s": round(engine["install_s"], 4),
        "installs": installs,
        "bench_s": round(time.time() - started, 1),
    }
    write_png(figures, f"LoRA against full fine-tuning, SmolLM2-135M-Instruct, {steps} steps", a.png)
    print(f"bars: {a.png}")
    emit_json(figures)


if __name__ == "__main__":
    main()
