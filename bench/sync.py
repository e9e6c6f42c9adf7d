"""Benchmark of weight sync into a live vLLM engine, against the raw transfers underneath.

For models of ~0.3M, ~10M and ~100M parameters (tiny Qwen2 models built locally):
  collective      trainer thread -> engine workers over the gloo group, loaded in place (end to end)
  raw broadcast   the same messages (bytes) on the same group, from and into buffers allocated
                  once, all posted at once, nothing loaded: the transfer floor
  checkpoint      write checkpoints/version=<v>/ (+ commit) and load it into the engine (end to end)
  raw io          safetensors save_file of the same tensors + reading the file's bytes back
  engine load     loading an already written checkpoint into the engine (its pages in the page
                  cache; reading them is part of it)
  reload          the engine's in-place reload of the same weights from memory (no transfer, no
                  file), and its parts from a profile of it in the worker: pack (vLLM's CPU kernel
                  format: the oneDNN GEMM handle it builds per linear layer), copy (tensor copies
                  into the checkpoint-format layer and into the kernel tensors), other (the
                  layerwise reload's bookkeeping, Python per parameter and layer)
  bound           the least collective / raw broadcast this machine allows: the sender, the
                  receiver and the reload each keep a core busy (raw, raw and reload seconds), so
                  on C cores no schedule beats max(raw, reload, (2 raw + reload) / C)

    python -m bench.sync            # all three sizes (a few minutes on 2 cores)
    python -m bench.sync --quick    # skips the 100M model
    python -m bench.sync --smoke    # CI smoke test: the 0.3M model alone, one timed round
    python -m bench.sync --device cuda   # NCCL: trainer side on GPU 0, the engine on GPU 1 (one GPU: checkpoint only)

Prints a table, then one JSON line with the figures of the largest size, the device and the
hardware. On CUDA the engine runs on the device the run's plan would give it (GPU 1 beside the
trainer's GPU 0); with one GPU, collective sync cannot run (NCCL refuses the trainer and the engine
on one device): its figures are null. The reload profile and the bound are the CPU engine's
(its kernel packing) and null on CUDA.

Reading the figures: on CPU the reload costs more than the transfer (2-core dev machine, 100M
model: raw broadcast 0.16-0.19 s, reload 0.26 s, of which packing 0.11 s and copying 0.07 s), so
on 2 cores the bound is (2 raw + reload) / 2, about 1.7-1.8x the raw broadcast, and collective lands
near raw + reload: with both cores moving bytes, the pipelined stream (bucket i+1 arrives while
bucket i loads) has no spare core to overlap on; one 512 MiB bucket, no pipelining at all,
measures the same. vLLM's CPU kernels need the packing, and a packed handle cannot be updated
in place. With spare cores, or on GPU where loading is a device copy, the stream approaches
max(raw broadcast, reload) + one bucket.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench._report import add_device_arg, check_device, cuda_devices, emit_json, hardware, print_table
from rl_engine.trainer.dist import free_port

SIZES = {"0.3M": (128, 2), "10M": (512, 4), "100M": (1024, 11)}  # name -> (hidden, layers)


def _timed(*calls) -> float:
    """Run the calls concurrently (trainer + explorer threads); seconds until all returned."""
    with ThreadPoolExecutor(len(calls)) as ex:
        t0 = time.perf_counter()
        futures = [ex.submit(c) for c in calls]
        for f in futures:
            f.result(timeout=600)
        return time.perf_counter() - t0



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


def _raw_io(weights: dict[str, torch.Tensor], d: str, buf: bytearray) -> float:
    """Write the tensors as one safetensors file and read its bytes back into `buf` (no engine, no commit).

    The read goes into memory allocated (and touched) once up front, like the raw broadcast's
    buffers: the floor is the I/O, not page faults of fresh memory.
    """
    from safetensors.torch import save_file

    path = os.path.join(d, "raw.safetensors")
    t0 = time.perf_counter()
    save_file(weights, path, metadata={"format": "pt"})
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(memoryview(buf))  # load_file would only map the file; read every byte once
    dt = time.perf_counter() - t0
    assert n == os.path.getsize(path)
    os.remove(path)
    return dt


def _round(engine, sender, receiver, ckpt_cfg, weights, sizes, version: int, work: str, io_buf: bytearray) -> dict[str, float]:
    """One timed round of every method on one engine (collective where `sender` is not None); uses
    versions `version` and `version + 1`."""
    from rl_engine.board import Board
    from rl_engine.sync import build_weight_receiver, build_weight_sender

    out = {}
    if sender is not None:
        _timed(lambda: sender.prepare(version), lambda: receiver.prepare(version))  # the board handshake, not timed: the transfer and load are
        out["coll"] = _timed(lambda: sender.send(weights.items(), version), lambda: receiver.receive(engine))
        assert engine.version == version
        out["raw"] = _timed(lambda: sender.send_raw(sizes), lambda: receiver.receive_raw(engine, sizes))
    board = Board(ckpt_cfg.run_url)
    ck_sender, ck_receiver = build_weight_sender(ckpt_cfg, board), build_weight_receiver(ckpt_cfg, board)
    t0 = time.perf_counter()
    ck_sender.send(weights.items(), version + 1)
    assert ck_receiver.receive(engine, version + 1) == version + 1
    out["ckpt"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck_receiver.receive(engine, version + 1)  # again, files hot in the page cache: the in-place load alone
    out["load"] = time.perf_counter() - t0
    shutil.rmtree(ck_sender.version_dir(version + 1))
    out["io"] = _raw_io(weights, work, io_buf)
    return out


def _profile_reload(engine, weights: dict[str, torch.Tensor], d: str) -> dict[str, float]:
    """The engine's in-place reload of `weights` from memory, and its parts (worker_ext.rft_profile_reload)."""
    from safetensors.torch import save_file

    os.makedirs(d)
    save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    try:
        return engine.rpc("rft_profile_reload", d, timeout=600)[0]
    finally:
        shutil.rmtree(d)


