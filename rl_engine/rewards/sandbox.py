"""A sandbox for generated code: a Python program run in a process of its own, shut in, limited
and killed whole, for rewards that run what a model wrote (`code_tests`; a judge's tools later).

    box = Sandbox(SandboxLimits(timeout_s=5))          # UserError where no network namespace is possible
    result = box.run_python("print(1 + 1)", files={"helper.py": "..."})
    result.status, result.output, result.results, result.elapsed_s   # 'ok', '2\\n', [], 0.03

What a run gets (`sandbox_child.py` does it, in the child, before the program's first line):

- **its own namespaces** (`isolation == "namespaces"`, where the kernel allows them: root, or an
  unprivileged user namespace): a PID namespace (the program is pid 1 there: it sees no other
  process and can signal none outside; when it dies, or its keeper is killed, every process it
  started dies with it, so nothing it forks or daemonizes outlives the run), a network namespace
  with nothing in it (no interface up: no connection anywhere, loopback included; no abstract
  Unix socket of the host), a mount namespace whose root is built for it: read-only binds of
  /usr, /bin, /lib, /lib64, a few files of /etc (passwd, group, hosts, ...) and the Python
  installation, the device files null, zero, random and urandom, and a fresh tmpfs of
  `disk_mb` as /tmp, its working directory. Nothing else of the machine's files exists there: not
  the home directory (~/.aws, ~/.cache), not the run's directory or config, not other programs'
  temporary files. It runs without rights: as root, under a uid of its own (unique among the
  runs on the machine); in a user namespace, with every capability dropped. no_new_privs is set
  (a setuid binary gains nothing).
- **rlimits**: CPU seconds, address space, the largest file, open files, processes (counted for
  its uid: per run), no core file.
- **a clean environment**: PATH, HOME=/tmp, LANG and nothing else (no AWS_*, HF_TOKEN, PREFECT_*,
  WANDB_*, ...); stdin is /dev/null; its Python starts isolated (-I -S: no PYTHON* variables, no
  site-packages: the standard library only).
- **a wall-clock timeout**: past `timeout_s`, or once its output passes `output_kb`, its whole
  process group is killed (and with it, through the PID namespace, every process it started).

Without namespaces (`isolation == "none"`: a kernel or container that refuses them) a Sandbox is
built only with `allow_network=True`, and then guarantees less: the rlimits, the clean
environment, a fresh temporary working directory and the process-group kill on timeout hold; as
root it runs under a uid of its own (root's 0600 files unreadable, processes it leaves behind
killed with that uid's), refused where that uid cannot read the Python installation (a pyenv
under /root); as another user with that user's rights (the process limit then
counts all of that user's processes); it can read what its uid may read and reach the network.
The Sandbox says which in `isolation` and `guarantees()`.

The program's stdout and stderr come back together in `output` (up to `output_kb`); `results` are
the lines it wrote to fd 3 (`os.write(3, b"...")`), a channel apart from what it prints. A program
can always lie on that channel (it runs in the same process as whatever writes it): the sandbox
contains the code, it does not make a test harness unforgeable.
"""

from __future__ import annotations

import functools
import marshal
import os
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rl_engine.errors import UserError
from rl_engine.rewards import sandbox_child

CHILD = Path(sandbox_child.__file__)
ROOT_UID_BASE = 2_000_000_000  # as root, a run's uid is this plus its keeper's pid: unique, never a real user's
ETC_FILES = ("passwd", "group", "hosts", "nsswitch.conf", "localtime", "ld.so.cache", "ld.so.conf", "mime.types")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
STOP_GRACE_S = 2.0


class SandboxError(Exception):
    """The sandbox could not set a run up (the program never ran): a machine problem, not the code's."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use (the config's `sandbox:` section, rl_engine.config.model.SandboxConfig)."""

    timeout_s: float = 5.0  # wall clock, from the start of the process
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    file_size_mb: int = 16  # the largest file it may write
    disk_mb: int = 64  # its working directory's size (with namespaces)
    open_files: int = 64
    processes: int = 16  # processes and threads of its uid
    output_kb: int = 64  # stdout + stderr kept; past it the run is killed (output_limit)
    allow_network: bool = False  # run without a network namespace where the kernel refuses one


@dataclass
class SandboxResult:
    """How a run ended. status: ok (exit 0), error (a non-zero exit: an uncaught exception),
    timeout (killed at timeout_s), killed (by a signal: a CPU or file-size limit), output_limit
    (killed when its output passed output_kb)."""

    status: str
    exit_code: int | None
    output: str
    results: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    uid: int | None = None  # the run's own uid (as root), whose processes are the run's

    @property
    def contained_failure(self) -> bool:
        """The sandbox stopped it (timeout, a limit's signal, too much output)."""
        return self.status in ("timeout", "killed", "output_limit")


