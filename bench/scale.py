"""Cost curves as a run scales: explorers, buffer commits, model size; and a projection (issue 25 item 4).

    python -m bench.scale [--quick | --smoke] [--png FILE]

Three measured curves, then a projection:

explorers   multi_explorer runs with 1 (fully_async: the same ideal), 2, 4, 8, 16 explorers (--quick: 1, 4, 16; --smoke: 1, 2)
            under the SYNTHETIC COST MODEL (bench.cost_model: rollout R, train T, weight load S
            are sleeps) with everything else real: the Prefect flow and tasks on a real
            `prefect server start` (its own process), the buffer, board, timeline and checkpoints
            on S3 (a `moto_server` process on loopback). Placement LOCAL: every role is a task of
            one flow run in this process (the cost model patches this process; deployments would
            start one torch-importing process per role, 17 on 2 cores, and the roles there would
            run the real engines). Per trainer step, over the steady state (trainer step 2 to the
            last, as bench.modes): step time, orchestration overhead = step time - ideal
            max(R / N, T) (the cost model's known costs), storage requests (the lines of moto's
            access log: every S3 request of every role), Prefect API calls (the server's uvicorn
            access log lines, PREFECT_SERVER_LOGGING_LEVEL=INFO) and the server's CPU seconds
            (psutil, the server process and its children), and moto's CPU seconds (the S3 stand-in
            shares the machine's cores with the run). A sampler thread reads the counters
            every 0.2 s; the steady-state window's figures are interpolated between samples.
commits     a trainer's poll (nothing new) and commit-then-read_batch(256), and the full listing a
            reader makes at start, with 10 to 100,000 commits consumed (bench.buffer's measurement,
            local disk; --quick up to 10,000, --smoke up to 1,000).
model size  synthetic fp32 tensors of 1M, 10M, 100M, 500M parameters (--quick: up to 100M;
            --smoke: 1M, 10M), no model load, no engine: a full checkpoint published and
            received (the real CheckpointSender / CheckpointReceiver on local disk: write, commit,
            CRC check; the engine's in-place load is a no-op stub), the collective broadcast
            between two processes (rl_engine.sync.buckets.broadcast_send / broadcast_recv over
            gloo, received into fresh memory, nothing loaded), and a delta checkpoint (bfloat16,
            one Adam step at lr 1e-6, rl_engine.sync.delta) against the full bfloat16 one.
projection  linear fits (numpy.polyfit) of the measured curves, printed as PROJECTED (NOT
            MEASURED): 64 explorers, and a 7B model in bfloat16 (2 bytes/param, 14 GB).

Last line: JSON with overhead_per_step / step_s / storage_requests_per_step / api_calls_per_step /
server_cpu_s_per_step ({explorers: value}), overhead_ratio_max_over_1 (goal <= 1.2), poll_ms /
read_batch_ms / full_listing_ms ({commits: value}), sync_s ({method: {params: s}}), sync_s_per_gb
({method: fitted seconds per GB}), delta_bytes_ratio (delta / full bfloat16 checkpoint bytes at the
largest size), projected, png.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from bench._report import emit_json, print_table

R_S, T_S, S_S = 0.4, 0.4, 0.02  # the cost model: rollout, train step, weight load (sleeps)
GB = 1e9


# ------------------------------------------------------------------ counters


class LineCounter:
    """Lines of a growing log file that match `pattern`, counted incrementally."""

    def __init__(self, path: Path, pattern: str):
        self.path, self.re, self.pos, self.count, self.rest = path, re.compile(pattern.encode()), 0, 0, b""

    def read(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return self.count
        self.pos += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        self.count += sum(1 for ln in lines if self.re.search(ln))
        return self.count


class Sampler(threading.Thread):
    """(time, storage requests, API calls, server CPU s, moto CPU s) every `every` seconds, until stopped."""

    def __init__(self, moto: LineCounter, api: LineCounter, server_pid: int, moto_pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        import psutil

        self.moto, self.api, self.proc, self.moto_proc, self.every = (
            moto,
            api,
            psutil.Process(server_pid),
            psutil.Process(moto_pid),
            every,
        )
        self.samples: list[tuple[float, float, float, float, float]] = []
        self.done = threading.Event()

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        kids = 0.0
        for c in self.proc.children(recursive=True):
            try:
                ct = c.cpu_times()
                kids += ct.user + ct.system
            except Exception:  # noqa: BLE001 - a child gone between listing and reading
                pass
        return t.user + t.system + kids

    def sample(self) -> None:
        m = self.moto_proc.cpu_times()
        self.samples.append((time.time(), self.moto.read(), self.api.read(), self.cpu(), m.user + m.system))

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.every)
        self.sample()

    def at(self, t: float) -> np.ndarray:
        s = np.array(self.samples)
        return np.array([np.interp(t, s[:, 0], s[:, i]) for i in (1, 2, 3, 4)])


def start_moto(root: Path) -> tuple[subprocess.Popen, dict, LineCounter]:
    """`moto_server` on a free loopback port, its access log in a file; (process, storage options, request counter)."""
    from harness.prefect_live import VENV_BIN, reap_with_this_process
    from rl_engine.trainer.dist import free_port

    for k, v in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    port = free_port()
    log = root / "moto.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    reap_with_this_process(proc)
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    import httpx

    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"moto_server did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.3)
    return proc, options, LineCounter(log, r'"(GET|PUT|POST|HEAD|DELETE) [^"]* HTTP/1\.[01]" \d{3}')


# ------------------------------------------------------------------ explorers


def explorer_run(n: int, steps: int, model: str, tasks: str, url: str, options: dict, sampler: Sampler) -> dict:
    from bench.modes import ideal_step, steady_state
    from cli.run import run_config
    from harness.runs import small_config
    from rl_engine.config import validate_config
    from rl_engine.run.timeline import load_spans

    mode = (
        "multi_explorer" if n > 1 else "fully_async"
    )  # multi_explorer needs 2 or more; one explorer is fully_async (same ideal)
    data = small_config(
        model,
        tasks,
        url,
        total_steps=steps,
        checkpoint_interval=steps,
        name=f"scale-x{n}",
        mode=mode,
        sync_method="checkpoint",
        count=n,
    )
    data["buffer"]["storage"]["options"] = options
    data["placement"] = {"type": "local"}
    data["explorer"]["engine"]["num_threads"] = 1
    data["trainer"]["num_threads"] = 1
    data["synchronizer"]["collective"].pop("port")
    cfg = validate_config(data)
    started = time.time()
    summary = run_config(cfg)
    wall = time.time() - started
    spans = load_spans(summary["run"], cfg.buffer.storage.fs_options())
    t0, t1, step_s, _ = steady_state(spans)
    k = len({round(s.end, 6) for s in spans if s.component == "trainer" and s.kind == "train"}) - 1  # steady steps
    (req0, api0, cpu0, moto0), (req1, api1, cpu1, moto1) = sampler.at(t0), sampler.at(t1)
    ideal = ideal_step("multi_explorer", R_S, T_S, S_S, n)
    return {
        "explorers": n,
        "mode": mode,
        "placement": "local",
        "step_s": step_s,
        "ideal_s": ideal,
        "overhead_s": step_s - ideal,
        "storage_req/step": float(req1 - req0) / k,
        "api_calls/step": float(api1 - api0) / k,
        "server_cpu_s/step": float(cpu1 - cpu0) / k,
        "moto_cpu_s/step": float(moto1 - moto0) / k,  # the S3 stand-in's CPU, on the same cores as the run
        "steady_steps": k,
        "wall_s": wall,
    }


def explorer_curve(counts: list[int], steps: int, root: Path) -> tuple[list[dict], str | None]:
    """The explorer runs on a real Prefect server and S3 (moto) process; (rows, why api calls are unknown or None)."""
    import s3fs
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bench import cost_model
    from harness.prefect_live import start_server
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.tiny_model import make_tiny_model

    model = str(make_tiny_model(root / "model"))
    tasks = str(root / "tasks.jsonl")
    write_arithmetic_taskset(tasks, n=500, seed=0)
    cost_model.install(R_S, T_S, S_S)
    moto, options, requests = start_moto(root)
    server = start_server(  # SQLite: the sampler counts the server's process, which then does the database's work too
        root / "prefect",
        ui=False,
        db="sqlite",
        PREFECT_SERVER_LOGGING_LEVEL="INFO",
        PREFECT_LOGGING_SERVER_LEVEL="INFO",
    )
    api = LineCounter(server.log_path, r'"(GET|POST|PUT|PATCH|DELETE) /api/[^"]*HTTP/1\.[01]" \d{3}')
    try:
        bucket = "scale"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        sampler = Sampler(requests, api, server.proc.pid, moto.pid)
        sampler.start()
        rows = []
        try:
            with temporary_settings({PREFECT_API_URL: server.api_url}):
                for n in counts:
                    rows.append(explorer_run(n, steps, model, tasks, f"s3://{bucket}/runs", options, sampler))
                    print_table(rows[-1:], title=f"explorers: {n}")
        finally:
            sampler.done.set()
            sampler.join()
        why = (
            None
            if api.count
            else "no access lines in the Prefect server's log (uvicorn access log not on at this logging level)"
        )
        if why:
            for r in rows:
                r["api_calls/step"] = None
        return rows, why
    finally:
        # The runs' log records still queued for the API go while the server is up: queued at exit,
        # the log worker retried the stopped server for ~70 s before the process could end.
        APILogWorker.drain_all(timeout=10)
        server.stop()
        moto.terminate()
        moto.wait(10)


# ------------------------------------------------------------------ commits


def commits_curve(counts: list[int], polls: int, reads: int) -> list[dict]:
    from bench.buffer import BATCH, _poll_cost
    from rl_engine.buffer.synthetic import make_batch

    tables = [make_batch(BATCH, prompt_len=512, response_len=1024, explorer_step=1, seed=0).to_table()]
    got: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-commits-") as tmp:
        for n in counts:
            if n <= 10:
                continue
            cost = _poll_cost(tmp, {}, n, tables, polls, reads)
            got.setdefault(10, cost[10])
            got[n] = cost[n]
    return [
        {
            "commits": n,
            "storage": "local",
            "poll_ms": c["poll"] * 1e3,
            "read_batch_ms": c["read_batch"] * 1e3,
            "full_listing_ms": c["full listing"] * 1e3,
        }
        for n, c in sorted(got.items())
    ]


# ------------------------------------------------------------------ model size


def synthetic_weights(params: int, dtype=None) -> dict:
    """`params` float parameters as tensors of at most 4M elements (layer-sized), seeded."""
    import torch

    g = torch.Generator().manual_seed(0)
    out, left, i = {}, params, 0
    while left > 0:
        k = min(left, 4 << 20)
        out[f"layers.{i}.weight"] = (torch.randn(k, generator=g) * 0.02).to(dtype or torch.float32)
        left, i = left - k, i + 1
    return out


def _receiver_main(port: int, sizes: list[int], repeats: int) -> None:
    """Rank 1 of the collective: receive every broadcast (fresh memory, nothing loaded)."""
    import torch

    from rl_engine.sync.buckets import broadcast_recv, destroy_group, init_group

    pg = init_group("127.0.0.1", port, 1, 2, "gloo", 600)
    for _ in range(1 + len(sizes) * repeats):
        broadcast_recv(pg, torch.device("cpu"), lambda items: None)
    destroy_group(pg)


class Collective:
    """A gloo group with a receiving process (spawned), for timed broadcasts from this one."""

    def __init__(self, sizes: list[int], repeats: int):
        import multiprocessing as mp

        from rl_engine.sync.buckets import init_group
        from rl_engine.trainer.dist import free_port

        port = free_port()
        self.proc = mp.get_context("spawn").Process(target=_receiver_main, args=(port, sizes, repeats), daemon=True)
        self.proc.start()
        self.pg = init_group("127.0.0.1", port, 0, 2, "gloo", 600)
        self.send(synthetic_weights(1000), 0)  # warm-up, untimed

    def send(self, weights: dict, version: int) -> float:
        import torch

        from rl_engine.config import CollectiveConfig
        from rl_engine.sync.buckets import broadcast_send

        t0 = time.perf_counter()
        broadcast_send(
            self.pg,
            weights.items(),
            version,
            int(CollectiveConfig().bucket_mb * (1 << 20)),
            torch.float32,
            torch.device("cpu"),
        )
        return time.perf_counter() - t0

    def close(self) -> None:
        from rl_engine.sync.buckets import destroy_group

        destroy_group(self.pg)
        self.proc.join(60)


def _ckpt_config(model: str, run_root: str, delta: bool, dtype: str):
    from bench.sync import _config

    return _config(model, run_root, "checkpoint", 29517, delta=delta, dtype=dtype)


def checkpoint_sync(
    model: str, run_root: str, weights: dict, versions: list[tuple[int, dict]], delta: bool, dtype: str
) -> list[tuple[float, int, str]]:
    """Publish and receive each (version, weights) through the real checkpoint sync; (seconds, bytes written, kind) each."""
    from bench.cost_model import CostModelEngine
    from bench.sync import _written
    from rl_engine.board import Board
    from rl_engine.sync import build_weight_receiver, build_weight_sender

    cfg = _ckpt_config(model, run_root, delta, dtype)
    board = Board.at(cfg.run_url)
    sender, receiver = build_weight_sender(cfg, board), build_weight_receiver(cfg, board)
    engine = CostModelEngine(cfg, 0, 0.0, 0.0)  # the in-place load is a no-op: write, commit, check, no engine
    out = []
    for v, w in versions:
        t0 = time.perf_counter()
        sender.send(w.items(), v)
        assert receiver.receive(engine, v) == v
        out.append(
            (time.perf_counter() - t0, _written(cfg.run_url, v), getattr(getattr(sender, "last", None), "kind", "full"))
        )
    shutil.rmtree(cfg.run_url, ignore_errors=True)
    return out


def delta_available() -> bool:
    try:
        import rl_engine.sync.delta  # noqa: F401
    except ImportError:
        return False
    return True


def model_curve(sizes: list[int], repeats: int, work: str) -> list[dict]:
    import torch

    from bench.sync import LLM_LR, adam_first_step
    from rl_engine.tiny_model import make_tiny_model

    model = str(make_tiny_model(os.path.join(work, "cfg-model")))  # its config.json goes with each checkpoint
    coll = Collective(sizes, repeats)
    rows = []
    try:
        for p in sizes:
            w = synthetic_weights(p)
            nbytes = sum(t.numel() * t.element_size() for t in w.values())
            c_s = statistics.median(coll.send(w, v + 1) for v in range(repeats))
            full = checkpoint_sync(
                model,
                os.path.join(work, f"full-{p}"),
                w,
                [(v, w) for v in range(repeats + 1)],
                delta=False,
                dtype="float32",
            )
            row = {
                "params": p,
                "fp32_MB": nbytes / 2**20,
                "collective_s": c_s,
                "checkpoint_full_s": statistics.median(s for s, _, _ in full[1:]),
                "full_MB_written": full[-1][1] / 2**20,
            }
            if delta_available():
                bf = lambda d: {k: t.to(torch.bfloat16) for k, t in d.items()}  # noqa: E731
                stepped, base = bf(adam_first_step(w, LLM_LR)), bf(w)  # one bfloat16 copy each (500M: 1 GB)
                seq = [
                    (v, stepped if v % 2 else base) for v in range(repeats + 2)
                ]  # v0 full, then one step forward, one back
                got = checkpoint_sync(model, os.path.join(work, f"delta-{p}"), w, seq, delta=True, dtype="bfloat16")
                full_bf16 = got[0][1]
                deltas = [(s, b) for s, b, kind in got[1:] if kind == "delta"]
                row.update(
                    bf16_full_MB=full_bf16 / 2**20,
                    checkpoint_full_bf16_s=got[0][0],
                    checkpoint_delta_s=statistics.median(s for s, _ in deltas) if deltas else None,
                    delta_MB_written=statistics.median(b for _, b in deltas) / 2**20 if deltas else None,
                    delta_bytes_ratio=statistics.median(b for _, b in deltas) / full_bf16 if deltas else None,
                )
                del stepped, base, seq
            rows.append(row)
            print_table(rows[-1:], title=f"model size {p / 1e6:g}M parameters")
            del w
    finally:
        coll.close()
    return rows


# ------------------------------------------------------------------ projection and figure


def _fit(xs: list[float], ys: list[float | None]) -> tuple[float, float] | None:
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) < 2:
        return None
    slope, intercept = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)
    return float(slope), float(intercept)


def project(ex: list[dict], models: list[dict]) -> tuple[list[dict], dict, dict]:
    """PROJECTED (NOT MEASURED) rows: 64 explorers from the explorer fits, a 7B bfloat16 model from the s/GB fits."""
    rows, proj = [], {}
    # One explorer runs fully_async (multi_explorer needs two): a different mode, left out of the fit when two or more multi_explorer points exist.
    multi = [r for r in ex if r["mode"] == "multi_explorer"]
    fitted = multi if len(multi) >= 2 else ex
    n = [r["explorers"] for r in fitted]
    for key, label in (
        ("overhead_s", "overhead_per_step"),
        ("storage_req/step", "storage_requests_per_step"),
        ("api_calls/step", "api_calls_per_step"),
        ("server_cpu_s/step", "server_cpu_s_per_step"),
    ):
        f = _fit(n, [r[key] for r in fitted])
        value = max(f[0] * 64 + f[1], 0.0) if f else None  # a cost is never below zero: a falling fit projects 0
        proj[f"{label}_at_64_explorers"] = value
        rows.append(
            {
                "what": f"{label} at 64 explorers",
                "value": value,
                "basis": f"linear fit over explorers {n}, floored at 0" if f else "too few points",
            }
        )
    per_gb: dict[str, float | None] = {}
    methods = {
        "collective": ("collective_s", "fp32_MB"),
        "checkpoint_full": ("checkpoint_full_s", "fp32_MB"),
        "checkpoint_delta": ("checkpoint_delta_s", "bf16_full_MB"),
    }
    for method, (key, mb) in methods.items():
        f = _fit([r.get(mb, 0) * 2**20 / GB for r in models], [r.get(key) for r in models])
        per_gb[method] = f[0] if f else None
        gb7 = 7e9 * 2 / GB  # bfloat16: 2 bytes per parameter
        value = f[0] * gb7 + f[1] if f else None
        proj[f"{method}_s_at_7B_bf16"] = value
        rows.append(
            {
                "what": f"{method} sync s, 7B bf16 ({gb7:.0f} GB)",
                "value": value,
                "basis": "linear fit of s vs GB (model size curve)" if f else "not measured",
            }
        )
    ratio = models[-1].get("delta_bytes_ratio") if models else None
    proj["delta_GB_at_7B_bf16"] = ratio * 14 if ratio is not None else None
    rows.append(
        {
            "what": "delta GB written per step, 7B bf16",
            "value": proj["delta_GB_at_7B_bf16"],
            "basis": "largest measured delta_bytes_ratio x 14 GB"
            if ratio is not None
            else "delta sync not available in this build",
        }
    )
    return rows, proj, per_gb


def plot(ex: list[dict], commits: list[dict], models: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    n = [r["explorers"] for r in ex]
    ax[0, 0].plot(n, [r["overhead_s"] for r in ex], "o-", label="overhead s/step")
    ax[0, 0].plot(n, [r["step_s"] for r in ex], "s--", label="step s")
    ax[0, 0].set(
        xscale="log",
        xlabel="explorers (local placement, cost model)",
        ylabel="seconds",
        title="trainer step and orchestration overhead",
    )
    ax[0, 0].legend()
    ax[0, 1].plot(n, [r["storage_req/step"] for r in ex], "o-", label="S3 requests/step")
    if all(r["api_calls/step"] is not None for r in ex):
        ax[0, 1].plot(n, [r["api_calls/step"] for r in ex], "s-", label="Prefect API calls/step")
    ax[0, 1].set(xscale="log", xlabel="explorers", ylabel="per trainer step", title="requests per step")
    ax[0, 1].legend()
    c = [r["commits"] for r in commits]
    for key in ("poll_ms", "read_batch_ms", "full_listing_ms"):
        ax[1, 0].plot(c, [r[key] for r in commits], "o-", label=key)
    ax[1, 0].set(
        xscale="log", yscale="log", xlabel="commits consumed (local disk)", ylabel="ms", title="buffer poll and read"
    )
    ax[1, 0].legend()
    p = [r["params"] for r in models]
    for key in ("collective_s", "checkpoint_full_s", "checkpoint_delta_s"):
        if all(r.get(key) is not None for r in models):
            ax[1, 1].plot(p, [r[key] for r in models], "o-", label=key)
    ax[1, 1].set(xscale="log", yscale="log", xlabel="parameters (synthetic tensors)", ylabel="s", title="weight sync")
    ax[1, 1].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="explorers 1, 4, 16; commits to 10,000; models to 100M")
    size.add_argument(
        "--smoke", action="store_true", help="CI smoke test: explorers 1, 2; commits to 1,000; models 1M, 10M"
    )
    ap.add_argument("--explorers", default=None, help="comma-separated explorer counts (default 1,2,4,8,16)")
    ap.add_argument("--png", default="runs/bench-scale.png", help="where to write the figure")
    a = ap.parse_args(argv)
    started = time.time()
    counts = (
        [int(x) for x in a.explorers.split(",")]
        if a.explorers
        else [1, 2]
        if a.smoke
        else [1, 4, 16]
        if a.quick
        else [1, 2, 4, 8, 16]
    )
    steps = 4 if a.smoke else 6 if a.quick else 10
    commits = [10, 100, 1000] if a.smoke else [10, 100, 1000, 10_000] if a.quick else [10, 100, 1000, 10_000, 100_000]
    polls, reads = (6, 2) if a.smoke else (40, 4) if a.quick else (100, 8)
    sizes = (
        [1_000_000, 10_000_000]
        if a.smoke
        else [1_000_000, 10_000_000, 100_000_000]
        if a.quick
        else [1_000_000, 10_000_000, 100_000_000, 500_000_000]
    )
    repeats = 1 if a.smoke else 3
    skipped = (
        []
        if not (a.smoke or a.quick)
        else [f"{'500M' if a.quick else '100M and 500M'} parameters (--{'quick' if a.quick else 'smoke'})"]
    )

    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        ex, api_why = explorer_curve(counts, steps, root)
        cm = commits_curve(commits, polls, reads)
        models = model_curve(sizes, repeats, str(root / "sync"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    label = f"SYNTHETIC COST MODEL R={R_S}s T={T_S}s S={S_S}s (sleeps); real Prefect server process, S3 = moto_server process; placement local"
    print_table(ex, title=f"explorers: multi_explorer, {steps} trainer steps, per steady-state step ({label})")
    if api_why:
        print(f"  api_calls/step: null ({api_why})")
    print()
    print_table(
        cm, title=f"buffer commits: poll (median of {polls}) and commit+read_batch(256) (median of {reads}), local disk"
    )
    print()
    print_table(
        models,
        title=f"model size: synthetic fp32 tensors, median of {repeats}; collective = gloo broadcast to a second process; checkpoint on local disk, no engine load"
        + ("" if delta_available() else "; delta sync not available in this build"),
    )
    if skipped:
        print(f"  skipped: {', '.join(skipped)}")
    proj_rows, proj, per_gb = project(ex, models)
    print()
    print_table(
        proj_rows, title="PROJECTED (NOT MEASURED): linear fits of the curves above; 7B in bfloat16 (2 bytes/param)"
    )
    plot(ex, cm, models, a.png)
    ov = {r["explorers"]: r["overhead_s"] for r in ex}
    base = ov[min(ov)]
    r4 = lambda v: round(v, 4) if isinstance(v, float) else v  # noqa: E731
    emit_json(
        {
            "bench": "scale",
            "smoke": a.smoke,
            "quick": a.quick,
            "workload": "synthetic cost model",
            "placement": "local",
            "steps": steps,
            "overhead_per_step": {str(n): r4(v) for n, v in ov.items()},
            "overhead_ratio_max_over_1": r4(max(ov.values()) / base) if base > 0 else None,
            "step_s": {str(r["explorers"]): r4(r["step_s"]) for r in ex},
            "storage_requests_per_step": {str(r["explorers"]): r4(r["storage_req/step"]) for r in ex},
            "api_calls_per_step": None if api_why else {str(r["explorers"]): r4(r["api_calls/step"]) for r in ex},
            "api_calls_null_reason": api_why,
            "server_cpu_s_per_step": {str(r["explorers"]): r4(r["server_cpu_s/step"]) for r in ex},
            "moto_cpu_s_per_step": {str(r["explorers"]): r4(r["moto_cpu_s/step"]) for r in ex},
            "poll_ms": {str(r["commits"]): r4(r["poll_ms"]) for r in cm},
            "read_batch_ms": {str(r["commits"]): r4(r["read_batch_ms"]) for r in cm},
            "full_listing_ms": {str(r["commits"]): r4(r["full_listing_ms"]) for r in cm},
            "sync_s": {
                m: {str(r["params"]): r4(r.get(k)) for r in models}
                for m, k in (
                    ("collective", "collective_s"),
                    ("checkpoint_full", "checkpoint_full_s"),
                    ("checkpoint_delta", "checkpoint_delta_s"),
                )
            },
            "sync_s_per_gb": {m: r4(v) for m, v in per_gb.items()},
            "delta_bytes_ratio": r4(models[-1].get("delta_bytes_ratio")) if models else None,
            "delta_note": None if delta_available() else "delta sync not available in this build",
            "projected": {k: r4(v) for k, v in proj.items()},
            "skipped": skipped,
            "png": a.png,
            "bench_s": round(time.time() - started, 1),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
