"""Shared output of the benchmarks: an aligned text table, then one JSON line (machine-readable,
last); and their `--device` flag: which device they run on, refused where it is absent, and the
hardware named in the JSON line.

    from bench._report import print_table, emit_json
    print_table([{"op": "write", "MB/s": 512.3}], title="buffer")
    emit_json({"write_ratio_vs_pyarrow": 0.93, "device": a.device, "hardware": hardware(a.device)})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Iterable
from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def print_table(
    rows: Iterable[dict[str, Any]], columns: list[str] | None = None, title: str | None = None, file=None
) -> None:
    """Print dict rows as a table; columns default to the keys of the first row, in order."""
    rows = list(rows)
    out = file or sys.stdout
    if title:
        print(title, file=out)
    if not rows:
        print("  (no rows)", file=out)
        return
    cols = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)
    out.flush()


def emit_json(result: dict[str, Any]) -> None:
    """The final line of a benchmark's output: one JSON object."""
    print(json.dumps(result, sort_keys=True), flush=True)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda` (default: cuda where a CUDA device is visible, else cpu)."""
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to run: cuda needs a visible CUDA device (the CUDA build: make setup-gpu); default cuda if one is visible, else cpu",
    )


def cuda_devices() -> int:
    """CUDA devices visible here, counted through NVML (CUDA stays unstarted: vLLM may still fork)."""
    import torch

    return torch.cuda.device_count()


def check_device(device: str | None, cpu_ok_with_cuda: bool = True) -> str:
    """The device a benchmark runs on; exits (code 2, saying why and what to do) for `cuda` without
    a CUDA device, and for `cpu` where the code can only use the GPU it sees (`cpu_ok_with_cuda`
    False: vLLM's CUDA build runs its engine on the GPU)."""
    n = cuda_devices()
    device = device or ("cuda" if n else "cpu")
    if device == "cuda" and n == 0:
        _refuse(
            "--device cuda: no CUDA device is visible here (torch sees none); run on a GPU machine with the CUDA build (make setup-gpu), or use --device cpu"
        )
    if device == "cpu" and n and not cpu_ok_with_cuda:
        _refuse(
            f"--device cpu: this machine shows {n} CUDA device(s) and vLLM's CUDA build runs its engine on them; use --device cuda (or the CPU build on a machine without CUDA)"
        )
    return device


def _refuse(why: str) -> None:
    print(why, file=sys.stderr)
    raise SystemExit(2)


def hardware(device: str) -> str:
    """What a benchmark ran on, for its JSON line: the GPUs' model and count (CUDA starts here:
    call it after the engines are gone), or the CPU's model and the cores this process may use."""
    if device == "cuda":
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    return f"{_cpu_model()}, {len(os.sched_getaffinity(0))} cores"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def scratch_dir(prefix: str) -> str:
    """A new temporary directory for a bench's models, tasks and runs, removed when the process
    exits (a smoke run in the suite writes tens of MB; a full run, GBs)."""
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