@functools.cache
def _binds() -> list[str]:
    """What of the machine the program sees, read-only: the system's directories, a few files of
    /etc, the Python installation (its real path, wherever it lives: a pyenv under /root too)."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", *(f"/etc/{f}" for f in ETC_FILES)]
    for p in (sys.base_prefix, sys.base_exec_prefix):
        paths += [p, os.path.realpath(p)]
    out: list[str] = []
    for p in sorted(set(paths)):
        if os.path.lexists(p) and not any(p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _readable_by_others(path: str) -> bool:
    """Whether a user other than the owner can read `path` (a directory) and reach it."""
    real = Path(os.path.realpath(path))
    try:
        return all(p.stat().st_mode & stat.S_IXOTH for p in [real, *real.parents]) and bool(
            real.stat().st_mode & stat.S_IROTH
        )
    except OSError:
        return False


def _python() -> str:
    """The interpreter the sandbox starts: the base installation's (the one the root binds), not a
    virtualenv's link to it."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


class Sandbox:
    """Runs Python programs shut in (see the module docstring); thread-safe, one process per run.
    `isolation`: "auto" (namespaces where possible, else refused unless limits.allow_network),
    "namespaces" or "none". `userns`: build the namespaces in a user namespace (None: only when
    not root; True is for tests). Without namespaces root is refused where the program cannot be
    given a uid of its own, unless `allow_root` (tests only). `field` names the config section in
    the errors (`taskset.reward.sandbox`)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        isolation: str = "auto",
        userns: bool | None = None,
        allow_root: bool = False,
        field: str = "sandbox",
    ):
        self.limits = limits or SandboxLimits()
        self.userns = (os.geteuid() != 0) if userns is None else userns
        if isolation not in ("auto", "namespaces", "none"):
            raise ValueError(f"isolation must be auto, namespaces or none, not {isolation!r}")
        if isolation == "auto":
            ok, why = namespaces_available(self.userns)
            if not ok and not self.limits.allow_network:
                raise UserError(
                    f"{field}: this machine cannot give generated code a network namespace of its own ({why}), so the run refuses to start: "
                    "the code could reach the network and read the machine's files. Allow user namespaces "
                    "(sysctl kernel.unprivileged_userns_clone=1, or a container run with unshare permitted), or set "
                    f"{field}.allow_network: true to run it with rlimits, a clean environment and a timeout only"
                )
            isolation = "namespaces" if ok else "none"
        self.isolation = isolation
        # As root the program runs under a uid of its own: with namespaces always (the root it sees
        # is built readable), without them only where that uid can read the Python installation.
        root = os.geteuid() == 0
        self.own_uid = root and (not self.userns if isolation == "namespaces" else _readable_by_others(sys.base_prefix))
        if root and isolation == "none" and not self.own_uid and not allow_root:
            raise UserError(
                f"{field}: without namespaces, generated code would run as root here: another uid cannot read the Python "
                f"installation ({os.path.realpath(sys.base_prefix)}), so it cannot be given one. Run rft as another user, "
                "install Python where others can read it, or run on a machine that allows namespaces"
            )

    def guarantees(self) -> str:
        """What a run is shut in by, in words (the bench and the reward's log say it)."""
        if self.isolation == "namespaces":
            return (
                "namespaces: own pid, network (none), mount (read-only system dirs + a fresh tmpfs /tmp, no home or run files), ipc, uts"
                f"{', user' if self.userns else ''}; no rights; rlimits; clean environment; whole-namespace kill"
            )
        who = (
            "a uid of its own"
            if self.own_uid
            else "root (allow_root; the process limit does not bind it, it may signal any process)"
            if os.geteuid() == 0
            else "this user's rights"
        )
        return f"no namespaces (allow_network): as {who}; rlimits, clean environment, fresh working directory, process-group kill; the network and what that uid may read are reachable"

    def run_python(self, source: str, files: dict[str, str] | None = None) -> SandboxResult:
        """Run `source` as `python main.py` in a fresh working directory holding `files` too."""
        return self.run({**(files or {}), "main.py": source}, "main.py")

    def run(self, files: dict[str, str], main: str) -> SandboxResult:
        """Run the Python file `main` of `files` (name -> text, written into the working directory)."""
        started = time.monotonic()
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix="rft-sandbox-")
        out_r, out_w = os.pipe()
        res_r, res_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [_python(), "-I", "-S", str(CHILD)],
                stdin=subprocess.PIPE,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(res_w, ctl_w),
                cwd=workdir,
                env=dict(ENV),
                start_new_session=True,
            )
        except BaseException:
            for fd in (out_r, out_w, res_r, res_w, ctl_r, ctl_w):
                os.close(fd)
            _remove(workdir)
            raise
        for fd in (out_w, res_w, ctl_w):
            os.close(fd)
        try:
            orders = {
                "mode": self.isolation,
                "userns": self.userns and self.isolation == "namespaces",
                "uid": ROOT_UID_BASE + proc.pid if self.own_uid else None,
                "root": workdir,
                "binds": list(_binds()),
                "files": files,
                "main": main,
                "limits": asdict(lim),
                "results_fd": res_w,
                "ctl_fd": ctl_w,
            }
            return self._collect(proc, orders, out_r, res_r, ctl_r, started)
        finally:
            _kill_group(proc)
            for fd in (out_r, res_r, ctl_r):
                os.close(fd)
            if self.isolation == "none" and self.own_uid:
                _kill_uid(ROOT_UID_BASE + proc.pid)
            _remove(workdir)

    def _collect(
        self, proc: subprocess.Popen, orders: dict[str, Any], out_r: int, res_r: int, ctl_r: int, started: float
    ) -> SandboxResult:
        lim = self.limits
        deadline = started + lim.timeout_s
        try:
            proc.stdin.write(marshal.dumps(orders))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the child died at once: its exit and control pipe say why
        bufs = {out_r: bytearray(), res_r: bytearray(), ctl_r: bytearray()}
        caps = {out_r: lim.output_kb << 10, res_r: 1 << 20, ctl_r: 1 << 16}
        status = None
        with selectors.DefaultSelector() as sel:
            for fd in bufs:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    status = "timeout"
                    break
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    bufs[key.fd] += chunk
                    if key.fd == ctl_r and bufs[ctl_r].endswith(b"\n"):
                        sel.unregister(ctl_r)  # the keeper closes its copy only when it ends
                    elif len(bufs[key.fd]) > caps[key.fd]:
                        if key.fd == out_r:
                            status = "output_limit"
                        sel.unregister(key.fd)
                if status:
                    break
        if status is None:
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = "timeout"
        if status is not None:
            code = self._stop(proc)
        ctl = bytes(bufs[ctl_r]).decode(errors="replace").strip()
        if not ctl.startswith("ok") and status is None:
            raise SandboxError(
                f"the sandbox ({self.isolation}) could not start the program: "
                f"{ctl.removeprefix('error: ') or f'its process ended with exit code {code} before setting up'}"
            )
        if status is None:
            status = "ok" if code == 0 else "killed" if code >= 128 or code < 0 else "error"
        output = bytes(bufs[out_r][: caps[out_r]]).decode(errors="replace")
        results = bytes(bufs[res_r][: caps[res_r]]).decode(errors="replace").splitlines()
        return SandboxResult(status, code, output, results, time.monotonic() - started, orders["uid"])

    def _stop(self, proc: subprocess.Popen) -> int:
        """End a run early; its exit code. With namespaces the keeper is asked (SIGTERM: it kills
        pid 1, so the whole namespace, and reaps it), then its group killed if it has not ended
        within STOP_GRACE_S; without, the group is killed at once."""
        if self.isolation == "namespaces":
            proc.terminate()
            try:
                return proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)
        return _reap(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the run's process group (its keeper's session): with namespaces the keeper's
    death kills the program (its parent-death signal), and the program's the whole namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(5.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process that does not end
        proc.kill()
        return proc.wait()


