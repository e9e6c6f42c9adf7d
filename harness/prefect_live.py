"""A real Prefect server and real process workers for tests (not the ephemeral server).

Prefect's ephemeral server (`prefect_test_harness`) never runs the scheduler or the
cancellation-cleanup services, and it is not what a worker or the CLI talks to. Tests of
deployments, schedules, workers and cancellation use this module instead:

* `start_server(dir)` (the `prefect_live` session fixture of tests/conftest.py): `prefect server start`
  on a free loopback port, in its own process group, with its own PREFECT_HOME under `dir` and its
  database: PostgreSQL when the machine has it (a private server, cli/prefect_db.py, as
  `rft server` runs; its data under `dir`, or in a temporary directory when the user PostgreSQL
  runs as cannot reach `dir`), else SQLite (`dir/home/prefect.db`). RFT_PREFECT_DB chooses:
  `auto` (the default), `postgres` (an error where there is none) or `sqlite`. It returns a
  `LiveServer`: `api_url`, `db` ('postgres' or 'sqlite'), `env()` (the environment for subprocesses
  that talk to it), `cli(...)` (runs `.venv/bin/prefect ...` with a timeout), `api(...)` (one REST call) and `flow_run(id)`;
  its `stop()` stops PostgreSQL after Prefect's server.
* `start_worker(server, pool, log_dir)` (behind the `prefect_worker` session fixture, a factory
  `prefect_worker(pool) -> LiveWorker`): creates a process work pool (`prefect work-pool create
  POOL --type process`, unless it exists) and starts `prefect worker start --pool POOL --type process` in its own process group, with the repo root
  as working directory, the venv's bin first on PATH and its log in a file. One worker per pool per
  session; every worker is killed with its process group (its flow runs' processes included) at
  the end of the session.
* `wait_flow_run(server, flow_run_id, states, timeout_s, worker=...)`: polls the REST API until the
  run reaches one of `states` and returns that state; fails at once on another terminal state and
  at the deadline, with the worker's log tail in the message.

Everything has a deadline: a server that does not come up, a CLI command, a worker that does not
register and a flow run that does not finish all fail the test with the relevant log tail.

The two fixtures live in tests/conftest.py (one server for the whole suite); bench/ calls
`start_server` and `start_worker` directly. This module imports nothing from tests/.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rl_engine.proc.starts import count_start
from rl_engine.trainer.dist import free_port

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # tests run with the project's venv: .venv/bin
PREFECT = VENV_BIN / "prefect"

SERVER_START_TIMEOUT_S = 90.0
WORKER_START_TIMEOUT_S = 60.0
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})

# The commands the README gives, as argument lists for `LiveServer.cli` (run from the repo root).
CREATE_POOL = ("work-pool", "create", "rft-cpu", "--type", "process")
DEPLOY_ALL = ("deploy", "--all")

# Settings for every process that talks to the live server (and the server itself).
_QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_CLI_COLORS": "false",
    "COLUMNS": "250",  # rich wraps CLI output at the terminal width
}


def log_tail(path: Path | str, n: int = 60) -> str:
    """The last `n` lines of a log file ('' if it does not exist)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-n:])


def _base_env() -> dict[str, str]:
    """os.environ without Prefect settings (and test-only knobs) that could leak into subprocesses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    for k in ("RFT_KEEP_ENGINES", "PYTEST_CURRENT_TEST", "VIRTUAL_ENV"):
        env.pop(k, None)
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env.update(_QUIET_ENV)
    return env


def kill_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to `proc`'s process group (it leads one: start_new_session=True), SIGKILL to whatever
    of the group is left after `grace_s`; also kills descendants that had left the group."""
    descendants = []
    try:
        import psutil

        descendants = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pass

    def group_alive() -> bool:
        proc.poll()  # reap the leader, or its zombie keeps the group alive
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    if group_alive():
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for child in descendants:  # children that moved to a session of their own
        try:
            if child.is_running():
                child.kill()
        except Exception:  # noqa: BLE001 - best effort: a child gone or not ours to kill
            pass


