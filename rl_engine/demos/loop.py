"""The synchronous GRPO loop in plain Python: rollout -> reward -> advantages -> train -> sync.

One process holds the vLLM rollout engine and the DeepSpeed trainer; no Prefect, no buffer
files. Step t samples `explorer.batch_size` tasks x `algorithm.repeat_times` rollouts with
policy version t-1, scores them, trains one step (GRPO advantages inside `train_step`), and
loads version t into the engine (`synchronizer.sync_method`: collective broadcast or
checkpoint). It is the reference the Prefect flows are checked against, and a quick way to
see GRPO learn on the demo task:

    python -m rl_engine.demos.loop configs/demo.yaml --steps 10 [--set trainer.lr=1e-4 ...]

Besides each step's metrics it reports `eval_exact_t1`: the expected exact-match rate of
temperature-1 sampling over every problem of the demo task's range, computed from the
trainer's logprobs (no sampling noise; see rl_engine.demos.warmstart.evaluate).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl_engine.config import RFTConfig
from rl_engine.errors import UserError
from rl_engine.experience import ExperienceBatch


def rollout_step(engine: Any, tasks: Any, reward_fn: Any, cfg: RFTConfig, step: int) -> ExperienceBatch:
    """Explorer step `step`: generate repeat_times rollouts per task with the engine's weights, score them."""
    from rl_engine.roles.explorer import generate_experiences

    return generate_experiences(engine, tasks.next_batch(), reward_fn, cfg, 0, step)[0]


def _both_sides(trainer_side: Callable[[], Any], explorer_side: Callable[[], Any]) -> Any:
    """Run the two halves of a sync at once (the trainer's in a thread), as two roles would."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(trainer_side)
        try:
            got = explorer_side()
        finally:
            sent.result()
    return got


def run_loop(cfg: RFTConfig, steps: int | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run `steps` (default trainer.total_steps) synchronous GRPO steps; returns per-step metrics.

    The first entry (step 0) holds the evaluation of the initial policy.
    """
    from rl_engine.board import Board
    from rl_engine.demos.warmstart import all_problems, evaluate
    from rl_engine.rewards import TaskIterator, build_reward, load_taskset
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.run.devices import check_plan, device_plan
    from rl_engine.sync import build_weight_receiver, build_weight_sender
    from rl_engine.trainer import build_trainer, trainer_settings

    cfg = cfg.resolved()
    steps = steps or cfg.trainer.total_steps
    storage = cfg.buffer.storage.fs_options()
    tasks = TaskIterator(
        load_taskset(cfg.taskset, storage), cfg.explorer.batch_size, seed=cfg.seed, shuffle=cfg.taskset.shuffle
    )
    reward_fn = build_reward(cfg.taskset.reward)
    plan = device_plan(cfg)  # one process, as placement local: the trainer on its device, the engine on its own
    check_plan(plan, cfg.synchronizer.sync_method)
    trainer = build_trainer(trainer_settings(cfg, plan.trainer_device() or 0))
    engine = build_rollout_engine(cfg, cuda_visible=plan.engine_visible(0))
    board = Board.at(cfg.run_url, storage)
    sender, receiver = build_weight_sender(cfg, board, device=trainer.device), build_weight_receiver(cfg, board)
    problems = all_problems(_max_operand(tasks.tasks))
    history = [{"step": 0, "version": 0, **{f"eval_{k}": v for k, v in evaluate(trainer, problems).items()}}]
    log(f"step 0: eval exact@T=1 {history[0]['eval_expected_exact_t1']:.3f}")
    try:
        _both_sides(sender.connect, lambda: receiver.connect(engine))
        for t in range(1, steps + 1):
            started = time.time()
            batch = rollout_step(engine, tasks, reward_fn, cfg, t)
            rollout_s = time.time() - started
            metrics = trainer.train_step(batch.to_tensors(trainer.pad_token_id))
            v = trainer.version
            _both_sides(
                lambda: (sender.prepare(v), sender.send(trainer.named_weights(), v)),
                lambda: (receiver.prepare(v), receiver.receive(engine, v)),
            )
            rewards = batch.column("reward")
            correct = [x.reward_components.get("correct", 0.0) for x in batch.experiences()]
            entry = {
                **metrics,
                "step": t,
                "reward_mean": float(rewards.mean()),
                "correct_mean": float(sum(correct) / len(correct)),
                "rollout_s": rollout_s,
                "step_s": time.time() - started,
                **{f"eval_{k}": v for k, v in evaluate(trainer, problems).items()},
            }
            history.append(entry)
            log(
                f"step {t}: reward {entry['reward_mean']:.3f} (correct {entry['correct_mean']:.3f})  loss {entry['loss']:+.4f}  "
                f"kl {entry['approx_kl']:.2e}  |dlogp| {entry['logprob_diff']:.1e}  eval exact@T=1 {entry['eval_expected_exact_t1']:.3f}  {entry['step_s']:.1f}s"
            )
    finally:
        sender.close()
        receiver.close()
        engine.close()
    return history


def _max_operand(tasks: list[Any]) -> int:
    """Largest operand of the demo task set (questions "a+b="); UserError for other task sets."""
    try:
        return max(int(x) for t in tasks for x in t.prompt.rstrip("=").split("+"))
    except ValueError:
        raise UserError(
            "rl_engine.demos.loop evaluates on the demo arithmetic task (prompts 'a+b='); this task set is not it"
        ) from None


def main(argv: list[str] | None = None) -> int:
    from rl_engine.config import load_config

    ap = argparse.ArgumentParser(
        prog="python -m rl_engine.demos.loop", description="Synchronous GRPO loop in one process (no Prefect)."
    )
    ap.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default trainer.total_steps)")
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    a = ap.parse_args(argv)
    run_loop(load_config(a.config, a.overrides), a.steps)
    return 0


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
