"""Where an explorer's vLLM engine start goes, and what an engine server saves of it.

    python -m bench.engine_start [--quick | --smoke]

Each measured start runs in a fresh Python process, as a run's first engine does: it imports torch
and vLLM, builds the explorer's engine (`build_rollout_engine`, the demo's tiny model) and makes
vLLM's first generate call (the warm-up the explorer takes before its first step). The parts, on
one clock (process start times from /proc, to the clock tick):

    imports        torch + vLLM in the explorer's process
    to_worker      LLM(): config resolution and the EngineCore's set-up (in the explorer's process
                   on CPU, rl_engine.rollout.engine) until vLLM's worker process exists (spawned)
    worker         the worker process: its own Python, torch and vLLM imports, model load, KV cache,
                   vLLM's profile run, until LLM() returns
    warm_up        vLLM's first generate call
    engine_start   imports excluded: to_worker + worker + warm_up (the explorer's `engine_start`
                   span; the imports happen while a run is set up)

vLLM's own figures, from its log: `load_weights_s` (model weights) and `init_engine_s` (profile,
KV cache, warm-up inside the worker). Then, with one `rft engine serve` of the same config up,
`served_start_s`: what the explorer's start costs with `explorer.engine.servers` (the client, its
claim, the base weights loaded again, its first generate), in a fresh process too.

Last, the command a user types: `rft run` of a synchronous run of that model (one trainer step,
an arithmetic task set), timed from the command's start to its first rollout's start (the run's
timeline): `rft_run_to_roles_s` until the roles begin (CLI, preflight, the ephemeral Prefect
server, the flow), `rft_run_to_first_rollout_s` until the first rollout, and the same with the
engine server (`served_rft_run_to_first_rollout_s`). Goal (issue 25): <= 15 s on a warm machine.
--smoke times the served run only (the local one is the same command and costs ~35 s more), and
runs it before the served starts: its rollouts are the server's first generate calls, the warm-up
that a full run spends one uncounted served start on. `--engine-server URL` uses an engine server
already up (the tiny model's, max_model_len >= 128; the smoke test passes the session's) instead of
starting one.

JSON keys: `engine_start_s`, `served_start_s`, `engine_start_saved_s`, one `<part>_s` per part
above (medians) and `load_weights_s`, `init_engine_s`; `rft_run_to_roles_s`,
`rft_run_to_first_rollout_s` (null with --smoke), `served_rft_run_to_roles_s`,
`served_rft_run_to_first_rollout_s`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from bench._report import emit_json, print_table

PARTS = ("imports", "to_worker", "worker", "warm_up")

# Run in a fresh interpreter: prints one JSON line of time.time() marks.
_LOCAL = r"""
import json, sys, time
def main():
    t = {"start": float(sys.argv[2])}
    import torch, vllm  # noqa: F401
    t["imported"] = time.time()
    from rl_engine.config import load_config
    from rl_engine.roles.explorer import warm_up
    from rl_engine.rollout.engine import build_rollout_engine
    cfg = load_config(sys.argv[1])
    t["llm"] = time.time()
    engine = build_rollout_engine(cfg, 0)
    t["ready"] = time.time()
    warm_up(engine, cfg.explorer.sampling)
    t["warm"] = time.time()
    from bench.ops import _started_at
    t["worker"] = min(_started_at(p.pid) for p, _ in engine._procs.workers)
    print("MARKS " + json.dumps(t), flush=True)
    engine.close()
if __name__ == "__main__":
    main()
"""

_SERVED = r"""
import json, sys, time
def main():
    t = {"start": time.time()}
    from rl_engine.config import load_config
    from rl_engine.roles.explorer import EnginePool, warm_up
    from rl_engine.run.context import RunContext
    cfg = load_config(sys.argv[1], [f'explorer.engine.servers=["{sys.argv[2]}"]'])
    t["begin"] = time.time()
    engine = EnginePool().acquire(RunContext(cfg=cfg, url="bench"), 0)
    warm_up(engine, cfg.explorer.sampling)
    t["ready"] = time.time()
    print("MARKS " + json.dumps(t), flush=True)
    engine.close()
if __name__ == "__main__":
    main()