def reap_with_this_process(proc: subprocess.Popen, grace_s: float = 5.0, sig: str = "TERM") -> subprocess.Popen:
    """A watcher that kills `proc`'s process group if this (pytest) process dies without its teardown
    (SIGKILL, an outer `timeout`): `sig` first (PostgreSQL's fast shutdown is INT), SIGKILL after
    `grace_s`; stop the watcher in the normal teardown (`kill_process_group`)."""
    script = (
        f"while kill -0 {os.getpid()} 2>/dev/null && kill -0 -{proc.pid} 2>/dev/null; do sleep 1; done; "
        f"kill -{sig} -{proc.pid} 2>/dev/null; sleep {grace_s:g}; kill -KILL -{proc.pid} 2>/dev/null; true"
    )
    return subprocess.Popen(
        ["sh", "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@dataclass
class LiveServer:
    """A `prefect server start` subprocess on loopback; see the module docstring."""

    api_url: str
    home: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    reaper: subprocess.Popen | None = field(default=None, repr=False)
    db: str = "sqlite"
    postgres: Any = field(default=None, repr=False)  # cli.prefect_db.Postgres when db == "postgres"
    pg_reaper: subprocess.Popen | None = field(default=None, repr=False)
    pg_tmp: Path | None = field(default=None, repr=False)  # a temporary directory of its data, removed at stop

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that talks to this server (CLI, worker, flow)."""
        env = _base_env()
        env.update({"PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home)})
        env.update(extra)
        return env

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def cli(
        self,
        *args: str,
        timeout: float = 120,
        check: bool = True,
        cwd: Path | str = REPO,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run `.venv/bin/prefect *args` against this server from `cwd` (the repo root by default).

        Raises AssertionError with the command's stdout/stderr if it fails (`check`) or runs past
        `timeout` seconds.
        """
        cmd = [str(PREFECT), *args]
        try:
            res = subprocess.run(
                cmd,
                cwd=cwd,
                env=env or self.env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise AssertionError(
                f"`prefect {' '.join(args)}` ran past {timeout:.0f} s\nstdout:\n{_text(e.stdout)[-4000:]}\nstderr:\n{_text(e.stderr)[-4000:]}"
            ) from None
        if check and res.returncode != 0:
            raise AssertionError(
                f"`prefect {' '.join(args)}` exited {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
            )
        return res

    def api(
        self, method: str, path: str, json: Any = None, timeout: float = 30, ok: Iterable[int] = (200, 201, 204)
    ) -> Any:
        """One REST call (`path` relative to the API root, e.g. '/deployments/filter'); its JSON body.

        A server busy on its SQLite database answers 503 now and then, or not within `timeout`
        while a write holds the database locked (Prefect's own client retries both): retried a
        few times with backoff before it counts.
        """
        for attempt in range(5):
            try:
                r = httpx.request(method, self.api_url.rstrip("/") + path, json=json, timeout=timeout)
            except httpx.TimeoutException:
                if attempt == 4:
                    raise
                time.sleep(0.5 * 2**attempt)
                continue
            if r.status_code not in (502, 503, 504) or r.status_code in tuple(ok):
                break
            time.sleep(0.5 * 2**attempt)
        if r.status_code not in tuple(ok):
            raise AssertionError(f"{method} {path} -> {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.api("GET", f"/flow_runs/{flow_run_id}")

    def cancel(self, flow_run_id: str) -> None:
        """Ask for the flow run's cancellation (CANCELLING, as the UI's Cancel button): the worker
        stops its process and the run ends Cancelled."""
        self.api("POST", f"/flow_runs/{flow_run_id}/set_state", json={"state": {"type": "CANCELLING"}, "force": True})

    def deployment(self, name: str) -> dict[str, Any]:
        """A deployment by its full name, 'flow-name/deployment-name'."""
        return self.api("GET", f"/deployments/name/{name}")

    def stop(self) -> None:
        if self.proc is not None:
            kill_process_group(self.proc)
        if self.reaper is not None:
            kill_process_group(self.reaper, grace_s=1)
        if self.postgres is not None:  # after Prefect's server: its last writes go through
            self.postgres.stop()
        if self.pg_reaper is not None:
            kill_process_group(self.pg_reaper, grace_s=1)
        if self.pg_tmp is not None:
            shutil.rmtree(self.pg_tmp, ignore_errors=True)


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


DB_ENV = "RFT_PREFECT_DB"  # auto | postgres | sqlite: the live server's database


def server_db(db: str | None = None) -> str:
    """'postgres' or 'sqlite': `db`, else $RFT_PREFECT_DB, where 'auto' (the default) is PostgreSQL
    when the machine has it (cli.prefect_db.postgres_missing). Asking for PostgreSQL where
    there is none raises, naming what is missing."""
    from cli.prefect_db import postgres_missing

    db = (db or os.environ.get(DB_ENV) or "auto").lower()
    if db not in ("auto", "postgres", "sqlite"):
        raise ValueError(f"{DB_ENV}={db}: auto, postgres or sqlite")
    if db == "sqlite":
        return db
    missing = postgres_missing()
    if missing and db == "postgres":
        raise AssertionError(f"{DB_ENV}=postgres, but {missing}")
    return "sqlite" if missing else "postgres"


def _start_postgres(server: LiveServer, root: Path) -> str:
    """A private PostgreSQL for `server` (its data in root/postgres, or a temporary directory the
    user it runs as can reach); returns its URL."""
    from cli.prefect_db import Postgres, _run_as, unreachable_for

    pg_root = root / "postgres"
    if unreachable_for(root, _run_as()) is not None:  # e.g. pytest's tmp dirs, 0700 root's
        server.pg_tmp = Path(tempfile.mkdtemp(prefix="rft-prefect-pg-"))
        server.pg_tmp.chmod(0o711)
        pg_root = server.pg_tmp / "postgres"
    server.postgres = Postgres(pg_root)
    url = server.postgres.start()
    server.pg_reaper = reap_with_this_process(server.postgres.proc, grace_s=10, sig="INT")
    return url


def start_server(
    root: Path, *, timeout_s: float = SERVER_START_TIMEOUT_S, ui: bool = True, db: str | None = None, **extra_env: str
) -> LiveServer:
    """Start `prefect server start` on a free loopback port with its home and database under `root`
    (`db`: 'postgres', 'sqlite', 'auto' or None for $RFT_PREFECT_DB: see `server_db`).

    Returns once `GET /api/health` answers; on a deadline or an early exit, kills it (and its
    PostgreSQL) and raises with the tail of its log. The caller stops it (`LiveServer.stop()`).
    """
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    home.mkdir(exist_ok=True)
    port = free_port()
    server = LiveServer(
        api_url=f"http://127.0.0.1:{port}/api", home=home, log_path=root / "server.log", db=server_db(db)
    )
    try:
        url = _start_postgres(server, root) if server.db == "postgres" else f"sqlite+aiosqlite:///{home / 'prefect.db'}"
    except BaseException:
        server.stop()
        raise
    env = server.env(
        PREFECT_API_DATABASE_CONNECTION_URL=url,
        PREFECT_UI_ENABLED="true" if ui else "false",
        **extra_env,
    )
    env.pop("PREFECT_API_URL")  # the server serves it; it does not call it
    count_start("prefect_server")
    with open(server.log_path, "wb") as log:
        server.proc = subprocess.Popen(
            [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server.reaper = reap_with_this_process(server.proc)
    try:
        wait_healthy(server.api_url, server.proc, server.log_path, timeout_s)
    except BaseException:
        server.stop()  # and its PostgreSQL
        raise
    return server


def wait_healthy(
    api_url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float, what: str = "prefect server"
) -> None:
    """Returns once `GET {api_url}/health` answers 200; raises AssertionError with the tail of
    `log_path` if `proc` (what serves it) exits first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before it was healthy\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not healthy within {timeout_s:.0f} s\n{log_tail(log_path)}")
        time.sleep(0.5)


@dataclass
class LiveWorker:
    """A `prefect worker start --type process` subprocess polling `pool`."""

    pool: str
    name: str
    log_path: Path
    proc: subprocess.Popen
    server: LiveServer = field(repr=False)
    reaper: subprocess.Popen | None = field(default=None, repr=False)

    def log_tail(self, n: int = 80) -> str:
        return log_tail(self.log_path, n)

    def workers_online(self) -> list[dict[str, Any]]:
        """The pool's workers with this worker's name that the server sees ONLINE."""
        rows = self.server.api("POST", f"/work_pools/{self.pool}/workers/filter", json={})
        return [w for w in rows if w["name"] == self.name and w.get("status") == "ONLINE"]

    def stop(self) -> None:
        kill_process_group(self.proc)
        if self.reaper is not None:
            kill_process_group(self.reaper, grace_s=1)


def ensure_process_pool(server: LiveServer, pool: str, *, timeout: float = 60) -> dict[str, Any]:
    """The work pool `pool`, created with `prefect work-pool create POOL --type process` if missing."""
    existing = server.api("GET", f"/work_pools/{pool}", ok=(200, 404))
    if existing and existing.get("name") == pool:
        return existing
    server.cli("work-pool", "create", pool, "--type", "process", timeout=timeout)
    return server.api("GET", f"/work_pools/{pool}")


def start_worker(
    server: LiveServer,
    pool: str,
    log_dir: Path,
    *,
    timeout_s: float = WORKER_START_TIMEOUT_S,
    query_seconds: float = 2.0,
    **extra_env: str,
) -> LiveWorker:
    """Create the process pool if needed and start a process worker on it; returns once it registered.

    The worker runs from the repo root with the venv's bin first on PATH (as a user who activated
    the venv would start it), VLLM_CPU_KVCACHE_SPACE=1 and TOKENIZERS_PARALLELISM=false, polling
    every `query_seconds`; its stdout and stderr go to `<log_dir>/worker-<pool>.log`. It has started
    once the server lists it and its log says so (a busy machine can show the first well before the
    second). The caller stops it (`LiveWorker.stop()`: SIGTERM, then SIGKILL, to its whole process
    group).
    """
    ensure_process_pool(server, pool)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"test-worker-{pool}-{os.getpid()}"
    log_path = log_dir / f"worker-{pool}.log"
    env = server.env(PREFECT_WORKER_QUERY_SECONDS=str(query_seconds), PREFECT_WORKER_HEARTBEAT_SECONDS="5", **extra_env)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(PREFECT), "worker", "start", "--pool", pool, "--type", "process", "--name", name],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    worker = LiveWorker(
        pool=pool, name=name, log_path=log_path, proc=proc, server=server, reaper=reap_with_this_process(proc)
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"prefect worker for pool {pool!r} exited with {proc.returncode}\n{worker.log_tail()}")
        # Prefect registers the worker (its heartbeat) a moment before it logs that it started.
        if worker.workers_online() and f"Worker '{name}' started!" in worker.log_tail(10**6):
            return worker
        if time.monotonic() > deadline:
            worker.stop()
            raise AssertionError(
                f"prefect worker for pool {pool!r} did not register within {timeout_s:.0f} s\n{worker.log_tail()}"
            )
        time.sleep(0.5)


def wait_flow_run(
    server: LiveServer | str,
    flow_run_id: str,
    states: Iterable[str] = ("COMPLETED",),
    timeout_s: float = 300,
    *,
    worker: LiveWorker | None = None,
    poll_s: float = 1.0,
) -> dict[str, Any]:
    """Poll the flow run until its state type is one of `states`; return that state (a dict).

    `server` is a LiveServer or the API URL of any Prefect server ('http://host:port/api').

    Fails at once if the run reaches a terminal state not in `states`, and after `timeout_s`
    seconds; the message has the run's state message and the worker's log tail.
    """
    if isinstance(server, str):
        server = LiveServer(api_url=server, home=Path(), log_path=Path())
    want = {s.upper() for s in states}
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while True:
        state = server.flow_run(flow_run_id).get("state") or {}
        kind = state.get("type")
        if kind in want:
            return state
        if kind in TERMINAL_STATES:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    where = f"\nworker log ({worker.log_path}):\n{worker.log_tail()}" if worker is not None else ""
    what = "ended" if state.get("type") in TERMINAL_STATES else f"still not {sorted(want)} after {timeout_s:.0f} s,"
    raise AssertionError(
        f"flow run {flow_run_id} {what} in state {state.get('type')} ({state.get('name')}): {state.get('message')}{where}"
    )


def flow_run_id_from_cli(stdout: str) -> str:
    """The flow run id that `prefect deployment run` prints ('UUID: ...')."""
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", stdout)
    assert m, f"no flow run id in `prefect deployment run` output:\n{stdout}"
    return m.group(1)


def assert_exited_cleanly(server: LiveServer, flow_run_id: str, timeout_s: float = 30.0) -> None:
    """The process a worker ran the flow run in exited with status 0 and logged no traceback (a
    run cancelled on purpose ends so: flows.common.end_cancelled). Reads the run's logs on the
    server once the worker has logged how the process exited (`exited cleanly` or a status code)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = server.api("POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
        text = "\n".join(row["message"] for row in rows)
        if "exited cleanly" in text or "exited with status code" in text or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "Traceback" not in text and "CancelledRun" not in text and "exited cleanly" in text, (
        f"flow run {flow_run_id}:\n{text[-3000:]}"
    )
