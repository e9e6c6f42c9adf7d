"""Ops benchmark (issue 10): from a REST call that starts a deployment's run to its first rollout;
and the Prefect server's database under those runs, SQLite against PostgreSQL (issue 44).

    python -m bench.ops --quick     # one measured run (after the warm-up run), on each database
    python -m bench.ops             # three measured runs, medians
    python -m bench.ops --db sqlite # one database only (postgres, sqlite, or both: the default)
    python -m bench.ops --smoke     # CI smoke test: one measured run, no warm-up run (a cold worker and cold caches)
    python -m bench.ops --smoke --attach API_URL --worker-log PATH [--model DIR --tasks FILE] [--engine-server URL START_S]
                        [--db NAME --server-log PATH]
                                    # the same against a server and worker already up, deployed (the tests' session ones)

Against a real `prefect server start` on loopback and a real process worker (harness/prefect_live.py),
with the project's deployments (`prefect deploy --all`, prefect.yaml): the `synchronous/synchronous`
deployment gets a tiny test config (PATCHed, as a UI user edits it), one run warms the worker and
the machine's caches, then each measured run is started with `POST /api/deployments/{id}/create_flow_run`
(`set` overrides only) and timed until its explorer's first `rollout` span starts (the run's
timeline, rl_engine/run/timeline.py). What that time is made of, on one clock (all on this host):

    api_call        the POST until it returned (the run is SCHEDULED)
    worker_pickup   until the worker took the run (PENDING, or its process started if that came first;
                    the worker polls every 2 s here)
    process_spawn   until the flow's process existed (its create time, from the role marker's pid)
    flow_import     until the flow began (RUNNING: Python, Prefect, the flow module imported)
    run_setup       until the explorer's engine began starting (overrides, preflight, run directory, roles)
    engine_start    the explorer's vLLM engine start with its first-call warm-up (span `engine_start`)
    to_rollout      from the engine being up to the first rollout starting

Then the same runs with the explorer's engine kept up between runs: an engine server (`rft engine
serve` on the deployment's config, rl_engine/rollout/server.py) that each run's explorer claims
(`set: explorer.engine.servers=[URL]`); its `engine_start` is the claim and the reset to the
run's base weights.

The whole sequence (warm-up run, measured runs, engine server runs) runs once per database: a
server of its own on SQLite (Prefect's default), then one on PostgreSQL (cli/prefect_db.py,
as `rft server` runs it; skipped, saying why, where the machine has none). While it goes, a probe
calls the API twice a second as a client would, `read_flow_runs` (`POST /flow_runs/filter`, the
newest 20) and `create_flow_run` (`POST /flow_runs/`, a flow run of a probe flow that no worker
takes), each timed alone, without retries; and the server's log is read for `database is locked`
(SQLite's one writer at a time: Prefect logs a traceback per refused write).

JSON keys: `api_to_first_rollout_s` (their sum) and one `<component>_s` per row above (medians, of
the first database: SQLite, as before PostgreSQL was measured);
the same with a `server_` prefix for the engine-server runs (goal: `server_api_to_first_rollout_s`
<= 10 s), and `engine_server_start_s`, what starting the server took once;
`worker_terminal_lines_per_run`, the most lines the worker's terminal got for one run (the
engines' output goes to the run's log files, rl_engine/run/logs.py); `op_rebuilt_during_runs`,
1 if DeepSpeed's CPU op was (re)built while the measured runs went (it is built per virtualenv,
once: rl_engine/trainer/dist.py), so the start-up figures never count a rebuild. Per database
(`sqlite_...`, `postgres_...`): `<db>_db_locked_lines` (lines of its server log with `database is
locked`) and `<db>_server_log_tracebacks`, `<db>_read_flow_runs_p50_ms` / `_p95_ms` and
`<db>_create_flow_run_p50_ms` / `_p95_ms` (the probe's calls, refused ones included), `<db>_api_errors` (probe calls
answered with an error status or not within 30 s) of `<db>_api_calls`, `<db>_api_to_first_rollout_s` and
`<db>_server_api_to_first_rollout_s`, `<db>_minutes` (how long the sequence took) and
`<db>_load_avg_1m` (the machine's 1-minute load average over it, other processes' work included);
`dbs`, the databases measured, in order.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from bench._report import emit_json, print_table

COMPONENTS = ("api_call", "worker_pickup", "process_spawn", "flow_import", "run_setup", "engine_start", "to_rollout")
RUN_TIMEOUT_S = 600.0
LOCKED = b"database is locked"
PROBE_PERIOD_S = 0.5
PROBE_TIMEOUT_S = 30.0
PROBE_FLOW = "bench-ops-probe"


def _ts(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()


def _state_times(live: Any, run_id: str) -> dict[str, float]:
    """{state type: first time the run entered it} from the run's state history."""
    states = live.api("GET", f"/flow_run_states/?flow_run_id={run_id}")
    out: dict[str, float] = {}
    for s in sorted(states, key=lambda s: s["timestamp"]):
        out.setdefault(s["type"], _ts(s["timestamp"]))
    return out


