"""Process-group setup for the trainer: env defaults for a single process, device choice.

DeepSpeed reads MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK (its launcher or
torchrun set them). A plain `python` process (tests, `rft warmstart`, the in-process loop) has
none, so `ensure_dist_env` fills them in for a world of one, on a free loopback port.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Iterator

from rl_engine.proc.ports import free_port  # tests, bench and harness import it from here too

log = logging.getLogger(__name__)


OWNER = "RFT_DIST_ENV_OWNER"  # pid of the process that filled in the variables below for itself


def ensure_dist_env(local_device: int = 0) -> None:
    """Set the rendezvous variables for a one-process world unless a launcher already did; the
    world's one rank trains on CUDA device `local_device` (LOCAL_RANK, which DeepSpeed and
    `accelerator_device` read): the device the run's plan gives a trainer that runs in a process
    shared with explorers (rl_engine.run.devices). A launcher's LOCAL_RANK is left as it is.

    Values this function set in another process (our parent, say a test or a `serve` process
    that ran a trainer before starting a Prefect worker) are not a launcher's: children inherit
    them, and reusing the parent's MASTER_PORT, which the parent still holds, fails with
    EADDRINUSE. Those are replaced.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # an earlier trainer in this process already joined; DeepSpeed reuses the group
    owner = os.environ.get(OWNER)
    if owner == str(os.getpid()):
        os.environ["LOCAL_RANK"] = str(
            local_device
        )  # our own one-process world, from an earlier trainer here: this one's device
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and owner is None:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK=str(local_device),
        **{OWNER: str(os.getpid())},
    )


def accelerator_device() -> str:
    """Device of this rank: 'cuda:<LOCAL_RANK>' (or another accelerator's name) or 'cpu'.
    DeepSpeed picks the matching backend itself (nccl / gloo)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return name if name == "cpu" else f"{name}:{int(os.environ.get('LOCAL_RANK', '0'))}"


VENV_EXTENSIONS = "torch_extensions"  # the folder inside a virtualenv that its builds go to


def extensions_root() -> str:
    """Where torch JIT-builds C++ extensions (DeepSpeed's CPU ops): TORCH_EXTENSIONS_DIR when set;
    else, in a writable virtualenv, `<venv>/torch_extensions`; else torch's default.

    Why per virtualenv: torch's default (~/.cache/torch_extensions) is shared by every virtualenv
    of the user, and a build's files hold its virtualenv's paths, so two checkouts' runs in turn
    rebuild DeepSpeed's op (25-63 s) at every switch (issue 28: 14 rebuilds in 100 minutes).
    """
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return os.path.join(sys.prefix, VENV_EXTENSIONS)
    return get_default_build_root()


def use_extensions_root() -> str:
    """Make torch build extensions in `extensions_root()` (sets TORCH_EXTENSIONS_DIR, which torch
    reads at each build; children inherit it) with this environment's ninja; returns the folder."""
    root = extensions_root()
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    use_own_ninja()
    return root


def use_own_ninja() -> None:
    """Put this interpreter's scripts folder first on PATH when it holds a `ninja` (the pip package
    DeepSpeed installs), for this process and its children.

    torch builds with whichever ninja PATH finds first, and ninja rebuilds whatever its build log
    says was built by another command. Two ninjas hash commands differently (the virtualenv's 1.13
    and Debian's 1.11 here), so processes of one virtualenv that find different ones (started with
    the virtualenv's bin on PATH, like a Prefect worker, or not, like `.venv/bin/python -m pytest`)
    rebuilt DeepSpeed's op at every turn, 25-140 s each (issue 28)."""
    scripts = sysconfig.get_path("scripts")
    if not os.access(os.path.join(scripts, "ninja"), os.X_OK):
        return
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path[:1] != [scripts]:
        os.environ["PATH"] = os.pathsep.join([scripts] + [p for p in path if p != scripts])


def preload_deepspeed_ops() -> None:
    """JIT-load DeepSpeed's shm comm op (what deepspeed.initialize builds on CPU) under
    `op_build_guard`; DeepSpeed caches loaded ops per process, so initialize then takes no build
    lock of its own. Only the load is guarded: ranks of one trainer must not wait on each other
    inside initialize's collective set-up while one holds the guard."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    use_extensions_root()  # before any build: DeepSpeed's op builders read it through torch
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # GPU accelerators: no such op
    with op_build_guard():
        builder.load()


@contextlib.contextmanager
def op_build_guard(root: str | None = None, stale_after_s: float = 30.0) -> Iterator[None]:
    """Hold this while JIT-loading a torch extension (DeepSpeed's ops).

    torch guards each extension build with a plain lock file (`<root>/<op>/lock` under
    TORCH_EXTENSIONS_DIR, `<root>/<py>_<dev>/<op>/lock` under its default root; a FileBaton) that every loading process takes, even when ninja finds nothing to rebuild, and
    waits for forever while it exists. A process killed while holding it leaves it behind, and
    every later trainer hangs at start-up. Our trainers take an flock here first (the kernel
    releases it when its holder dies), so while we hold it no trainer of ours is building: a lock
    file still there after `stale_after_s` (older than that, or not gone within it; a foreign
    process's build could hold one) was left by a dead process, and is removed with a warning.
    """
    root = root or extensions_root()
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".rft-build.flock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released on close, or by the kernel if we die
        try:
            for lock in glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock")):
                _clear_if_stale(lock, stale_after_s)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _clear_if_stale(lock: str, stale_after_s: float) -> None:
    deadline = time.monotonic() + stale_after_s
    while os.path.exists(lock):
        try:
            age = time.time() - os.path.getmtime(lock)
        except FileNotFoundError:
            return
        if age > stale_after_s or time.monotonic() > deadline:
            log.warning(
                "removing %s, a torch extension build lock left by a process that died while holding it (%.0f s old)",
                lock,
                age,
            )
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
            return
        time.sleep(0.2)
