"""The reference GRPO loop bench.peer runs beside rft: one process, one model that generates with
`transformers.generate` and trains with bench/reference.py's step; no vLLM, no DeepSpeed, no
weight sync (the model that samples is the one that trains).

It takes an rft config and does what that config's synchronous run does, from its own code: the
same tasks in the same order (the explorer's seeded `TaskIterator`, seed = cfg.seed), the same
prompts (`encode_task`: the chat template, token ids equal), `repeat_times` samples per task at the
config's temperature, top-p / top-k and token budget, the same reward (`build_reward` of the
config's `taskset.reward`), the config's batch, micro-batch, lr, warm-up, clip, AdamW and
algorithm knobs. The behavior logprobs are the generating forward's own (log_softmax of the
logits generate returns / temperature): PPO-clip against the generating policy, as rft's
explorer logprobs are vLLM's. A response ends at the first EOS, which it keeps (vLLM's
token_ids keep it too).

    out = reference_loop(cfg, steps=30, out_dir="runs/peer/ref-42")   # saves the trained model there
    out["step_s"], out["end_to_end_s"], out["rewards"]
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.reference import RefAlgo, ReferenceTrainer


def sample_groups(
    model: Any, prompts: list[list[int]], n: int, sampling: Any, pad_id: int, eos_ids: set[int]
) -> list[dict[str, Any]]:
    """`n` samples of each prompt (rows prompt-major: group i is rows i*n..i*n+n-1): each a dict of
    prompt_ids, response_ids (up to and with the first EOS), logprobs (per response token, of the
    generating forward at the sampling temperature) and finish_reason (stop | length)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(n, 0)  # [N, P] left-padded
    am = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()  # [G, P]
    am = am.repeat_interleave(n, 0)  # [N, P]
    greedy = sampling.temperature == 0
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=am,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),  # 0: no top-k (transformers' default would be 50)
            max_new_tokens=sampling.max_tokens,
            pad_token_id=pad_id,
            eos_token_id=sorted(eos_ids),
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, width:]  # [N, T]
    logits = torch.stack(out.logits, dim=1).float()  # [N, T, V]: the raw logits of each generated position
    t = sampling.temperature or 1.0
    logp = F.log_softmax(logits / t, dim=-1).gather(2, new[:, :, None]).squeeze(2)  # [N, T]
    samples = []
    for row in range(new.shape[0]):
        toks = new[row].tolist()
        stop = next((i for i, tok in enumerate(toks) if tok in eos_ids), None)
        end = len(toks) if stop is None else stop + 1
        samples.append(
            {
                "prompt_ids": prompts[row // n],
                "response_ids": toks[:end],
                "logprobs": logp[row, :end].tolist(),
                "finish_reason": "length" if stop is None else "stop",
            }
        )
    return samples


def to_batch(samples: list[dict[str, Any]], rewards: list[float], n: int, pad_id: int) -> dict[str, Tensor]:
    """rft's trainer layout (`ExperienceBatch.to_tensors`), right-padded: input_ids, attention_mask,
    loss_mask, behavior_logprobs [B, L]; rewards, group_index [B]."""
    length = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    rows = len(samples)
    batch = {
        "input_ids": torch.full((rows, length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(rows, length, dtype=torch.long),
        "loss_mask": torch.zeros(rows, length),
        "behavior_logprobs": torch.zeros(rows, length),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "group_index": torch.arange(rows) // n,
    }
    for b, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        batch["input_ids"][b, : p + r] = torch.tensor(s["prompt_ids"] + s["response_ids"])
        batch["attention_mask"][b, : p + r] = 1
        batch["loss_mask"][b, p : p + r] = 1
        batch["behavior_logprobs"][b, p : p + r] = torch.tensor(s["logprobs"])
    return batch


def reference_loop(cfg: Any, steps: int, out_dir: str | None = None) -> dict[str, Any]:
    """`steps` reference GRPO steps on `cfg`'s model, tasks, reward and knobs (module docstring);
    saves the trained model (and tokenizer) to `out_dir` when given. Returns the per-step times
    (`step_s`, generate + reward + update; `generate_s`, `train_s`), `startup_s` (its start to the
    first step's), `end_to_end_s` (model load to the trained model written), the mean reward of each step (`rewards`), the step metrics (`metrics`) and its tasks (`task_ids`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_engine.rewards import TaskIterator, build_reward, encode_task, load_taskset, score_rollouts

    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    # rft's trainer: the config's threads, else torch's default; the demo's process may have changed that
    torch.set_num_threads(cfg.trainer.num_threads or os.cpu_count() or 1)
    model_dir = cfg.model.path
    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.model.dtype))
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)
    t, sampling, n = cfg.trainer, cfg.explorer.sampling, cfg.algorithm.repeat_times
    trainer = ReferenceTrainer(
        model,
        RefAlgo.from_config(cfg.algorithm, sampling.max_tokens),
        t.lr,
        t.warmup_steps,
        t.grad_clip,
        sampling.temperature if sampling.temperature > 0 else 1.0,
        tuple(t.betas),
        t.weight_decay,
    )
    tasks = TaskIterator(load_taskset(cfg.taskset), cfg.explorer.batch_size, seed=cfg.seed, shuffle=cfg.taskset.shuffle)
    reward_fn = build_reward(cfg.taskset.reward)
    out: dict[str, Any] = {"step_s": [], "generate_s": [], "train_s": [], "rewards": [], "metrics": [], "task_ids": []}
    out["startup_s"] = time.perf_counter() - started  # model load to the first step
    for _ in range(steps):
        t0 = time.perf_counter()
        group_tasks = tasks.next_batch()
        encoded = [encode_task(tok, cfg.taskset.template, task, cfg.model.max_model_len) for task in group_tasks]
        model.eval()
        samples = sample_groups(model, [ids for _, ids in encoded], n, sampling, pad_id, eos_ids)
        texts = [tok.decode(s["response_ids"], skip_special_tokens=True) for s in samples]
        scored = score_rollouts(
            reward_fn,
            [
                (encoded[i // n][0], text, group_tasks[i // n], s["finish_reason"])
                for i, (s, text) in enumerate(zip(samples, texts))
            ],
        )
        rewards = [r if r is not None else 0.0 for r in scored.rewards]  # a failed reward scores 0
        t1 = time.perf_counter()
        metrics = trainer.step(to_batch(samples, rewards, n, pad_id), t.micro_batch_size)
        t2 = time.perf_counter()
        out["generate_s"].append(t1 - t0)
        out["train_s"].append(t2 - t1)
        out["step_s"].append(t2 - t0)
        out["rewards"].append(sum(rewards) / len(rewards))
        out["metrics"].append(metrics)
        out["task_ids"].append([task.task_id for task in group_tasks])
    if out_dir is not None:  # rft's run ends by writing its model too: both end-to-end times hold a save
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    out["end_to_end_s"] = time.perf_counter() - started
    return out
