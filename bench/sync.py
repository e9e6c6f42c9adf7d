"""Benchmark of weight sync into a live vLLM engine, against the raw transfers underneath.

For models of ~0.3M, ~10M and ~100M parameters (tiny Qwen2 models built locally):
  collective      trainer thread -> engine workers, loaded in place (end to end), the default way on
                  one host: the bytes through the shared-memory file, the gloo group carrying the
                  bucket headers (rl_engine.sync.shm)
  collective stream  the same with `collective.shared_memory: false`: the bytes over the gloo stream
                  (the way to workers on other hosts)
  raw broadcast   the same messages (bytes) on a gloo group, from and into buffers allocated
                  once, all posted at once, nothing loaded: the stream's transfer floor
  checkpoint      write checkpoints/version=<v>/ (+ commit) and load it into the engine (end to end)
  raw io          safetensors save_file of the same tensors + reading the file's bytes back
  engine load     loading an already written checkpoint into the engine (its pages in the page
                  cache; reading them is part of it)
  reload          the engine's in-place reload of the same weights from memory (no transfer, no
                  file), and its parts from a profile of it in the worker: pack (vLLM's CPU kernel
                  format: the oneDNN GEMM handle it builds per linear layer), copy (tensor copies
                  into the checkpoint-format layer and into the kernel tensors), other (the
                  layerwise reload's bookkeeping, Python per parameter and layer)
  bound           the least collective stream / raw broadcast this machine allows: the sender, the
                  receiver and the reload each keep a core busy (raw, raw and reload seconds), so
                  on C cores no schedule beats max(raw, reload, (2 raw + reload) / C)
  collective_over_reload  collective over the reload: how close the default sync comes to the
                  engine's own floor (issue 48's goal for a real run: <= 1.2)
  delta           checkpoint sync of one trainer step into a second engine, in bfloat16, which
                  holds the previous version: full checkpoints against deltas (synchronizer.delta),
                  bytes written per sync (the version's directory: files + marker) and sync time
                  (write + load). The step is Adam's first (every element moves by exactly lr:
                  bias-corrected m / sqrt(v) = sign(g)), at lr 1e-6 (a usual RL lr for LLMs) and at
                  the demo's first lr (5e-5 at warmup step 1 of 3); `changed`: the fraction of
                  elements whose bfloat16 value moved. In float32 the same step moves every
                  element: delta_over_full_fp32 is the size such a delta's (compressed) file would
                  have (the sender publishes a version in full when it would exceed half of that)
  demo            delta_bytes_ratio: bytes written for version 1 / version 0 (full) after one real
                  trainer step of the demo (configs/demo.yaml, its warm-started model built here
                  unless --demo-model, a GRPO batch of its arithmetic tasks, delta sync on), in its
                  float32 and with model.dtype bfloat16 (delta_bytes_ratio_bf16); --smoke skips the
                  warm start (the tiny model as initialised)

    python -m bench.sync            # all three sizes (a few minutes on 2 cores)
    python -m bench.sync --quick    # skips the 100M model
    python -m bench.sync --smoke    # CI smoke test: the 0.3M model alone, one timed round
    python -m bench.sync --device cuda   # NCCL: trainer side on GPU 0, the engine on GPU 1 (one GPU: checkpoint only)

Prints a table, then one JSON line with the figures of the largest size, the device and the
hardware. On CUDA the engine runs on the device the run's plan would give it (GPU 1 beside the
trainer's GPU 0); with one GPU, collective sync cannot run (NCCL refuses the trainer and the engine
on one device): its figures are null. The reload profile and the bound are the CPU engine's
(its kernel packing) and null on CUDA.

The JSON line also carries `delta_bytes_ratio` (the demo's, float32), `delta_bytes_ratio_bf16` and
`delta` (per size: bytes and seconds, full vs delta; CPU only).

Reading the figures: on CPU the reload costs more than the transfer, and a gloo stream keeps
both ends busy copying bytes through the kernel: with sender, receiver and reload each needing a
core, two cores allow a stream no better than (2 raw + reload) / 2, and it lands near raw + reload
(one 512 MiB bucket, no pipelining at all, measures the same). Through shared memory the receiver
copies nothing and the trainer copies each byte once, into the file, while the engine loads the
previous bucket: the sync approaches the reload alone. vLLM's CPU kernels need the packing, and a
packed handle cannot be updated in place. On GPU (NCCL) the stream is the only way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench._report import add_device_arg, check_device, cuda_devices, emit_json, hardware, print_table
from rl_engine.trainer.dist import free_port

SIZES = {"0.3M": (128, 2), "10M": (512, 4), "100M": (1024, 11)}  # name -> (hidden, layers)
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
DEMO_FIRST_LR = 5e-5 / 3  # the demo's lr at warmup step 1 of 3 (its trainer reports lr 1.67e-5 at step 1)
LLM_LR = 1e-6
DELTA_COLUMNS = [
    "full_MB_written",
    "full_sync_s",
    "delta_MB_written",
    "delta_sync_s",
    "delta_over_full",
    "changed",
    "delta_demo_lr_MB_written",
    "delta_demo_lr_sync_s",
    "delta_over_full_demo_lr",
    "changed_demo_lr",
    "delta_over_full_fp32",
]


def _timed(*calls) -> float:
    """Run the calls concurrently (trainer + explorer threads); seconds until all returned."""
    with ThreadPoolExecutor(len(calls)) as ex:
        t0 = time.perf_counter()
        futures = [ex.submit(c) for c in calls]
        for f in futures:
            f.result(timeout=600)
        return time.perf_counter() - t0


def _config(
    model_dir: str,
    run_root: str,
    method: str,
    port: int,
    delta: bool = False,
    dtype: str = "float32",
    shared_memory: bool = True,
):
    from rl_engine.config import RFTConfig

    return RFTConfig.model_validate(
        {
            "name": "bench",
            "model": {"path": model_dir, "max_model_len": 128, "dtype": dtype},
            "taskset": {"path": "unused.jsonl"},
            "explorer": {"engine": {"kv_cache_space_gib": 0.25}, "sampling": {"max_tokens": 16}},
            "buffer": {"storage": {"url": run_root}},
            "synchronizer": {
                "sync_method": method,
                "collective": {"port": port, "shared_memory": shared_memory},
                "delta": {"enabled": delta, "full_every": 1000},
            },
        }
    )


def _dir_bytes(d: str) -> int:
    """Bytes written for one version: every file of its directory."""
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def adam_first_step(weights: dict[str, torch.Tensor], lr: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights after Adam's first step: every element with a gradient moves by exactly lr
    (bias-corrected m / sqrt(v) = sign(g)); the gradient's signs drawn at random."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: t + lr * torch.sign(torch.randn(t.shape, generator=g)) if t.is_floating_point() else t
        for k, t in weights.items()
    }


def delta_ratio(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[float, float]:
    """(delta file / full payload bytes: the compressed file a delta of one step published in
    `dtype` would write, whether or not the sender would publish it; fraction of elements changed)."""
    from rl_engine.sync.delta_format import diff, pack, payload_bytes

    cast = lambda w: {k: t.to(dtype) if t.is_floating_point() else t for k, t in w.items()}  # noqa: E731
    old, new = cast(before), cast(after)
    delta = diff(old, new)
    changed = sum(int((old[k] != new[k]).sum()) for k in old)  # NaN-free weights: value and bit changes agree
    return len(pack(delta)[0]) / payload_bytes(new.values()), changed / sum(t.numel() for t in new.values())


def _written(run_url: str, version: int) -> int:
    """Bytes written for one published version: every file of its directory, full or delta."""
    dirs = [os.path.join(run_url, "checkpoints", f"{kind}={version}") for kind in ("version", "delta")]
    return sum(_dir_bytes(d) for d in dirs if os.path.isdir(d))


def bench_delta(model_dir: str, run_root: str, weights: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Checkpoint sync of one trainer step into a live bfloat16 engine that holds the previous
    version: full checkpoints, and deltas at lr 1e-6 and at the demo's lr; the float32 delta's size."""
    from rl_engine.board import Board
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.sync import build_weight_receiver, build_weight_sender

    out: dict[str, float] = {}
    out["delta_over_full_fp32"], _ = delta_ratio(weights, adam_first_step(weights, DEMO_FIRST_LR), torch.float32)
    engine = build_rollout_engine(_config(model_dir, run_root, "checkpoint", 29517, dtype="bfloat16"))
    try:
        for label, delta, lr in (
            ("full", False, LLM_LR),
            ("delta", True, LLM_LR),
            ("delta_demo_lr", True, DEMO_FIRST_LR),
        ):
            cfg = _config(model_dir, os.path.join(run_root, label), "checkpoint", 29517, delta=delta, dtype="bfloat16")
            board = Board.at(cfg.run_url)
            sender, receiver = build_weight_sender(cfg, board), build_weight_receiver(cfg, board)
            stepped = adam_first_step(weights, lr)
            sender.send(weights.items(), 0)  # the version the explorer holds (not timed)
            assert receiver.receive(engine, 0) == 0
            times, sizes = [], []
            for v in range(1, repeats + 2):  # the first round warms up and is dropped
                t0 = time.perf_counter()
                sender.send(
                    (stepped if v % 2 else weights).items(), v
                )  # one step forward, one back: each a real step's change
                assert receiver.receive(engine, v) == v
                dt = time.perf_counter() - t0
                assert not delta or (sender.last.kind == "delta" and receiver.last_route["start"] == "held")
                sizes.append(_written(cfg.run_url, v))
                if v > 1:
                    times.append(dt)
            out[f"{label}_MB_written"], out[f"{label}_sync_s"] = (
                statistics.median(sizes) / 2**20,
                statistics.median(times),
            )
            shutil.rmtree(cfg.run_url)
    finally:
        engine.close()
    out["delta_over_full"] = out["delta_MB_written"] / out["full_MB_written"]
    out["delta_over_full_demo_lr"] = out["delta_demo_lr_MB_written"] / out["full_MB_written"]
    out["changed"] = delta_ratio(weights, adam_first_step(weights, LLM_LR), torch.bfloat16)[1]
    out["changed_demo_lr"] = delta_ratio(weights, adam_first_step(weights, DEMO_FIRST_LR), torch.bfloat16)[1]
    return out


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