"""


def _run(script: str, *args: str, log: Path) -> tuple[dict[str, float], str]:
    import time

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-c", script, *args, *([str(t0)] if script is _LOCAL else [])],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    out = p.stdout + p.stderr
    log.write_text(out)
    marks = [json.loads(line[6:]) for line in p.stdout.splitlines() if line.startswith("MARKS ")]
    if p.returncode != 0 or not marks:
        raise RuntimeError(f"engine start failed (exit {p.returncode}); its output is in {log}:\n{out[-3000:]}")
    return marks[0], out


def _local_parts(m: dict[str, float], out: str) -> dict[str, float]:
    # The interpreter's own start (before `start` was taken in the parent) counts as imports.
    parts = {
        "imports": m["imported"] - m["start"],
        "to_worker": m["worker"] - m["llm"],
        "worker": m["ready"] - m["worker"],
        "warm_up": m["warm"] - m["ready"],
    }
    vllm = {}
    for key, pattern in (
        ("load_weights", r"Loading weights took ([\d.]+) seconds"),
        ("init_engine", r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    ):
        found = re.findall(pattern, out)
        vllm[key] = float(found[-1]) if found else float("nan")
    return (
        {f"{k}_s": v for k, v in parts.items()}
        | {"engine_start_s": sum(v for k, v in parts.items() if k != "imports")}
        | {f"{k}_s": v for k, v in vllm.items()}
    )


def _rft_run(cfg: str, log: Path, *overrides: str) -> dict[str, float]:
    """`rft run CFG` (one trainer step) in a fresh process: seconds from its start to the roles'
    first span and to the first rollout's start, read from the run's timeline."""
    import time

    from rl_engine.run.timeline import load_spans

    sets = [a for o in ("trainer.total_steps=1", *overrides) for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "VLLM_CPU_KVCACHE_SPACE"}
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", cfg, *sets],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    log.write_text(p.stdout + p.stderr)
    run = re.search(r"^run (\S+): engine and library logs", p.stdout, re.MULTILINE)
    if p.returncode != 0 or run is None:
        raise RuntimeError(
            f"rft run failed (exit {p.returncode}); its output is in {log}:\n{(p.stdout + p.stderr)[-3000:]}"
        )
    spans = load_spans(run.group(1))
    rollout = min(s.start for s in spans if s.kind == "rollout")
    return {"to_roles": min(s.start for s in spans) - t0, "to_first_rollout": rollout - t0}


def main(argv: list[str] | None = None) -> int:
    from harness.engine_server import engine_server
    from harness.runs import write_config

    ap = argparse.ArgumentParser(prog="python -m bench.engine_start", description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="two starts of each kind instead of three")
    size.add_argument("--smoke", action="store_true", help="CI smoke test: one of each")
    ap.add_argument(
        "--engine-server",
        metavar="URL",
        default=None,
        help="an `rft engine serve` of the tiny model already up (max_model_len >= 128): the served starts and runs use it",
    )
    args = ap.parse_args(argv)
    n = 1 if args.smoke else 2 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="rft-bench-engine-start-") as tmp:
        root = Path(tmp)
        from rl_engine.tiny_model import make_tiny_model

        model = str(make_tiny_model(root / "model", seed=0))
        from rl_engine.demos.arithmetic import write_arithmetic_taskset

        tasks = str(root / "tasks.jsonl")
        write_arithmetic_taskset(tasks, n=64, seed=1)
        cfg = write_config(
            root / "config.yaml",
            {
                "model": {"path": model, "max_model_len": 128},
                "taskset": {
                    "path": tasks,
                    "prompt_key": "question",
                    "answer_key": "answer",
                    "reward": {"type": "arithmetic"},
                },
                "explorer": {"batch_size": 4, "engine": {"kv_cache_space_gib": 0.25}, "sampling": {"max_tokens": 8}},
                "algorithm": {"repeat_times": 4},
                "trainer": {"micro_batch_size": 16},
                "buffer": {"storage": {"url": str(root / "runs")}},
            },
        )
        local = [_local_parts(*_run(_LOCAL, cfg, log=root / f"local-{i}.log")) for i in range(n)]
        cli = [] if args.smoke else [_rft_run(cfg, root / f"rft-run-{i}.log") for i in range(n)]
        up = (
            contextlib.nullcontext(SimpleNamespace(url=args.engine_server))
            if args.engine_server
            else engine_server(cfg, root / "logs")
        )
        with up as srv:

            def served_runs() -> list[dict[str, float]]:
                return [
                    _rft_run(cfg, root / f"rft-run-served-{i}.log", f'explorer.engine.servers=["{srv.url}"]')
                    for i in range(n)
                ]

            served_cli = served_runs() if args.smoke else []  # its rollouts warm the server up
            served = []
            for i in range(n if args.smoke else n + 1):  # else the first pays the server's warm-up: not counted
                m, _ = _run(_SERVED, cfg, srv.url, log=root / f"served-{i}.log")
                served.append(m["ready"] - m["begin"])
            if not args.smoke:
                served = served[1:]
                served_cli = served_runs()
    rows = [
        {"start": f"local {i + 1}", **{k.removesuffix("_s"): round(v, 3) for k, v in r.items()}}
        for i, r in enumerate(local)
    ]
    rows += [{"start": f"served {i + 1}", "engine_start": round(s, 3)} for i, s in enumerate(served)]
    print_table(
        rows, title="explorer engine start, seconds (fresh process each; tiny model; engine_start excludes imports)"
    )
    med = {k: round(statistics.median(r[k] for r in local), 3) for k in local[0]}
    served_s = round(statistics.median(served), 3)
    print(
        f"engine server kept up: the explorer's start is {served_s:.2f} s instead of {med['engine_start_s']:.2f} s (+{med['imports_s']:.1f} s of imports it shares with the run's set-up)"
    )
    runs = [
        {"rft run": f"{kind} {i + 1}", **{k: round(v, 2) for k, v in r.items()}}
        for kind, rs in (("local", cli), ("served", served_cli))
        for i, r in enumerate(rs)
    ]
    print_table(
        runs, title="`rft run` (synchronous, 1 step): seconds from the command's start (goal: first rollout <= 15 s)"
    )
    cli_med = {
        f"rft_run_{k}_s": (round(statistics.median(r[k] for r in cli), 2) if cli else None)
        for k in ("to_roles", "to_first_rollout")
    }
    served_med = {
        f"served_rft_run_{k}_s": round(statistics.median(r[k] for r in served_cli), 2)
        for k in ("to_roles", "to_first_rollout")
    }
    emit_json(
        med
        | {"served_start_s": served_s, "engine_start_saved_s": round(med["engine_start_s"] - served_s, 3), "starts": n}
        | cli_med
        | served_med
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
