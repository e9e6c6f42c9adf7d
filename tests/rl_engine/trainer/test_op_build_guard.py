"""A torch extension build lock left by a killed process never hangs a trainer's start-up (issue 13)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rl_engine.trainer.dist import op_build_guard

REPO = str(Path(__file__).resolve().parents[3])


def make_lock(root, age_s: float = 0.0, layout: str = "default-root") -> str:
    # torch's default root has a <py>_<device> level; a TORCH_EXTENSIONS_DIR (ours per virtualenv) has none
    d = root / "py311_cpu" / "deepspeed_shm_comm" if layout == "default-root" else root / "deepspeed_shm_comm"
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return str(lock)


@pytest.mark.parametrize("layout", ["default-root", "extensions-dir"])
def test_a_stale_lock_is_removed(tmp_path, layout):
    lock = make_lock(tmp_path, age_s=3600, layout=layout)
    started = time.monotonic()
    with op_build_guard(str(tmp_path), stale_after_s=30):
        assert not os.path.exists(lock)
    assert time.monotonic() - started < 5


def test_a_live_lock_is_waited_for_and_one_never_released_is_cleared_after_the_bound(tmp_path):
    lock = make_lock(tmp_path)
    threading.Timer(0.5, os.remove, (lock,)).start()  # a build that finishes
    started = time.monotonic()
    with op_build_guard(str(tmp_path), stale_after_s=10):
        waited = time.monotonic() - started
    assert 0.4 < waited < 5
    lock = make_lock(tmp_path)  # its holder died a moment ago: cleared after the bound, not forever
    started = time.monotonic()
    with op_build_guard(str(tmp_path), stale_after_s=1.5):
        assert not os.path.exists(lock)
    assert 1.4 < time.monotonic() - started < 6


def test_the_guard_is_exclusive_across_processes_and_freed_when_its_holder_dies(tmp_path):
    code = (
        "import sys, time; from rl_engine.trainer.dist import op_build_guard\n"
        f"with op_build_guard({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def enter():
            with op_build_guard(str(tmp_path)):
                entered.set()

        threading.Thread(target=enter, daemon=True).start()
        assert not entered.wait(1.0)  # the other process holds it
        holder.kill()  # SIGKILL: the kernel releases its flock
        assert entered.wait(10.0)
    finally:
        holder.kill()
        holder.wait(10)


def test_extensions_are_built_per_virtualenv_unless_the_user_chose_a_folder(tmp_path, monkeypatch):
    # Issue 28: torch's default folder is shared by every virtualenv, and a build made by one holds
    # its paths, so two checkouts' runs in turn rebuilt DeepSpeed's op at every switch.
    from torch.utils.cpp_extension import get_default_build_root

    from rl_engine.trainer.dist import extensions_root, use_extensions_root

    venv_a, venv_b = tmp_path / "a", tmp_path / "b"
    venv_a.mkdir(), venv_b.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # recorded first: teardown restores what the session had
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.setattr(sys, "prefix", str(venv_a))
    assert extensions_root() == str(venv_a / "torch_extensions")
    monkeypatch.setattr(sys, "prefix", str(venv_b))
    assert (
        use_extensions_root() == str(venv_b / "torch_extensions") == os.environ["TORCH_EXTENSIONS_DIR"]
    )  # what torch, and children, read
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert use_extensions_root() == str(tmp_path / "mine")  # the user's choice wins
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    venv_b.chmod(0o500)  # a read-only virtualenv (an image's): torch's default
    try:
        if not os.access(venv_b, os.W_OK):  # root can write anyway
            assert extensions_root() == get_default_build_root()
    finally:
        venv_b.chmod(0o700)
    monkeypatch.setattr(sys, "prefix", "/usr")  # no virtualenv
    assert extensions_root() == get_default_build_root()


def test_the_trainer_built_its_op_in_the_extensions_folder(shared_trainer):
    from rl_engine.trainer.dist import extensions_root

    root = extensions_root()  # <venv>/torch_extensions here, unless TORCH_EXTENSIONS_DIR was set
    assert glob.glob(f"{root}/deepspeed_shm_comm/*.so") + glob.glob(f"{root}/*/deepspeed_shm_comm/*.so"), (
        f"no built op under {root}"
    )


def _load_op(python: str, path: str) -> os.stat_result:
    """Load DeepSpeed's CPU op as a trainer does, with `python` and PATH `path` (no
    TORCH_EXTENSIONS_DIR set); the built library's stat."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | {"PYTHONPATH": REPO, "PATH": path}
    code = "from rl_engine.trainer.dist import extensions_root, preload_deepspeed_ops; preload_deepspeed_ops(); print(extensions_root())"
    res = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    root = res.stdout.strip().splitlines()[-1]
    (lib,) = glob.glob(f"{root}/deepspeed_shm_comm/*.so")
    return os.stat(lib)


@pytest.mark.release
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_virtualenvs_in_turn_never_rebuild_the_op(tmp_path):
    """Issue 28: two checkouts' virtualenvs running trainers in turn rebuilt DeepSpeed's op (25-140 s)
    at every switch. Twice over: they shared ~/.cache/torch_extensions, and processes found
    different ninjas on PATH (the virtualenv's, when started with its bin first like a Prefect
    worker, or the system's, like `.venv/bin/python -m pytest`), which hash build commands
    differently. A second virtualenv (its own prefix and ninja, this one's packages through a .pth
    file) builds its own op once; from then on neither rebuilds, whichever PATH a process has: the
    library each loads is the same file, unchanged."""
    import shutil
    import site
    import sysconfig

    if sys.prefix == sys.base_prefix:
        pytest.skip("the suite runs outside a virtualenv")
    other = tmp_path / "venv-b"
    base = os.path.join(
        sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}"
    )  # this venv's interpreter
    subprocess.run([base, "-m", "venv", "--without-pip", str(other)], check=True, timeout=120)
    (purelib,) = glob.glob(str(other / "lib" / "python3*" / "site-packages"))
    Path(purelib, "this-checkout.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    own_bin = sysconfig.get_path("scripts")
    if os.path.exists(f"{own_bin}/ninja"):
        shutil.copy(f"{own_bin}/ninja", other / "bin" / "ninja")  # as pip installs it with DeepSpeed
    venvs = {"a": sys.executable, "b": str(other / "bin" / "python")}
    paths = {"activated": os.pathsep.join([own_bin, "/usr/bin", "/bin"]), "bare": "/usr/bin:/bin"}
    first = {name: _load_op(python, paths["bare"]) for name, python in venvs.items()}  # b builds here; a had, or builds
    assert first["a"].st_ino != first["b"].st_ino  # two folders, one build each
    for name, path in [("a", "activated"), ("b", "activated")]:  # each in turn again, under the other PATH
        now = _load_op(venvs[name], paths[path])
        assert (now.st_ino, now.st_mtime_ns) == (first[name].st_ino, first[name].st_mtime_ns), (
            f"venv {name} rebuilt its op (PATH {path})"
        )
