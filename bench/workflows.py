"""Benchmark of a multi-turn workflow: the calculator tool learned with GRPO on the tiny model.

    python -m bench.workflows [--quick | --smoke] [--steps N] [--model DIR] [--heldout N]

Workload: the calculator task (`rl_engine.demos.calculator`: "37*58=", the model may write
`<calc>37*58</calc>`, the environment appends "=2146\\n", the model answers). The tiny model is
warm-started on it (`rft warmstart --task calculator`, built here unless --model names one) so
that it sometimes calls the tool and sometimes answers from memory (mostly wrong); then
configs/calculator.yaml trains it for --steps trainer steps as a real Prefect flow run
(one-step off-policy, 8 tasks x 8 episodes per step, one core each for the engine and the trainer).

Reported: episodes per second of rollout time, model turns per episode and the fraction of
response tokens that are the environment's (masked), from the explorer's step metrics; the batch
reward of the first and last quarter of the trainer steps; held-out success (exact answer) and
tool use before and after training, over the held-out problems no train task asks (one episode
each at temperature 1, seeded, the user-code pool off: the tool is ours); and `masked_grad_max`,
the largest gradient the policy loss puts on the logprob of an environment token, over a batch
the run stored (the trained tokens' largest gradient is reported beside it, so a zero there
means the mask, not a dead loss). The bench fails if `masked_grad_max` is not exactly 0.

--smoke (CI) is the same path at the smallest size: 60 warm-start steps (enough to call the tool
sometimes), 2 trainer steps, 16 held-out problems; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from statistics import mean

from bench._report import scratch_dir

if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calculator.yaml"
SIZES = {
    "full": {"steps": 60, "heldout": 400, "warmstart": None},
    "quick": {"steps": 20, "heldout": 200, "warmstart": None},
    "smoke": {"steps": 2, "heldout": 16, "warmstart": 60},
}


def run_data(model: str, train: str, root: str, steps: int) -> dict:
    """The run's config: configs/calculator.yaml on `model` and the task file `train`."""
    import yaml

    data = yaml.safe_load(CONFIG.read_text())
    data.update(name="bench-workflows")
    data["model"]["path"], data["taskset"]["path"] = model, train
    data["buffer"] = {"storage": {"url": root}}
    data["explorer"]["engine"].update(num_threads=1, kv_cache_space_gib=0.25)
    data["trainer"].update(total_steps=steps, checkpoint_interval=steps, num_threads=1)
    return data


def heldout_success(engine, cfg, tasks: list, seed: int = 0) -> dict[str, float]:
    """Success (exact answer) and tool use of one calculator episode per held-out task, at
    temperature 1, with the weights the engine holds."""
    from rl_engine.demos.calculator import calculator_workflow
    from rl_engine.rollout.workflow import EpisodeJob, run_episodes

    tok = engine.tokenizer
    jobs = [
        EpisodeJob(t, t.prompt, tok.encode(t.prompt, add_special_tokens=False), seed * 1_000_003 + i)
        for i, t in enumerate(tasks)
    ]
    res = run_episodes(
        engine,
        lambda task, ep: calculator_workflow(task, ep, cfg.taskset.workflow.max_calls),
        jobs,
        cfg.explorer.sampling,
        cfg.model.max_model_len,
        60.0,
    )
    return {
        "success": mean(float(r.error is None and r.last_text.strip() == t.answer) for r, t in zip(res, tasks)),
        "tool_use": mean(float(r.turns > 1) for r in res),
    }


