"""The child side of rl_engine.rewards.sandbox: run as `python -I -S sandbox_child.py`, the standard
library only (the project is not importable there), it reads its orders (a marshalled dict) from
stdin, shuts the program in and runs it.

With namespaces (`mode: namespaces`), this process (the keeper) enters a new PID namespace (and a
new user namespace first when it is not root) and forks the program's process, pid 1 there, which:
takes a session of its own; enters new mount, network, IPC and UTS namespaces; builds a root of
its own (a tmpfs holding read-only binds of the system's directories and the Python installation,
the device files null/zero/random/urandom, and a fresh size-limited tmpfs as /tmp, its working
directory) and pivots into it, the old root detached; writes the program's files there; gives up
its rights (root: a uid of its own, unique to this keeper's pid; in a user namespace: every
capability, root's exec privileges locked off); sets no_new_privs, its parent-death signal
(SIGKILL: when the keeper dies, it dies, and with pid 1 the whole namespace) and the rlimits;
then runs the program. The keeper waits for it and exits as it did (128 + signal when killed); its SIGTERM (the parent's
stop) and its own alarm (timeout + 2 s: the parent is gone) kill pid 1, which it then reaps.

Without namespaces (`mode: none`) the keeper itself is the program's process: it writes the files
into its working directory, drops root for a uid of its own when it is root, sets no_new_privs
and the rlimits and runs the program.

The parent learns that the setup succeeded from the control pipe: `ok` before the program runs,
or `error: ...` (and exit code SETUP_FAILED). The program's results channel is fd 3.
"""

import _signal as signal  # not `signal`: its enums cost the start-up 5-30 ms
import ctypes
import marshal
import os
import resource
import sys

SETUP_FAILED = 121
RESULTS_FD = 3

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
MS_NOEXEC, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 8, 1024, 2048, 1 << 21
_KEPT_FLAGS = ((8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME))  # statvfs ST_* -> MS_*
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_SETUID_FIXUP_LOCKED = 1, 2, 4, 8
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _unshare(flags, what):
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({what})")


def _prctl(option, arg, what):
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), 0, 0, 0), f"prctl({what})")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


# --------------------------------------------------------------------------- the new root