def _kill_uid(uid: int) -> None:
    """Without namespaces, as root: kill whatever still runs under the run's own uid (a process
    that left the group). A helper that becomes that uid and signals every process it may."""
    code = f"import os, signal; os.setgid({uid}); os.setuid({uid}); os.kill(-1, signal.SIGKILL)"
    subprocess.run([_python(), "-I", "-S", "-c", code], env=dict(ENV), timeout=10, check=False, capture_output=True)


def _remove(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


_probe_lock = threading.Lock()
# The probe: a run with namespaces that finds no network (a connection that succeeds fails it).
PROBE = """\
import socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=0.5)
except OSError:
    pass
else:
    raise SystemExit(3)
"""


@functools.cache
def _probe(userns: bool) -> tuple[bool, str]:
    box = Sandbox(SandboxLimits(timeout_s=10.0), isolation="namespaces", userns=userns)
    try:
        result = box.run_python(PROBE)
    except SandboxError as e:
        return False, str(e).split(": ", 1)[-1]
    if result.status != "ok":
        return False, f"a probe run ended {result.status} (exit code {result.exit_code}): {result.output[-300:]}"
    return True, "namespaces"


def namespaces_available(userns: bool | None = None) -> tuple[bool, str]:
    """(True, ...) when a sandbox run can have its own namespaces here; else (False, why). Probed
    once per process (a run of an empty program, ~30 ms)."""
    with _probe_lock:
        return _probe((os.geteuid() != 0) if userns is None else userns)