def _round(
    engine, sender, receiver, ckpt_cfg, weights, sizes, version: int, work: str, io_buf: bytearray
) -> dict[str, float]:
    """One timed round of every method on one engine (collective where `sender` is not None); uses
    versions `version` and `version + 1`."""
    from rl_engine.board import Board
    from rl_engine.sync import build_weight_receiver, build_weight_sender

    out = {}
    if sender is not None:
        out["coll"] = _sync_once(engine, sender, receiver, weights, version)
        out["raw"] = _timed(lambda: sender.send_raw(sizes), lambda: receiver.receive_raw(engine, sizes))
    board = Board.at(ckpt_cfg.run_url)
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


def _sync_once(engine, sender, receiver, weights, version: int) -> float:
    """Seconds of one collective sync of `version`: the transfer and the load (the board handshake
    before it is not timed)."""
    _timed(lambda: sender.prepare(version), lambda: receiver.prepare(version))
    seconds = _timed(lambda: sender.send(weights.items(), version), lambda: receiver.receive(engine))
    assert engine.version == version
    return seconds


def _stream_rounds(engine, sender, receiver, weights, repeats: int, version: int) -> list[float]:
    """Seconds of `repeats` collective syncs (after one dropped warm-up) from versions `version` on."""
    return [_sync_once(engine, sender, receiver, weights, version + i) for i in range(repeats + 1)][1:]


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
    board = Board.at(cfg.run_url)
    sender, receiver = (
        (build_weight_sender(cfg, board), build_weight_receiver(cfg, board)) if collective else (None, None)
    )
    try:
        if sender is not None:
            _timed(sender.connect, lambda: receiver.connect(engine))
        bucket_bytes = max(1, int(cfg.synchronizer.collective.bucket_mb * (1 << 20)))  # as the sender packs
        sizes = [
            s.numel()
            for b in pack_buckets(weights.items(), bucket_bytes, getattr(torch, cfg.model.dtype), torch.device("cpu"))
            for s in b.segs
        ]
        io_buf = bytearray(sum(t.numel() * t.element_size() for t in weights.values()) + (1 << 20))  # + header room
        times: dict[str, list[float]] = {k: [] for k in ("coll", "raw", "ckpt", "load", "io")}
        for i in range(repeats + 1):  # the first round warms up and is dropped
            got = _round(
                engine, sender, receiver, ckpt_cfg, weights, sizes, version=2 * i + 1, work=work, io_buf=io_buf
            )
            for k, v in got.items():
                if i:
                    times[k].append(v)
        reload = _profile_reload(engine, weights, os.path.join(work, "profile")) if device == "cpu" else None
        if sender is not None and device == "cpu":  # the same collective sync over the gloo stream
            receiver.close()
            sender.close()
            stream_cfg = _config(
                model_dir, os.path.join(work, "runs", f"{name}-stream"), "collective", free_port(), shared_memory=False
            )  # a board of its own: the closed sender abandoned every later version on the first
            board = Board.at(stream_cfg.run_url)
            sender, receiver = build_weight_sender(stream_cfg, board), build_weight_receiver(stream_cfg, board)
            _timed(sender.connect, lambda: receiver.connect(engine))
            assert sender.transport == "stream"
            times["stream"] = _stream_rounds(engine, sender, receiver, weights, repeats, 2 * repeats + 3)
    finally:
        if sender is not None:
            receiver.close()
            sender.close()
        engine.close()
    # the delta figures are the CPU engine's (a bfloat16 engine beside the first)
    delta = (
        bench_delta(model_dir, os.path.join(work, "runs", name, "delta"), weights, repeats)
        if device == "cpu"
        else dict.fromkeys(DELTA_COLUMNS)
    )
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    return {
        "model": name,
        "params_M": n_params / 1e6,
        "MB": sum(sizes) / 2**20,
        "collective_s": med["coll"],
        "collective_stream_s": med.get("stream"),
        "raw_broadcast_s": med["raw"],
        "collective_over_raw": med["coll"] / med["raw"] if collective else None,
        **_reload_figures(reload, med["raw"]),
        "collective_over_reload": med["coll"] / reload["reload"] if collective and reload else None,
        "engine_load_s": med["load"],
        "checkpoint_s": med["ckpt"],
        "raw_io_s": med["io"],
        "checkpoint_over_raw": med["ckpt"] / med["io"],
        **delta,
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


def _demo_batch(trainer, cfg, model: str) -> dict[str, torch.Tensor]:
    """One GRPO batch of the demo's shape (batch_size arithmetic tasks x repeat_times answers, half
    right: rewards 1, 0, ...), on-policy (behavior logprobs are the trainer's own)."""
    from transformers import AutoTokenizer

    from harness.real_model import experience_rows
    from rl_engine.demos.arithmetic import make_arithmetic_tasks
    from rl_engine.rewards import Task, encode_task
    from rl_engine.rollout.engine import Rollout

    tok = AutoTokenizer.from_pretrained(model)
    groups = []
    for row in make_arithmetic_tasks(cfg.explorer.batch_size, seed=1):
        _, prompt = encode_task(
            tok, cfg.taskset.template, Task(row["id"], row["question"], row["answer"]), cfg.model.max_model_len
        )
        answers = [
            row["answer"] if j % 2 == 0 else str(int(row["answer"]) + j) for j in range(cfg.algorithm.repeat_times)
        ]
        responses = [tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id] for a in answers]
        groups.append([Rollout(prompt, r, [0.0] * len(r), "stop", 0) for r in responses])
    t = experience_rows(groups).to_tensors(trainer.pad_token_id)
    t["behavior_logprobs"] = trainer.compute_logprobs(t).cpu() * t["loss_mask"]
    return t


