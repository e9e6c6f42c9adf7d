"""The least a synchronous step costs on this machine (`step_floor`), and the DeepSpeed trainer's
step against a plain torch step on the same batch (`reference_step_ratio`), measured after a run
on its own typical step (`typical_rows`): bench.learning and bench.real report their runs' steps against these.
"""

from __future__ import annotations

import statistics
import time
from statistics import median
from typing import Any


def typical_rows(run_url: str) -> Any:
    """The committed experiences of a (local) run's typical step: the explorer step whose rows hold
    the median number of tokens (prompt and response), the batch a run's mean step is made of. A
    run's first batch is not it: its responses are longer than the trained policy's, so a floor
    measured on it can sit above the run's own mean step."""
    import json
    from pathlib import Path

    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    records = sorted(Path(run_url, "buffer", "_commits").glob("*/*.json"))
    paths = [str(Path(run_url, "buffer", json.loads(p.read_text())["path"])) for p in records]
    table = ds.dataset(paths, format="ipc").to_table()
    return table.filter(pc.equal(table.column("explorer_step"), typical_step(table)))


def typical_step(table: Any) -> int:
    """Of a table of experiences, the explorer step whose rows hold the median number of tokens
    (the lower median of an even count of steps)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tokens = pc.add(
        pc.list_value_length(table.column("prompt_ids")), pc.list_value_length(table.column("response_ids"))
    )
    per_step = (
        pa.table({"step": table.column("explorer_step"), "tokens": tokens})
        .group_by("step")
        .aggregate([("tokens", "sum")])
        .sort_by([("tokens_sum", "ascending"), ("step", "ascending")])
    )
    return per_step.column("step")[(per_step.num_rows - 1) // 2].as_py()


def median_s(fn: Any, repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn`, after one more call that warms up."""
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def reference_step_ratio(cfg: Any, rows: Any, repeats: int) -> dict[str, float]:
    """Median step time of the DeepSpeed trainer and of a plain torch step on the same batch: the
    first of `rows` (stored experiences, a step's) that fill the trainer's batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_engine.algorithms import group_advantages, policy_loss, token_logprobs
    from rl_engine.experience import ExperienceBatch
    from rl_engine.trainer import build_trainer
    from rl_engine.trainer.settings import trainer_settings

    trainer = build_trainer(trainer_settings(cfg))
    batch = ExperienceBatch.from_table(rows.slice(0, trainer.local_batch_size)).to_tensors(trainer.pad_token_id)

    trainer_s = median_s(lambda: trainer.train_step(dict(batch)), repeats)
    trainer.close()

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.trainer.lr,
        betas=cfg.trainer.betas,
        weight_decay=cfg.trainer.weight_decay,
        fused=True,
    )
    adv = group_advantages(
        batch["rewards"], batch["group_index"], cfg.algorithm.advantage.type, cfg.algorithm.advantage.std
    )  # [B]
    mask = batch["loss_mask"]  # [B, L]
    tokens, micro = float(mask.sum()), cfg.trainer.micro_batch_size

    def reference() -> None:
        model.train()
        for i in range(0, mask.shape[0], micro):
            sl = slice(i, i + micro)
            logits = model(
                input_ids=batch["input_ids"][sl], attention_mask=batch["attention_mask"][sl]
            ).logits  # [b, L, V]
            logp = token_logprobs(logits, batch["input_ids"][sl], cfg.explorer.sampling.temperature)  # [b, L]
            policy_loss(
                logp, batch["behavior_logprobs"][sl], adv[sl], mask[sl], cfg.algorithm, num_tokens=tokens
            ).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    reference_s = median_s(reference, repeats)
    return {
        "trainer_step_s": trainer_s,
        "reference_step_s": reference_s,
        "train_step_over_reference": trainer_s / reference_s,
    }


def step_floor(run_url: str, repeats: int) -> dict[str, float]:
    """The least a synchronous step of `run_url`'s config costs on this machine: the three parts a
    synchronous step runs one after another, each measured at its floor in this process, after
    the runs (median of `repeats` after a warm-up).

    - `floor_generate_s`: vLLM's own `LLM.generate` of the run's typical step (its prompts, n and
      sampling) on the run's warm engine, nothing around it (bench.rollout's raw side);
    - `floor_train_s`: the faster of a plain torch/transformers step (AdamW, the same GRPO
      loss and micro-batches: bench.real's reference step, `reference_step_s`) and the
      DeepSpeed trainer's (`trainer_step_s`) on the run's typical batch, at the run's trainer
      threads;
    - `floor_reload_s`: the engine's in-place reload of the weights from memory, which every
      weight sync ends with; the transfer itself (1.2 MB for the demo) is left out.

    `step_floor_s` is their sum: no synchronous step on this machine, with vLLM generating and the
    model training, can be shorter. The buffer hand-off, the sync handshake and the explorer's
    rows sit above it.
    """
    import torch
    from vllm.inputs import TokensPrompt

    from rl_engine.roles.explorer import ENGINES
    from rl_engine.run.context import open_run

    run = open_run(run_url)
    cfg = run.cfg
    rows = typical_rows(run_url)
    groups: dict[str, list[int]] = {}
    for group, prompt in zip(*(rows.column(c).to_pylist() for c in ("group_id", "prompt_ids"))):
        groups.setdefault(group, prompt)
    prompts = list(groups.values())  # [tasks per step] prompt ids of the typical step
    engine = ENGINES.acquire(run, 0)
    try:
        params = engine.sampling_params(prompts, cfg.algorithm.repeat_times, cfg.explorer.sampling, seed=0)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        generate = median_s(lambda: engine.llm.generate(inputs, params, use_tqdm=False), repeats)
        reload = median(
            engine.rpc("rft_profile_reload", cfg.model.path, timeout=120)[0]["reload"] for _ in range(repeats)
        )
    finally:
        ENGINES.release(run, 0, engine)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.trainer.num_threads or threads)
    try:
        train = reference_step_ratio(cfg, rows, repeats)
    finally:
        torch.set_num_threads(threads)
    train_s = min(
        train["reference_step_s"], train["trainer_step_s"]
    )  # where the DeepSpeed trainer is the faster, it is the floor
    return {
        "step_floor_s": generate + train_s + reload,
        "floor_generate_s": generate,
        "floor_train_s": train_s,
        "floor_reload_s": reload,
        "trainer_step_s": train["trainer_step_s"],
        "reference_step_s": train["reference_step_s"],
    }