def _bind(source, target, read_only=True):
    """Bind `source` (a directory or a file) at `target` inside the new root; a symbolic link is
    copied as a link."""
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        # The source mount's own flags are kept (in a user namespace they are locked: a remount
        # that would clear noexec or an atime flag is refused).
        kept = sum(ms for st, ms in _KEPT_FLAGS if os.statvfs(source).f_flag & st)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def _build_root(orders):
    """Everything the program sees, under the host directory orders["root"] (this mount namespace
    only), then pivoted into: / is read-only, /tmp its working directory."""
    root, limits = orders["root"], orders["limits"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("sandbox-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in orders["binds"]:
        if os.path.lexists(path):
            _bind(path, root + path)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", f"{root}/dev/{name}", read_only=False)
    os.makedirs(f"{root}/tmp")
    owner = f",uid={orders['uid']},gid={orders['uid']}" if orders.get("uid") is not None else ""
    _mount("sandbox-tmp", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['disk_mb']}m,mode=700{owner}")
    os.makedirs(f"{root}/.old")
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise SetupError(f"pivot_root: no syscall number known for {machine}")
    _check(_libc.syscall(SYS_PIVOT_ROOT[machine], root.encode(), f"{root}/.old".encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    try:
        _libc.sethostname(b"sandbox", 7)
    except Exception:  # noqa: BLE001 - cosmetic
        pass


# --------------------------------------------------------------------------- rights and limits


def _drop_root(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
    """Root inside a user namespace gives up its capabilities there for good: root's exec
    privileges locked off, the bounding set emptied, then the capability sets cleared."""
    locked = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP | SECBIT_NO_SETUID_FIXUP_LOCKED
    _prctl(PR_SET_SECUREBITS, locked, "securebits")
    cap = 0
    while _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), 0, 0, 0) == 0:
        cap += 1
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _set_limits(limits):
    cpu = int(limits["cpu_s"])
    for res, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, limits["memory_mb"] << 20, limits["memory_mb"] << 20),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20, limits["file_size_mb"] << 20),
        (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(res, (soft, hard))


def _write_files(orders, directory):
    for name, text in orders["files"].items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if orders.get("uid") is not None:
            os.chown(path, orders["uid"], orders["uid"])


def _fds(orders):
    """The results channel on fd 3, the control pipe's fd returned; every other fd closed."""
    ctl, results = orders["ctl_fd"], orders["results_fd"]
    if ctl == RESULTS_FD:
        ctl = os.dup(ctl)
    if results != RESULTS_FD:
        os.dup2(results, RESULTS_FD)
        os.close(results)
    os.closerange(RESULTS_FD + 1, ctl)
    os.closerange(ctl + 1, 1 << 16)
    return ctl


# --------------------------------------------------------------------------- the program


def _run_program(orders):
    """Run the program in this interpreter as `python main.py` would; never returns."""
    main = orders["main"]
    sys.argv = [main]
    sys.path.insert(0, os.getcwd())
    code = 0
    try:
        with open(main, encoding="utf-8") as f:
            source = f.read()
        globs = {"__name__": "__main__", "__file__": os.path.abspath(main), "__builtins__": __builtins__}
        exec(compile(source, main, "exec"), globs)  # noqa: S102 - the sandbox's whole point
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as `python main.py` would
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or broken stream: nothing more to say
            pass
    os._exit(code & 0xFF)


def _setup_failed(ctl, e):
    try:
        os.write(ctl, f"error: {e}\n".encode())
    finally:
        os._exit(SETUP_FAILED)


def _program_process(orders, ctl, alive_r):
    """Pid 1 of the new PID namespace: shut itself in, then run the program."""
    try:
        os.setsid()
        _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS, "mount, network, ipc, uts")
        _build_root(orders)
        _write_files(orders, "/tmp")
        os.chdir("/tmp")
        if orders.get("uid") is not None:
            _drop_root(orders["uid"])
        elif orders.get("userns"):
            _drop_capabilities()
        _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "pdeathsig")
        os.set_blocking(alive_r, False)
        try:
            if os.read(alive_r, 1) == b"":
                os._exit(SETUP_FAILED)  # the keeper died before the death signal was set
        except BlockingIOError:
            pass
        os.close(alive_r)
        _set_limits(orders["limits"])
        os.write(ctl, b"ok\n")
        os.close(ctl)
    except BaseException as e:  # noqa: BLE001 - every setup failure is reported the same way
        _setup_failed(ctl, e)
    _run_program(orders)


def _keep(orders, ctl):
    """The keeper: enter the PID (and user) namespace, fork pid 1, wait, exit as it did."""
    flags = CLONE_NEWPID | (CLONE_NEWUSER if orders.get("userns") else 0)
    uid, gid = os.getuid(), os.getgid()
    _unshare(flags, "user, pid" if orders.get("userns") else "pid")
    if orders.get("userns"):
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
    alive_r, alive_w = os.pipe()
    stops = {signal.SIGTERM, signal.SIGALRM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        os.close(alive_w)
        _program_process(orders, ctl, alive_r)
    # The parent's stop (SIGTERM) or the keeper's own alarm (the parent gone): pid 1 is killed,
    # with it its namespace, and the keeper reaps it and ends as it did (a zombie otherwise).
    for sig in stops:
        signal.signal(sig, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    os.close(alive_r)
    os.close(ctl)
    os.close(RESULTS_FD)
    signal.alarm(int(orders["limits"]["timeout_s"]) + 2)
    _, status = os.waitpid(pid, 0)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _alone(orders, ctl):
    """No namespaces: this process is the program's."""
    _write_files(orders, os.getcwd())
    if orders.get("uid") is not None:
        os.chown(os.getcwd(), orders["uid"], orders["uid"])
        _drop_root(orders["uid"])
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
    _set_limits(orders["limits"])
    os.write(ctl, b"ok\n")
    os.close(ctl)
    _run_program(orders)


def main():
    orders = marshal.loads(sys.stdin.buffer.read())
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    ctl = _fds(orders)
    try:
        (_keep if orders["mode"] == "namespaces" else _alone)(orders, ctl)
    except BaseException as e:  # noqa: BLE001 - every setup failure is reported the same way
        _setup_failed(ctl, e)


if __name__ == "__main__":
    main()