def demo_delta(work: str, model: str | None, smoke: bool) -> dict[str, float]:
    """Delta / full checkpoint bytes written after one trainer step of the demo, in float32 (its
    config) and with model.dtype bfloat16 (trainer and engine in bfloat16)."""
    from rl_engine.board import Board
    from rl_engine.config import load_config
    from rl_engine.demos.warmstart import main as warmstart
    from rl_engine.sync import build_weight_sender
    from rl_engine.tiny_model import make_tiny_model
    from rl_engine.trainer import build_trainer, trainer_settings

    if model is None and smoke:  # a smoke run checks the path, not the figure: the demo's model before its warm start
        model = str(make_tiny_model(os.path.join(work, "tiny-demo"), seed=0))
    elif model is None:
        model = os.path.join(work, "tiny-arith-sft")
        warmstart([model])
    out: dict[str, float] = {}
    for dtype, key in (("float32", "delta_bytes_ratio"), ("bfloat16", "delta_bytes_ratio_bf16")):
        sets = [
            f"model.path={model}",
            f"model.dtype={dtype}",
            f"buffer.storage.url={work}/demo-runs",
            f"name=demo-{dtype}",
            "synchronizer.sync_method=checkpoint",
            "synchronizer.delta.enabled=true",
        ]
        cfg = load_config(DEMO_CONFIG, sets)
        trainer = build_trainer(trainer_settings(cfg))
        try:
            sender = build_weight_sender(cfg, Board.at(cfg.run_url))
            sender.send(trainer.named_weights(), 0)
            before = sender.base
            trainer.train_step(_demo_batch(trainer, cfg, model))
            sender.send(trainer.named_weights(), 1)
        finally:
            trainer.close()
        full, written = _dir_bytes(sender.version_dir(0)), _written(cfg.run_url, 1)
        out[key] = written / full  # float32: version 1 went out in full (a delta would have been as large)
        out[f"demo_published_{dtype}"] = sender.last.kind
        out[f"demo_delta_file_ratio_{dtype}"], out[f"demo_changed_{dtype}"] = delta_ratio(
            before, sender.base, getattr(torch, dtype)
        )
        out[f"demo_full_KB_{dtype}"], out[f"demo_written_KB_{dtype}"] = full / 1024, written / 1024
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="skip the ~100M-parameter model")
    size.add_argument(
        "--smoke", action="store_true", help="CI smoke test: the ~0.3M-parameter model only, one timed round"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed rounds per size (median reported; default 5, 1 with --smoke)"
    )
    add_device_arg(ap)
    ap.add_argument(
        "--demo-model",
        default=None,
        help="the demo's warm-started model for delta_bytes_ratio (default: build one, `rft warmstart`, seed 0)",
    )
    a = ap.parse_args(argv)
    device = check_device(a.device, cpu_ok_with_cuda=False)
    if a.repeats is None:
        a.repeats = 1 if a.smoke else 5
    sizes = {"0.3M": SIZES["0.3M"]} if a.smoke else {k: v for k, v in SIZES.items() if not (a.quick and k == "100M")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as work:
        for name, (hidden, layers) in sizes.items():
            rows.append(bench_size(name, hidden, layers, a.repeats, work, device))
            print_table(
                rows[-1:],
                columns=[k for k in rows[-1] if k not in DELTA_COLUMNS],
                title=f"weight sync, {name} model (median of {a.repeats})",
            )
        demo = demo_delta(work, a.demo_model, a.smoke) if device == "cpu" else {}
    where = hardware(device)
    print_table(
        rows,
        columns=[k for k in rows[0] if k not in DELTA_COLUMNS],
        title=f"weight sync into a live vLLM engine ({'gloo' if device == 'cpu' else 'NCCL'}, local disk); {where}",
    )
    if device == "cpu":
        print_table(
            rows,
            columns=["model", *DELTA_COLUMNS],
            title="checkpoint sync of one Adam step into a bfloat16 engine: full vs delta (lr 1e-6, demo lr); float32: delta size only",
        )
        print_table([demo], title="the demo after one trainer step: delta / full checkpoint bytes")
    largest = rows[-1]
    r4 = lambda v: round(v, 4) if isinstance(v, float) else v  # noqa: E731
    emit_json(
        {
            "bench": "sync",
            "quick": a.quick,
            "smoke": a.smoke,
            "largest_model": largest["model"],
            "device": device,
            "hardware": where,
            **{k: r4(v) for k, v in largest.items() if k != "model"},
            **{k: r4(v) for k, v in demo.items()},
            "delta": {r["model"]: {k: r4(r[k]) for k in DELTA_COLUMNS} for r in rows},
        }
    )


if __name__ == "__main__":
    main()
