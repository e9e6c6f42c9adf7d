"""Benchmark of the trainer on 1 and 2 data-parallel ranks (torchrun; gloo on CPU, NCCL on CUDA) on the same global batch.

For each rank count, torchrun starts the ranks; rank 0 leads (rl_engine.trainer.ranks) and
times `train_step` on a fixed GRPO batch (B rows of L tokens, groups of 4) after a warm-up step.
The first step's updated weights of both runs are compared: `update_max_abs_diff` (goal <= 1e-5
in fp32). `ideal_ratio` = 1-rank step time / (2 x 2-rank step time): 1.0 is a linear split.

    python -m bench.train            # ~10M-parameter model, batch 32 x 96 tokens, 5 timed steps
    python -m bench.train --quick    # the 0.3M model, batch 8, 3 timed steps
    python -m bench.train --smoke    # CI smoke test: the 0.3M model, batch 8 x 32 tokens, 1 timed step
    python -m bench.train --device cuda   # one rank per GPU (2 ranks only with 2 GPUs); refused without CUDA

Prints a table, then one JSON line (`step_s`: the 1-rank step; `device`, `hardware`: where it ran). Reading the figures on a 2-core CPU machine: 1 rank trains
with 2 intra-op threads, each of 2 ranks with 1, so both use the same two cores; what 2 ranks can
gain is only what one process leaves idle (Python overhead, small kernels), and what they pay is
the gradient all-reduce (gloo, through memory) and a second copy of model and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from bench._report import add_device_arg, check_device, cuda_devices, emit_json, hardware, print_table

ZERO_STAGE = 0  # the CPU default; stage 2 gives the same update (tests/rl_engine/trainer/test_ranks.py)


def _settings(model_dir: str, rows: int, micro: int, threads: int):
    """The trainer's settings: GRPO groups of 4, the run config's defaults (seed 42) otherwise."""
    from rl_engine.config import AlgorithmConfig
    from rl_engine.trainer import TrainerSettings

    return TrainerSettings(
        model_path=model_dir,
        seed=42,
        train_batch_size=rows,
        micro_batch_size=micro,
        lr=1e-4,
        num_threads=threads,
        zero_stage=ZERO_STAGE,
        algorithm=AlgorithmConfig(repeat_times=4),
    )


def _threads(ranks: int) -> int:
    """Intra-op threads per rank: the machine's cores shared evenly."""
    return max(1, (os.cpu_count() or 2) // ranks)


def synthetic_batch(rows: int, length: int, pad_id: int, prompt: int = 16, group: int = 4) -> dict[str, torch.Tensor]:
    """A right-padded GRPO batch ([B, L]): a prompt of `prompt` tokens, responses of varied length
    (from half the row, at most the rest of it), groups of `group`."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (rows, length), generator=g)  # [B, L]
    lengths = torch.randint(min(length // 2, length - prompt), length - prompt + 1, (rows,), generator=g)  # [B]
    am = (torch.arange(length)[None, :] < (prompt + lengths)[:, None]).long()  # [B, L]
    lm = am.float()
    lm[:, :prompt] = 0
    ids = torch.where(am > 0, ids, pad_id)
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "behavior_logprobs": torch.zeros(rows, length),
        "versions": torch.where(lm > 0, 0, -1).long(),
        "rewards": torch.rand(rows, generator=g),
        "group_index": torch.arange(rows) // group,
        "response_start": torch.full((rows,), prompt, dtype=torch.long),
        "response_len": lengths,
        "truncated": torch.zeros(rows, dtype=torch.long),
    }


def worker(model_dir: str, rows: int, length: int, micro: int, steps: int, out: str) -> None:
    """One rank (started by torchrun): rank 0 times the steps and writes OUT/result.json and the first update."""
    from safetensors.torch import save_file

    from rl_engine.trainer import build_trainer
    from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer
    from rl_engine.trainer.ranks import follow

    world = int(os.environ["WORLD_SIZE"])
    settings = _settings(model_dir, rows, micro, threads=_threads(world))
    if int(os.environ["RANK"]) != 0:
        follow(DeepSpeedTrainer(settings))
        _leave_group()
        return
    trainer = build_trainer(settings)
    batch = synthetic_batch(rows, length, trainer.pad_token_id)
    times, tokens = [], 0.0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        m = trainer.train_step(batch)
        if step == 0:  # the warm-up step: its update is the one compared across rank counts
            save_file(
                {n: t.detach().cpu().contiguous() for n, t in trainer.named_weights()},
                os.path.join(out, "first-update.safetensors"),
            )
        else:
            times.append(time.perf_counter() - t0)
            tokens += m["tokens"]
    trainer.close()
    _leave_group()
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(
            {
                "step_s": sum(times) / len(times),
                "tokens_per_s": tokens / sum(times),
                "tokens_per_step": tokens / len(times),
            },
            f,
        )


def _leave_group() -> None:
    """Destroy the process group after the last collective, on every rank, while the interpreter is
    whole: left to interpreter exit, gloo's threads can outlive it and abort the rank (SIGABRT,
    "terminate called without an active exception", pytorch/pytorch#190489); a follower rank of
    `--quick` died so once on a loaded 2-core machine."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _run(ranks: int, model_dir: str, rows: int, length: int, micro: int, steps: int, out: str, device: str) -> dict:
    os.makedirs(out, exist_ok=True)
    from rl_engine.trainer.launch import launcher_env

    # cuda: rank r on cuda:r (DeepSpeed's CUDA accelerator, NCCL); cpu: no device visible to the ranks.
    env = {**launcher_env(), **({} if device == "cuda" else {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        "-m",
        "bench.train",
        "--worker",
        model_dir,
        str(rows),
        str(length),
        str(micro),
        str(steps),
        out,
    ]
    subprocess.run(cmd, env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI-sized: the 0.3M model, batch 8, 3 timed steps")
    size.add_argument(
        "--smoke", action="store_true", help="CI smoke test: the 0.3M model, batch 8 x 32 tokens, 1 timed step"
    )
    add_device_arg(p)
    p.add_argument(
        "--worker", nargs=6, metavar=("MODEL", "ROWS", "LENGTH", "MICRO", "STEPS", "OUT"), help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if args.worker:
        model_dir, rows, length, micro, steps, out = args.worker
        return worker(model_dir, int(rows), int(length), int(micro), int(steps), out)
    device = check_device(args.device)
    rank_counts = (1, 2) if device == "cpu" or cuda_devices() >= 2 else (1,)  # one rank per GPU
    from safetensors.torch import load_file

    from rl_engine.tiny_model import make_tiny_model

    hidden, layers, rows, length, micro, steps = (
        (128, 2, 8, 32, 4, 1) if args.smoke else (128, 2, 8, 48, 4, 3) if args.quick else (512, 4, 32, 96, 4, 5)
    )
    work = tempfile.mkdtemp(prefix="bench-train-")
    try:
        model_dir = str(make_tiny_model(os.path.join(work, "model"), seed=0, hidden_size=hidden, num_layers=layers))
        params = sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
        res = {
            n: _run(n, model_dir, rows, length, micro, steps, os.path.join(work, f"ranks={n}"), device)
            for n in rank_counts
        }
        w = {n: load_file(os.path.join(work, f"ranks={n}", "first-update.safetensors")) for n in rank_counts}
        diff = max(float((w[1][k] - w[2][k]).abs().max()) for k in w[1]) if 2 in w else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    two = res.get(2)
    rows_out = [
        {
            "ranks": n,
            "threads/rank": _threads(n),
            "step_s": r["step_s"],
            "tokens/s": r["tokens_per_s"],
            "ideal step_s": res[1]["step_s"] / n,
        }
        for n, r in res.items()
    ]
    where = f"{os.cpu_count()} cores" if device == "cpu" else hardware(device)
    print_table(
        rows_out,
        title=f"trainer step, {params / 1e6:.1f}M parameters, batch {rows} x {length} tokens, micro-batch {micro}, ZeRO {ZERO_STAGE}, {where}",
    )
    if two:
        print(
            f"2 ranks vs 1: {res[1]['step_s'] / two['step_s']:.2f}x faster (linear: 2x); first update max |2 ranks - 1 rank| = {diff:.2e}"
        )
    emit_json(
        {
            "params": params,
            "device": device,
            "hardware": hardware(device),
            "step_s": res[1]["step_s"],
            "step_s_1rank": res[1]["step_s"],
            "step_s_2rank": two and two["step_s"],
            "tokens_per_s_1rank": res[1]["tokens_per_s"],
            "tokens_per_s_2rank": two and two["tokens_per_s"],
            "ideal_ratio": two and res[1]["step_s"] / (2 * two["step_s"]),
            "update_max_abs_diff": diff,
        }
    )


if __name__ == "__main__":
    main()
