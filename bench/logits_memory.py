"""Peak memory and time of one policy-loss forward+backward: full [B, L, V] logits vs the chunked head.

    python -m bench.logits_memory                     # runs/models/smollm2-135m, B=16, L=96 (32 prompt + 64 response)
    python -m bench.logits_memory --model DIR --batch 16 --length 96 --chunk 512 --repeats 3

Each path runs in a fresh subprocess (CPU, float32): the model is loaded, one warm-up step runs,
then `--repeats` timed steps. Peak = ru_maxrss at the end minus ru_maxrss after the model load
(ru_maxrss is the process's high-water mark, so this is the most the steps ever added: activations,
logits, gradients). The steps are the trainer's (`DeepSpeedTrainer._policy_micro_loss` without
DeepSpeed): full = model(...).logits -> token_logprobs + token_entropy; chunked = the decoder's last
hidden state -> chunked_token_logprobs over the response positions. Loss: GRPO's PPO-clip
(`policy_loss`) with old logprobs = the current ones and random advantages.

JSON keys: `<path>_peak_mb`, `<path>_step_s` (median) for full and chunked, `peak_saving_mb`,
`logits_mb` (one [B, L, V] float32 tensor), `max_logprob_diff` (chunked vs full, same weights).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "runs" / "models" / "smollm2-135m"


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def run_one(path: str, model_dir: str, batch: int, length: int, prompt: int, chunk: int, repeats: int) -> dict:
    """One path in this process: {"peak_mb", "step_s", "logprobs"} (logprobs [B, L] as lists)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_engine.algorithms import chunked_token_logprobs, policy_loss, token_entropy, token_logprobs
    from rl_engine.config import AlgorithmConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=g)  # [B, L]
    am = torch.ones(batch, length, dtype=torch.long)  # [B, L]
    mask = torch.zeros(batch, length)  # [B, L]
    mask[:, prompt:] = 1
    adv = torch.randn(batch, generator=g)  # [B]
    algo = AlgorithmConfig()
    head = model.get_output_embeddings()
    baseline = _maxrss_mb()

    def step() -> torch.Tensor:
        if path == "full":
            logits = model(input_ids=ids, attention_mask=am).logits  # [B, L, V]
            logp = token_logprobs(logits, ids)  # [B, L]
            with torch.no_grad():
                ent = token_entropy(logits.detach())  # [B, L]
        else:
            hidden = model.model(input_ids=ids, attention_mask=am).last_hidden_state  # [B, L, H]
            logp, ent = chunked_token_logprobs(hidden, head.weight, head.bias, ids, 1.0, chunk, mask)  # [B, L] x 2
        out = policy_loss(logp, logp.detach(), adv, mask, algo, None, float(mask.sum()), float(batch))
        out.loss.backward()
        float((ent * mask).sum())  # the entropy metric, as the trainer takes it
        model.zero_grad(set_to_none=True)
        return logp.detach()

    logp = step()  # warm-up (allocator, first-call work)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_mb": _maxrss_mb() - baseline, "step_s": statistics.median(times), "logprobs": (logp * mask).tolist()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--prompt", type=int, default=32, help="prompt positions (mask 0) at the start of each row")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", choices=["full", "chunked"], help=argparse.SUPPRESS)  # the subprocess side
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(run_one(a.one, a.model, a.batch, a.length, a.prompt, a.chunk, a.repeats)))
        return {}
    import torch

    from bench._report import emit_json, print_table

    res = {}
    for path in ("full", "chunked"):
        cmd = [
            sys.executable,
            "-m",
            "bench.logits_memory",
            "--one",
            path,
            *(f"--{k}={getattr(a, k)}" for k in ("model", "batch", "length", "prompt", "chunk", "repeats")),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[path] = json.loads(out.strip().splitlines()[-1])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    logits_mb = a.batch * a.length * vocab * 4 / 2**20
    diff = float((torch.tensor(res["full"]["logprobs"]) - torch.tensor(res["chunked"]["logprobs"])).abs().max())
    rows = [{"path": k, "peak_mb": v["peak_mb"], "step_s": v["step_s"]} for k, v in res.items()]
    print_table(
        rows,
        title=f"policy loss fwd+bwd, {Path(a.model).name}, B={a.batch} L={a.length} V={vocab}, chunk={a.chunk} (CPU float32, {torch.get_num_threads()} threads)",
    )
    result = {
        "full_peak_mb": round(res["full"]["peak_mb"], 1),
        "chunked_peak_mb": round(res["chunked"]["peak_mb"], 1),
        "peak_saving_mb": round(res["full"]["peak_mb"] - res["chunked"]["peak_mb"], 1),
        "full_step_s": round(res["full"]["step_s"], 3),
        "chunked_step_s": round(res["chunked"]["step_s"], 3),
        "logits_mb": round(logits_mb, 1),
        "max_logprob_diff": diff,
        "batch": a.batch,
        "length": a.length,
        "chunk": a.chunk,
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