def masked_grad(run_url: str) -> dict[str, float]:
    """Largest |d loss / d logprob| on environment tokens and on trained tokens, over up to 32
    stored rows with environment tokens, through the trainer's policy loss with the run's algorithm."""
    import pyarrow as pa
    import torch
    from transformers import AutoModelForCausalLM

    from harness.runs import stored_table
    from rl_engine.algorithms import policy_loss, prepare_batch_rows
    from rl_engine.experience import ExperienceBatch
    from rl_engine.run.context import open_run

    run = open_run(run_url)
    table = stored_table(run.url)
    with_env = [i for i, m in enumerate(table.column("loss_mask").to_pylist()) if 0 in m][:32]
    if not with_env:
        return {"masked_grad_max": None, "trained_grad_max": None, "rows": 0}
    batch = ExperienceBatch.from_table(table.take(pa.array(with_env)))
    model = AutoModelForCausalLM.from_pretrained(f"{run.url}/model", torch_dtype=torch.float32)
    t = batch.to_tensors(pad_id=0)
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1].float()  # [B, L-1, V]
    logp = torch.log_softmax(logits / run.cfg.explorer.sampling.temperature, -1).gather(
        -1, t["input_ids"][:, 1:, None]
    )[..., 0]  # [B, L-1]
    logp.retain_grad()
    prep = prepare_batch_rows(t, run.cfg.algorithm, run.cfg.explorer.sampling.max_tokens)
    mask = t["loss_mask"][:, 1:] * prep.trained_rows[:, None]  # [B, L-1]
    behavior = t["behavior_logprobs"][:, 1:]
    policy_loss(logp, behavior, prep.advantages, mask, run.cfg.algorithm, behavior=behavior).loss.backward()
    grad = logp.grad.abs()  # [B, L-1]
    response = torch.arange(t["input_ids"].shape[1] - 1)[None, :] + 1 >= t["response_start"][:, None]  # [B, L-1]
    env = response & (t["attention_mask"][:, 1:] > 0) & (t["loss_mask"][:, 1:] == 0)
    return {
        "masked_grad_max": float(grad[env].max()),
        "trained_grad_max": float(grad[mask > 0].max()),
        "rows": len(with_env),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="20 trainer steps, 200 held-out problems")
    size.add_argument("--smoke", action="store_true", help="the smallest run (CI): figures mean nothing")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default 60; quick 20)")
    ap.add_argument("--heldout", type=int, default=None, help="held-out problems evaluated before and after")
    ap.add_argument("--model", default=None, help="a calculator warm start to train (default: built here)")
    a = ap.parse_args()
    s = SIZES["smoke" if a.smoke else "quick" if a.quick else "full"]
    steps, n_heldout = a.steps or s["steps"], a.heldout or s["heldout"]

    from bench.learning import shared_engines
    from cli.run import run_config
    from rl_engine.config import validate_config
    from rl_engine.demos.calculator import make_calculator_tasks, write_calculator_taskset
    from rl_engine.demos.warmstart import main as warmstart
    from rl_engine.rewards.tasks import Task
    from rl_engine.roles.explorer import ENGINES
    from rl_engine.run.context import RunContext, open_run
    from rl_engine.run.report import load_metrics

    root = scratch_dir("bench-workflows-")
    model = a.model
    if model is None:
        model = f"{root}/tiny-calc-sft"
        warmstart([model, "--task", "calculator"] + (["--steps", str(s["warmstart"])] if s["warmstart"] else []))
    train = f"{root}/calc-train.jsonl"
    write_calculator_taskset(train, 4000, seed=1)
    heldout = [
        Task(r["id"], r["question"], r["answer"], r) for r in make_calculator_tasks(n_heldout, seed=0, split="heldout")
    ]

    data = run_data(model, train, root, steps)
    # One engine for both evaluations and the run: the explorer's warm engine pool (shared_engines)
    # holds it between them, keyed by the run's engine settings (the same config, resolved as the run's).
    eval_cfg = validate_config(data).resolved()
    evals = RunContext(cfg=eval_cfg, url=f"{root}/heldout-eval")
    with shared_engines():
        engine = ENGINES.acquire(evals, 0)
        try:
            before = heldout_success(engine, eval_cfg, heldout)
        finally:
            ENGINES.release(evals, 0, engine)
        started = time.time()
        summary = run_config(validate_config(data))
        wall = time.time() - started
        engine = ENGINES.acquire(evals, 0)  # the trained weights are loaded into it
        try:
            engine.rpc("rft_load_checkpoint", f"{summary['run']}/model", steps)
            engine.mark_synced(steps)
            after = heldout_success(engine, eval_cfg, heldout)
        finally:
            ENGINES.release(evals, 0, engine)
    trainer, explorer = load_metrics(open_run(summary["run"]))
    grad = masked_grad(summary["run"])
    rewards = [m["reward_mean"] for m in sorted(trainer, key=lambda m: m["step"])]
    q = max(1, len(rewards) // 4)
    out = {
        "steps": steps,
        "wall_s": round(wall, 1),
        "episodes_per_s": round(sum(m["episodes"] for m in explorer) / sum(m["rollout_s"] for m in explorer), 2),
        "turns_per_episode": round(mean(m["turns_mean"] for m in explorer), 3),
        "masked_token_frac": round(mean(m["env_token_frac"] for m in explorer), 3),
        "workflow_errors": sum(m["workflow_errors"] for m in explorer),
        "reward_first_quarter": round(mean(rewards[:q]), 4),
        "reward_last_quarter": round(mean(rewards[-q:]), 4),
        "heldout_success_before": round(before["success"], 4),
        "heldout_success_after": round(after["success"], 4),
        "tool_use_before": round(before["tool_use"], 4),
        "tool_use_after": round(after["tool_use"], 4),
        "heldout_problems": len(heldout),
        "masked_grad_max": grad["masked_grad_max"],  # None: no stored row had environment tokens
        "trained_grad_max": grad["trained_grad_max"],
        "grad_rows": grad["rows"],
    }
    width = max(len(k) for k in out)
    print(
        f"\nbench.workflows: calculator, {steps} trainer steps (one-step off-policy), tiny model, {len(heldout)} held-out problems"
    )
    for k, v in out.items():
        print(f"  {k:<{width}}  {v}")
    print(json.dumps(out))
    if grad["masked_grad_max"] not in (0.0, None):
        raise SystemExit(f"environment tokens received gradient: masked_grad_max = {grad['masked_grad_max']}")


if __name__ == "__main__":
    main()
