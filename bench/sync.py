"""Benchmark of weight sync into a live vLLM engine, against the raw transfers underneath.

For models of ~0.3M, ~10M and ~100M parameters (tiny Qwen2 models built locally):
  collective      trainer thread -> engine workers over the gloo group, loaded in place (end to end)
  raw broadcast   the same bytes in the same buckets on the same group, received and dropped
  checkpoint      write checkpoints/version=<v>/ (+ commit) and load it into the engine (end to end)
  raw io          safetensors save_file + load_file of the same tensors in this process

    python -m bench.sync            # all three sizes (a few minutes on 2 cores)
    python -m bench.sync --quick    # skips the 100M model

Prints a table, then one JSON line with the figures of the largest size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench._report import emit_json, print_table

SIZES = {"0.3M": (128, 2), "10M": (512, 4), "100M": (1024, 11)}  # name -> (hidden, layers)


def _timed(*calls) -> float:
    """Run the calls concurrently (trainer + explorer threads); seconds until all returned."""
    with ThreadPoolExecutor(len(calls)) as ex:
        t0 = time.perf_counter()
        futures = [ex.submit(c) for c in calls]
        for f in futures:
            f.result(timeout=600)
        return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model_dir: str, run_root: str, method: str, port: int):
    from rl_engine.config import RFTConfig

    return RFTConfig.model_validate(
        {
            "name": "bench",
            "model": {"path": model_dir, "max_model_len": 128},
            "taskset": {"path": "unused.jsonl"},
            "explorer": {"engine": {"kv_cache_space_gib": 0.25}, "sampling": {"max_tokens": 16}},
            "buffer": {"storage": {"url": run_root}},
            "synchronizer": {"sync_method": method, "collective": {"port": port}},
        }
    )


def _raw_io(weights: dict[str, torch.Tensor], d: str) -> float:
    """Write the tensors as one safetensors file, read it back into memory (no engine, no commit)."""
    from safetensors.torch import load, save_file

    path = os.path.join(d, "raw.safetensors")
    t0 = time.perf_counter()
    save_file(weights, path, metadata={"format": "pt"})
    with open(path, "rb") as f:
        loaded = load(f.read())  # load_file would map the file lazily and read nothing yet
    dt = time.perf_counter() - t0
    assert len(loaded) == len(weights)
    os.remove(path)
    return dt


def bench_size(name: str, hidden: int, layers: int, repeats: int, work: str) -> dict:
    from safetensors.torch import load_file

    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.sync import build_weight_receiver, build_weight_sender
    from rl_engine.sync.buckets import pack_buckets
    from rl_engine.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(os.path.join(work, name), seed=0, hidden_size=hidden, num_layers=layers))
    weights = load_file(os.path.join(model_dir, "model.safetensors"))  # what the trainer's named_weights() yields
    n_params = sum(t.numel() for t in weights.values())
    cfg = _config(model_dir, os.path.join(work, "runs", name), "collective", free_port())
    ckpt_cfg = _config(model_dir, os.path.join(work, "runs", name), "checkpoint", 29517)
    engine = build_rollout_engine(cfg)
    sender, receiver = build_weight_sender(cfg), build_weight_receiver(cfg)
    try:
        _timed(sender.connect, lambda: receiver.connect(engine))
        bucket_bytes = sender.bucket_bytes
        sizes = [s.numel() for b in pack_buckets(weights.items(), bucket_bytes, sender.wire_dtype, torch.device("cpu")) for s in b.segs]
        version = 0
        coll, raw, ckpt, io = [], [], [], []
        for i in range(repeats + 1):  # the first round warms up and is dropped
            version += 1
            c = _timed(lambda: sender.send(weights.items(), version), lambda: receiver.receive(engine))
            assert engine.version == version
            r = _timed(lambda: sender.send_raw(sizes), lambda: receiver.receive_raw(engine, sizes))
            version += 1
            ck_sender, ck_receiver = build_weight_sender(ckpt_cfg), build_weight_receiver(ckpt_cfg)
            t0 = time.perf_counter()
            ck_sender.send(weights.items(), version)
            assert ck_receiver.receive(engine, version) == version
            k = time.perf_counter() - t0
            shutil.rmtree(ck_sender.version_dir(version))
            o = _raw_io(weights, work)
            if i:
                coll.append(c), raw.append(r), ckpt.append(k), io.append(o)
    finally:
        receiver.close()
        sender.close()
        engine.close()
    med = statistics.median
    return {
        "model": name,
        "params_M": n_params / 1e6,
        "MB": sum(sizes) / 2**20,
        "collective_s": med(coll),
        "raw_broadcast_s": med(raw),
        "collective_over_raw": med(coll) / med(raw),
        "checkpoint_s": med(ckpt),
        "raw_io_s": med(io),
        "checkpoint_over_raw": med(ckpt) / med(io),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the ~100M-parameter model")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per size (median reported)")
    a = ap.parse_args(argv)
    sizes = {k: v for k, v in SIZES.items() if not (a.quick and k == "100M")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as work:
        for name, (hidden, layers) in sizes.items():
            rows.append(bench_size(name, hidden, layers, a.repeats, work))
            print_table(rows[-1:], title=f"weight sync, {name} model (median of {a.repeats})")
    print_table(rows, title="weight sync into a live vLLM CPU engine (gloo, local disk); shared 2-core machine")
    largest = rows[-1]
    emit_json({"bench": "sync", "quick": a.quick, "largest_model": largest["model"], **{k: round(v, 4) if isinstance(v, float) else v for k, v in largest.items() if k != "model"}})


if __name__ == "__main__":
    main()