def _started_at(pid: int) -> float:
    """When process `pid` started, in time.time() seconds, to the clock tick (10 ms). Not psutil's
    create_time: it adds the boot time as /proc/stat gives it, in whole seconds, so it was up to 1 s
    early here (0.98 s: a negative worker_pickup)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def measure(
    live: Any, worker: Any, dep_id: str, storage: Path, steps: int, sets: tuple[str, ...] = ()
) -> dict[str, float]:
    """One run started over REST (`sets`: more `set` overrides); its timeline split into COMPONENTS (seconds)."""
    from harness.prefect_live import wait_flow_run
    from rl_engine.run.timeline import load_spans

    storage.mkdir(parents=True)
    lines_before = _lines(worker.log_path)
    body = {"parameters": {"set": [f"trainer.total_steps={steps}", f"buffer.storage.url={storage}", *sets]}}
    t_call = time.time()
    run_id = live.api("POST", f"/deployments/{dep_id}/create_flow_run", json=body)["id"]
    t_returned = time.time()
    spawned, deadline = None, time.monotonic() + RUN_TIMEOUT_S
    while spawned is None and time.monotonic() < deadline:  # the flow process's start, while it runs
        for marker in storage.glob("*/control/role-explorer-0.json"):
            try:
                spawned = _started_at(json.loads(marker.read_text())["pid"])
            except (ValueError, KeyError, OSError):  # half-written marker, or already gone
                pass
        if live.flow_run(run_id)["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(0.2)
    wait_flow_run(live, run_id, ["COMPLETED"], timeout_s=max(1.0, deadline - time.monotonic()), worker=worker)
    states = _state_times(live, run_id)
    (run_dir,) = [p for p in storage.iterdir() if (p / "config.yaml").exists()]
    spans = [s for s in load_spans(str(run_dir)) if s.component == "explorer-0"]
    engine = min((s for s in spans if s.kind == "engine_start"), key=lambda s: s.start)
    rollout = min(s.start for s in spans if s.kind == "rollout")
    # The worker proposes PENDING and starts the process concurrently (the process measured up to
    # 0.13 s earlier): pickup ends at whichever came first, so no component is negative.
    picked = min(states["PENDING"], spawned) if spawned is not None else states["PENDING"]
    marks = [
        t_call,
        t_returned,
        picked,
        spawned if spawned is not None else picked,
        states["RUNNING"],
        engine.start,
        engine.end,
        rollout,
    ]
    terminal = _worker_lines_of_run(worker.log_path, lines_before)
    return {f"{c}_s": b - a for c, a, b in zip(COMPONENTS, marks, marks[1:])} | {
        "api_to_first_rollout_s": rollout - t_call,
        "worker_terminal_lines": terminal,
    }


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines())


def _worker_lines_of_run(log: Path, before: int, timeout_s: float = 30.0) -> int:
    """Lines the worker's terminal got since `before`, once it logged how the run's process exited."""
    deadline = time.monotonic() + timeout_s
    while b"exited" not in b"".join(log.read_bytes().splitlines()[before:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _lines(log) - before


def _op_library() -> os.stat_result | None:
    """DeepSpeed's CPU op as this virtualenv's trainers load it (rl_engine.trainer.dist), or None before its first build."""
    import glob

    from rl_engine.trainer.dist import extensions_root

    found = glob.glob(f"{extensions_root()}/deepspeed_shm_comm/*.so")
    return os.stat(found[0]) if found else None


def model_and_tasks(root: Path) -> tuple[str, str]:
    """The tiny model and its task file, made under `root` (once for every database's runs)."""
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.tiny_model import make_tiny_model

    model = str(make_tiny_model(root / "model", seed=0))
    tasks = str(root / "tasks.jsonl")
    write_arithmetic_taskset(tasks, n=200, seed=3)
    return model, tasks


def setup(root: Path, db: str, model: str, tasks: str) -> tuple[Any, Any, dict[str, Any], list[Any]]:
    """A live server on `db`, the README's pool and a worker, `prefect deploy --all`; returns (server,
    worker, the synchronous deployment with a config of `model` and `tasks`, things to stop). The
    deployment's config is also written to `<root>/config.yaml` (the engine server's)."""
    from harness.prefect_live import DEPLOY_ALL, REPO, start_server, start_worker
    from harness.runs import small_config

    live = start_server(root / "server", ui=False, db=db)
    stop = [live]
    try:
        worker = start_worker(live, "rft-cpu", root / "logs")
        stop.insert(0, worker)
        live.cli(*DEPLOY_ALL, cwd=REPO, timeout=300)
        dep = live.deployment("synchronous/synchronous")
        cfg = small_config(model, tasks, str(root / "runs"), mode="synchronous", total_steps=1)
        cfg["synchronizer"]["collective"]["port"] = None
        cfg["monitor"]["artifacts"] = False  # the measured path is start-up; reports come after it
        live.api("PATCH", f"/deployments/{dep['id']}", json={"parameters": {"cfg": cfg}})
        (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    except BaseException:
        for s in stop:
            s.stop()
        raise
    return live, worker, dep, stop


class _AttachedWorker:
    """A worker this benchmark did not start: its terminal's log is all it reads of it."""

    def __init__(self, log_path: Path):
        self.log_path = log_path

    def log_tail(self, n: int = 80) -> str:
        from harness.prefect_live import log_tail

        return log_tail(self.log_path, n)


class _Restore:
    """Puts the deployment's parameters back (as `stop()`, with the servers a setup started)."""

    def __init__(self, live: Any, dep: dict[str, Any]):
        self.live, self.dep = live, dep

    def stop(self) -> None:
        self.live.api("PATCH", f"/deployments/{self.dep['id']}", json={"parameters": self.dep["parameters"]})


def attach(
    root: Path, api_url: str, worker_log: Path, model: str | None, tasks: str | None, server_log: Path | None = None
) -> tuple[Any, Any, dict[str, Any], list[Any]]:
    """`setup` against a server already up, with the README's pool polled by a worker whose terminal
    goes to `worker_log` and `prefect deploy --all` done (the tests' session fixtures): only the
    deployment's config is PATCHed (put back at the end), around `model` and `tasks` if given.
    `server_log`: that server's log, read for `database is locked` lines (none counted without it)."""
    from harness.prefect_live import LiveServer
    from harness.runs import small_config

    live = LiveServer(api_url=api_url, home=Path(), log_path=server_log or Path())
    dep = live.deployment("synchronous/synchronous")
    if model is None or tasks is None:
        model, tasks = model_and_tasks(root)
    cfg = small_config(model, tasks, str(root / "runs"), mode="synchronous", total_steps=1)
    cfg["synchronizer"]["collective"]["port"] = None
    cfg["monitor"]["artifacts"] = False
    live.api("PATCH", f"/deployments/{dep['id']}", json={"parameters": {"cfg": cfg}})
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    return live, _AttachedWorker(worker_log), dep, [_Restore(live, dep)]


def _served_runs(
    live: Any, worker: Any, dep: dict[str, Any], root: Path, runs: int, warm_up: bool, url: str
) -> list[dict[str, Any]]:
    """The same runs against an engine server kept up between them (`rft engine serve` of the
    deployment's model at `url`; runs get `explorer.engine.servers`)."""
    sets = (f'explorer.engine.servers=["{url}"]',)
    if warm_up:  # the server's first generate pays vLLM's one-off warm-up (~2 s)
        measure(live, worker, dep["id"], root / "runs-server-warmup", steps=1, sets=sets)
    return [
        {"run": f"server {i + 1}", **measure(live, worker, dep["id"], root / f"runs-server-{i}", steps=1, sets=sets)}
        for i in range(runs)
    ]


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_counts(path: Path, since: int) -> tuple[int, int]:
    """(lines with `database is locked`, tracebacks) in the log at `path` after byte `since`."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            lines = f.read().splitlines()
    except OSError:
        return 0, 0
    return sum(LOCKED in line for line in lines), sum(
        line.startswith(b"Traceback (most recent call last)") for line in lines
    )


class Probe(threading.Thread):
    """An API client beside the runs: every PROBE_PERIOD_S, `read_flow_runs` (the newest 20) and
    `create_flow_run` (a flow run of PROBE_FLOW, which no deployment or worker takes), each timed
    alone (ms), without retries; an error status or no answer within PROBE_TIMEOUT_S counts as an
    error, and as the time it took (the timeout's, for no answer). Samples the machine's 1-minute
    load average too. `stop()` ends it and deletes the flow runs it created."""

    def __init__(self, api_url: str):
        super().__init__(daemon=True)
        import httpx

        self.client = httpx.Client(base_url=api_url.rstrip("/"), timeout=PROBE_TIMEOUT_S)
        self.done = threading.Event()
        self.ms: dict[str, list[float]] = {"read_flow_runs": [], "create_flow_run": []}
        self.errors = self.calls = 0
        self.load: list[float] = []
        self.flow_id = self.client.post("/flows/", json={"name": PROBE_FLOW}).raise_for_status().json()["id"]

    def _call(self, what: str, path: str, body: dict[str, Any]) -> dict[str, Any] | list | None:
        import httpx

        t0 = time.perf_counter()
        try:
            r = self.client.post(path, json=body)
        except httpx.HTTPError:
            r = None
        self.ms[what].append((time.perf_counter() - t0) * 1000)  # a refusal's wait counts too (SQLite's 503)
        if r is None or r.status_code >= 400:
            self.errors += 1
            return None
        return r.json()

    def run(self) -> None:
        i = 0
        while not self.done.is_set():
            t0 = time.monotonic()
            self.calls += 2
            self._call("read_flow_runs", "/flow_runs/filter", {"limit": 20, "sort": "EXPECTED_START_TIME_DESC"})
            self._call(
                "create_flow_run", "/flow_runs/", {"flow_id": self.flow_id, "name": f"probe-{i}", "tags": [PROBE_FLOW]}
            )
            self.load.append(os.getloadavg()[0])
            i += 1
            self.done.wait(max(0.0, PROBE_PERIOD_S - (time.monotonic() - t0)))

    def _delete_probe_runs(self, tries: int = 10) -> None:
        """Every flow run of PROBE_FLOW, found by its tag: a create whose answer timed out here may
        still have made one, and SQLite answers a busy delete 503, so each round deletes what is
        left until nothing is (a few rounds at most, backing off)."""
        import httpx

        body = {"flow_runs": {"tags": {"all_": [PROBE_FLOW]}}, "limit": 200}
        for attempt in range(tries):
            try:
                left = self.client.post("/flow_runs/filter", json=body).raise_for_status().json()
                for run in left:
                    self.client.delete(f"/flow_runs/{run['id']}")
            except httpx.HTTPError:
                left = [None]  # the server was busy: look again
            if not left:
                return
            time.sleep(min(0.2 * 2**attempt, 5.0))

    def stop(self) -> dict[str, float]:
        """End the probe, delete its flow runs; its figures (ms, counts)."""
        self.done.set()
        self.join()
        self._delete_probe_runs()
        self.client.close()
        out: dict[str, float] = {}
        for what, ms in self.ms.items():
            qs = statistics.quantiles(ms, n=20, method="inclusive") if len(ms) > 1 else ms * 19
            out[f"{what}_p50_ms"] = round(statistics.median(ms), 1) if ms else float("nan")
            out[f"{what}_p95_ms"] = round(qs[18], 1) if ms else float("nan")
        out["api_calls"] = self.calls
        out["api_errors"] = self.errors
        out["load_avg_1m"] = round(statistics.fmean(self.load), 2) if self.load else float("nan")
        return out


def one_database(
    live: Any, worker: Any, dep: dict[str, Any], root: Path, runs: int, smoke: bool, engine: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float], int]:
    """The sequence on one server: warm-up run (not with `smoke`), `runs` measured runs, the same
    against the engine server `engine` (url, start_s), with the probe going all along; returns
    (rows, served rows, the database's figures, 1 if DeepSpeed's op was rebuilt meanwhile)."""
    t_start, log_from = time.monotonic(), _log_size(live.log_path)
    probe = Probe(live.api_url)
    probe.start()
    try:
        if not smoke:
            t0 = time.monotonic()
            warm = measure(live, worker, dep["id"], root / "runs-warmup", steps=1)
            print(
                f"warm-up run (worker and caches cold): api_to_first_rollout {warm['api_to_first_rollout_s']:.1f} s, finished after {time.monotonic() - t0:.0f} s"
            )
        op = _op_library()  # built by the warm-up run (or an earlier one) for this virtualenv
        rows = [{"run": i + 1, **measure(live, worker, dep["id"], root / f"runs-{i}", steps=1)} for i in range(runs)]
        after = _op_library()
        rebuilt = int(op is None or after is None or (op.st_ino, op.st_mtime_ns) != (after.st_ino, after.st_mtime_ns))
        served = _served_runs(live, worker, dep, root, runs, warm_up=not smoke, url=engine.url)
    finally:
        figures = probe.stop()
    locked, tracebacks = _log_counts(live.log_path, log_from)
    figures |= {
        "db_locked_lines": locked,
        "server_log_tracebacks": tracebacks,
        "api_to_first_rollout_s": round(statistics.median(r["api_to_first_rollout_s"] for r in rows), 3),
        "server_api_to_first_rollout_s": round(statistics.median(r["api_to_first_rollout_s"] for r in served), 3),
        "minutes": round((time.monotonic() - t_start) / 60, 2),
    }
    return rows, served, figures, rebuilt


def databases(choice: str) -> list[str]:
    """The databases to measure, in order: SQLite first (the start-up keys' own), PostgreSQL where
    the machine has it (a line says why not where it has none)."""
    from cli.prefect_db import postgres_missing

    want = ["sqlite", "postgres"] if choice == "both" else [choice]
    missing = postgres_missing() if "postgres" in want else None
    if missing:
        if choice == "postgres":
            raise SystemExit(f"bench.ops --db postgres: {missing}")
        print(f"PostgreSQL not measured: {missing}")
        want.remove("postgres")
    return want


def main(argv: list[str] | None = None) -> int:
    import contextlib
    from types import SimpleNamespace

    ap = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one measured run instead of three")
    size.add_argument("--smoke", action="store_true", help="CI smoke test: one measured run and no warm-up run")
    ap.add_argument(
        "--db",
        help="the Prefect server's database: both (default: SQLite, then PostgreSQL), sqlite or postgres; with --attach, the name of the attached server's (default sqlite)",
    )
    ap.add_argument(
        "--attach",
        metavar="API_URL",
        help="a Prefect server already up (its API URL), with the rft-cpu pool's worker and `prefect deploy --all` done",
    )
    ap.add_argument("--worker-log", type=Path, help="with --attach: the file that worker's terminal goes to")
    ap.add_argument("--server-log", type=Path, help="with --attach: the server's log (for `database is locked` lines)")
    ap.add_argument("--model", help="with --attach: the tiny model for the runs (default: one made here)")
    ap.add_argument("--tasks", help="with --attach: their task file (default: one written here)")
    ap.add_argument(
        "--engine-server",
        nargs=2,
        metavar=("URL", "START_S"),
        help="with --attach: an engine server already up, of --model (its URL, and the seconds its start took), for the served runs",
    )
    args = ap.parse_args(argv)
    if bool(args.attach) != bool(args.worker_log):
        ap.error("--attach and --worker-log go together")
    if args.attach:
        if args.db not in (None, "sqlite", "postgres"):
            ap.error("with --attach, --db names the attached server's database: sqlite or postgres")
        dbs = [args.db or "sqlite"]
    else:
        if args.db not in (None, "both", "sqlite", "postgres"):
            ap.error("--db: both, sqlite or postgres")
        dbs = databases(args.db or "both")
    runs = 1 if args.quick or args.smoke else 3
    results: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float], int]] = {}
    with tempfile.TemporaryDirectory(prefix="rft-bench-ops-") as tmp, contextlib.ExitStack() as engines:
        root = Path(tmp)
        if args.attach:
            engine = None
            if args.engine_server:
                engine = SimpleNamespace(url=args.engine_server[0], start_s=float(args.engine_server[1]))
            live, worker, dep, stop = attach(
                root, args.attach, args.worker_log, args.model, args.tasks, server_log=args.server_log
            )
            try:
                if engine is None:
                    from harness.engine_server import engine_server

                    engine = engines.enter_context(engine_server(root / "config.yaml", root / "logs"))
                results[dbs[0]] = one_database(live, worker, dep, root, runs, args.smoke, engine)
            finally:
                for s in stop:
                    s.stop()
        else:
            model, tasks = model_and_tasks(root)
            engine = None
            for db in dbs:
                where = root / db
                where.mkdir()
                print(f"--- Prefect server on {db}", flush=True)
                live, worker, dep, stop = setup(where, db, model, tasks)
                try:
                    if engine is None:  # one engine server for every database's runs
                        from harness.engine_server import engine_server

                        engine = engines.enter_context(engine_server(where / "config.yaml", root / "logs"))
                    results[db] = one_database(live, worker, dep, where, runs, args.smoke, engine)
                finally:
                    for s in stop:
                        s.stop()
    rows, served, _, rebuilds = results[dbs[0]]
    print_table(
        [{k.removesuffix("_s"): v for k, v in r.items()} for r in rows + served],
        title=f"API call -> first rollout, seconds ({'cold' if args.smoke else 'warm'} worker, synchronous deployment, tiny model, Prefect on {dbs[0]}; 'server' rows: engine server kept up)",
    )
    print_table(
        [{"db": db, **fig} for db, (_, _, fig, _) in results.items()],
        title=f"Prefect's database under the same runs (the API probed every {PROBE_PERIOD_S:g} s; latency in ms; load: the machine's 1-minute load average)",
    )
    keys = [f"{c}_s" for c in COMPONENTS] + ["api_to_first_rollout_s"]
    lines = max(r["worker_terminal_lines"] for _, (rw, sv, _, _) in results.items() for r in rw + sv)
    print(
        f"worker terminal: at most {lines} lines per run (goal: under 30; engine output goes to <run>/logs/); DeepSpeed op rebuilt during the measured runs: {'yes' if rebuilds else 'no'}"
    )
    print(
        f"engine server: up after {engine.start_s:.1f} s, once; API call -> first rollout {statistics.median(r['api_to_first_rollout_s'] for r in served):.1f} s with it (goal <= 10 s)"
    )
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}
    warm = {f"server_{k}": round(statistics.median(r[k] for r in served), 3) for k in keys}
    per_db = {f"{db}_{k}": v for db, (_, _, fig, _) in results.items() for k, v in fig.items()}
    emit_json(
        med
        | warm
        | per_db
        | {
            "engine_server_start_s": round(engine.start_s, 3),
            "runs": len(rows),
            "worker_terminal_lines_per_run": lines,
            "op_rebuilt_during_runs": rebuilds,
            "dbs": ",".join(dbs),
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