def bench_size(name: str, hidden: int, layers: int, repeats: int, work: str, device: str = "cpu") -> dict:
    from safetensors.torch import load_file

    from rl_engine.board import Board
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.run.devices import cuda_visible
    from rl_engine.sync import build_weight_receiver, build_weight_sender
    from rl_engine.sync.buckets import pack_buckets
    from rl_engine.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(os.path.join(work, name), seed=0, hidden_size=hidden, num_layers=layers))
    weights = load_file(os.path.join(model_dir, "model.safetensors"))  # what the trainer's named_weights() yields
    n_params = sum(t.numel() for t in weights.values())
    cfg = _config(model_dir, os.path.join(work, "runs", name), "collective", free_port())
    ckpt_cfg = _config(model_dir, os.path.join(work, "runs", name), "checkpoint", 29517)
    gpus = cuda_devices() if device == "cuda" else 0
    collective = device == "cpu" or gpus >= 2  # NCCL refuses the trainer side and the engine on one device
    engine = build_rollout_engine(cfg, cuda_visible=cuda_visible([1 if gpus >= 2 else 0]) if gpus else None)
    if gpus:
        weights = {k: v.to("cuda:0") for k, v in weights.items()}  # the trainer's weights, on its GPU
    board = Board(cfg.run_url)
    sender, receiver = (build_weight_sender(cfg, board), build_weight_receiver(cfg, board)) if collective else (None, None)
    try:
        if sender is not None:
            _timed(sender.connect, lambda: receiver.connect(engine))
        bucket_bytes = max(1, int(cfg.synchronizer.collective.bucket_mb * (1 << 20)))  # as the sender packs
        sizes = [s.numel() for b in pack_buckets(weights.items(), bucket_bytes, getattr(torch, cfg.model.dtype), torch.device("cpu")) for s in b.segs]
        io_buf = bytearray(sum(t.numel() * t.element_size() for t in weights.values()) + (1 << 20))  # + header room
        times: dict[str, list[float]] = {k: [] for k in ("coll", "raw", "ckpt", "load", "io")}
        for i in range(repeats + 1):  # the first round warms up and is dropped
            got = _round(engine, sender, receiver, ckpt_cfg, weights, sizes, version=2 * i + 1, work=work, io_buf=io_buf)
            for k, v in got.items():
                if i:
                    times[k].append(v)
        reload = _profile_reload(engine, weights, os.path.join(work, "profile")) if device == "cpu" else None
    finally:
        if sender is not None:
            receiver.close()
            sender.close()
        engine.close()
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    return {
        "model": name,
        "params_M": n_params / 1e6,
        "MB": sum(sizes) / 2**20,
        "collective_s": med["coll"],
        "raw_broadcast_s": med["raw"],
        "collective_over_raw": med["coll"] / med["raw"] if collective else None,
        **_reload_figures(reload, med["raw"]),
        "engine_load_s": med["load"],
        "checkpoint_s": med["ckpt"],
        "raw_io_s": med["io"],
        "checkpoint_over_raw": med["ckpt"] / med["io"],
    }


def _reload_figures(reload: dict[str, float] | None, raw: float | None) -> dict[str, float | None]:
    """The engine's in-place reload and its parts, and the bound they set (CPU engine only)."""
    if reload is None or raw is None:
        return dict.fromkeys(("reload_s", "reload_pack_s", "reload_copy_s", "reload_other_s", "bound_over_raw"))
    # Sender, receiver and reload each keep a core busy (raw, raw and reload seconds); no
    # schedule of them on `cores` cores beats this, however well the stream pipelines.
    bound = max(raw, reload["reload"], (2 * raw + reload["reload"]) / len(os.sched_getaffinity(0)))
    return {
        "reload_s": reload["reload"],
        "reload_pack_s": reload["pack"],
        "reload_copy_s": reload["copy"],
        "reload_other_s": reload["reload"] - reload["pack"] - reload["copy"],
        "bound_over_raw": bound / raw,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="skip the ~100M-parameter model")
    size.add_argument("--smoke", action="store_true", help="CI smoke test: the ~0.3M-parameter model only, one timed round")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per size (median reported; default 5, 1 with --smoke)")
    add_device_arg(ap)
    a = ap.parse_args(argv)
    device = check_device(a.device, cpu_ok_with_cuda=False)
    if a.repeats is None:
        a.repeats = 1 if a.smoke else 5
    sizes = {"0.3M": SIZES["0.3M"]} if a.smoke else {k: v for k, v in SIZES.items() if not (a.quick and k == "100M")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as work:
        for name, (hidden, layers) in sizes.items():
            rows.append(bench_size(name, hidden, layers, a.repeats, work, device))
            print_table(rows[-1:], title=f"weight sync, {name} model (median of {a.repeats})")
    where = hardware(device)
    print_table(rows, title=f"weight sync into a live vLLM engine ({'gloo' if device == 'cpu' else 'NCCL'}, local disk); {where}")
    largest = rows[-1]
    figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in largest.items() if k != "model"}
    emit_json({"bench": "sync", "quick": a.quick, "smoke": a.smoke, "largest_model": largest["model"], "device": device, "hardware": where, **figures})


if __name__ == "__main__":
    main()
