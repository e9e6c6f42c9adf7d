"""Warm start of the demos: the tiny model, supervised on a demo task until it is partly right.

GRPO needs a policy that sometimes answers correctly (a group whose rewards are all equal has
no signal). This builds the tiny Qwen2 model (`make_tiny_model`) and trains it with the SFT
loss through the same DeepSpeed trainer as RL (its `TrainerSettings` built from the arguments
here, `sft_settings`: no RL config): prompt "12+7=", target "19" + EOS, loss on the
target tokens only, on the task's train split (rl_engine.demos.arithmetic.is_heldout). It stops
after a fixed number of steps (deterministic for a seed), chosen so the model is partly right:
with the defaults (360 steps of 64 examples, lr 1e-3) seed 0 reaches 31% expected exact-match at
temperature 1 and 46% greedy on the 57 held-out problems it never saw, in seconds on two idle
cores (198 s on a busy machine). It saves a Hugging Face directory plus `warmstart.json` (settings,
`sft_split`, and the held-out accuracy).

`--task countdown` warm-starts on the long-tail countdown task of partial rollouts instead
("13..1=" -> "13 12 ... 1", rl_engine/demos/countdown.py), with its own defaults (COUNTDOWN:
120 steps of 64): expected exact-match over the task distribution at temperature 1 / greedy is
60% / 94% for seed 0, 65% / 96% seed 1, 41% / 78% seed 2 (short answers mostly right, the
long tail mostly wrong at temperature 1), in ~25 s on two idle cores.

`--task calculator` warm-starts on calculator episodes (multi-turn, rl_engine/demos/calculator.py):
SFT on whole episodes, 40% (TOOL_RATE) calling the tool, "37*58=<calc>37*58</calc>=2146\\n2146",
the rest answering directly, "37*58=2146"; the loss mask leaves out the prompt and the tool's
reply "=2146\\n", exactly as RL's. Defaults (CALCULATOR: 400 steps of 64, lr 1e-3), seed 0, on
the held-out problems (`evaluate_calculator`, exact, temperature 1): tool use 35%, right 87% of
the time with the tool and 0.4% without, 30% expected success (greedy 46%), in ~42 s on two
idle cores; seed 1: 29%, 91%, 0.6%, 27% (greedy 29%), 28 s. Sampling the workflow itself at
temperature 1 (300 held-out episodes, seed 0's model) agrees: tool use 39%, right 83% with the
tool and 0% without, 33% success. RL has room: always calling the tool would score ~85-90%.

Accuracy is measured exactly, without sampling: on every problem of the task's range the
probability that temperature-1 sampling produces exactly the answer then EOS is
exp(sum of the target tokens' logprobs); the mean over problems, weighted by how often the task
set draws each (uniform for arithmetic, P(n) for countdown), is the expected exact-match rate.
Greedy accuracy (argmax at every token equals the target) is reported beside it.

    rft warmstart runs/models/tiny-arith-sft
    rft warmstart runs/models/tiny-countdown-sft --task countdown
    rft warmstart runs/models/tiny-calc-sft --task calculator
    python -m rl_engine.demos.warmstart OUT_DIR [--task arithmetic] [--steps 360] [--seed 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rl_engine.demos.countdown import DEFAULT_ALPHA, DEFAULT_MAX_N
from rl_engine.errors import UserError

if TYPE_CHECKING:
    from rl_engine.trainer import TrainerSettings

DEFAULTS = {"steps": 360, "batch_size": 64, "lr": 1e-3, "warmup_steps": 20, "seed": 0, "max_operand": 20}
# What differs for the countdown task (the rest is DEFAULTS); max_n / alpha as the task set's.
COUNTDOWN = {"steps": 120}
# The calculator task (multi-turn, rl_engine/demos/calculator.py): TOOL_RATE of the SFT
# episodes call the tool, the rest answer directly.
CALCULATOR = {"steps": 400}
TOOL_RATE = 0.4
TASK_DEFAULTS = {"arithmetic": {}, "countdown": COUNTDOWN, "calculator": CALCULATOR}
TASKS = tuple(TASK_DEFAULTS)


def encode_examples(tokenizer: Any, rows: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """SFT batch in the trainer layout: prompt + answer + EOS, loss on answer + EOS; [B, L] each."""
    return encode_segments(tokenizer, [(r["question"], [(r["answer"], True)]) for r in rows])


def encode_segments(tokenizer: Any, examples: list[tuple[str, list[tuple[str, bool]]]]) -> dict[str, torch.Tensor]:
    """SFT batch of multi-turn episodes: each example is (prompt, [(text, trained), ...]); the
    response is its segments in order then EOS (trained); the loss mask is 1 on the trained
    segments and EOS, 0 on the prompt and the environment's segments, as in RL; [B, L] each."""
    eos = tokenizer.eos_token_id
    seqs = []
    for prompt, segments in examples:
        ids = list(tokenizer(prompt)["input_ids"])
        mask = [0] * len(ids)
        for text, trained in segments:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += seg
            mask += [int(trained)] * len(seg)
        seqs.append((ids + [eos], mask + [1]))
    length = max(len(i) for i, _ in seqs)
    ids = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)  # [B, L]
    attention = torch.zeros(len(seqs), length, dtype=torch.long)  # [B, L]
    loss_mask = torch.zeros(len(seqs), length)  # [B, L]
    for b, (i, m) in enumerate(seqs):
        ids[b, : len(i)] = torch.tensor(i)
        attention[b, : len(i)] = 1
        loss_mask[b, : len(m)] = torch.tensor(m, dtype=torch.float)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def all_problems(max_operand: int) -> list[dict[str, str]]:
    """Every problem a+b= of the task's range, in a fixed order."""
    return [
        {"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(max_operand + 1) for b in range(max_operand + 1)
    ]


def task_problems(
    task: str, max_operand: int = DEFAULTS["max_operand"], max_n: int = DEFAULT_MAX_N, alpha: float = DEFAULT_ALPHA
) -> tuple[list[dict[str, str]], list[float] | None]:
    """The problems a warm start of `task` is measured on and how often each counts (None: uniform):
    arithmetic's held-out problems, which neither its SFT nor the demo's RL draws; every countdown
    problem, weighted as its task set draws them."""
    from rl_engine.demos.arithmetic import arithmetic_pairs
    from rl_engine.demos.countdown import countdown_problem, countdown_weights

    if task == "arithmetic":
        return [
            {"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in arithmetic_pairs("heldout", max_operand)
        ], None
    return [countdown_problem(k) for k in range(1, max_n + 1)], countdown_weights(max_n, alpha)


def task_rows(
    task: str,
    n: int,
    seed: int,
    max_operand: int = DEFAULTS["max_operand"],
    max_n: int = DEFAULT_MAX_N,
    alpha: float = DEFAULT_ALPHA,
) -> list[dict[str, str]]:
    """`n` training examples of `task`, drawn as its task set draws them (arithmetic: its train split)."""
    from rl_engine.demos.arithmetic import make_arithmetic_tasks
    from rl_engine.demos.countdown import make_countdown_tasks

    if task == "arithmetic":
        return make_arithmetic_tasks(n, seed=seed, max_operand=max_operand, split="train")
    return make_countdown_tasks(n, seed=seed, max_n=max_n, alpha=alpha)


def evaluate(trainer: Any, rows: list[dict[str, str]], weights: list[float] | None = None) -> dict[str, float]:
    """Expected exact-match at temperature 1 and greedy exact-match over `rows`, weighted by
    `weights` (default uniform; see module doc)."""
    batch = encode_examples(trainer.tokenizer, rows)
    logprobs = trainer.compute_logprobs(batch).cpu()  # [B, L]
    mask = batch["loss_mask"]  # [B, L]
    p_exact = torch.exp((logprobs * mask).sum(-1))  # [B]
    greedy_ok = _greedy_matches(trainer, batch).float()  # [B]
    w = torch.full((len(rows),), 1.0 / len(rows)) if weights is None else torch.tensor(weights) / sum(weights)  # [B]
    return {"expected_exact_t1": float((w * p_exact).sum()), "greedy_exact": float((w * greedy_ok).sum())}


@torch.no_grad()
def _greedy_matches(trainer: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] bool: the argmax token equals the target at every target position (teacher forcing is
    exact here: if every argmax matches, greedy decoding produces exactly the target)."""
    module = trainer.engine.module
    logits = module(
        input_ids=batch["input_ids"].to(trainer.device), attention_mask=batch["attention_mask"].to(trainer.device)
    ).logits.cpu()  # [B, L, V]
    pred = logits[:, :-1].argmax(-1)  # [B, L-1]: prediction for token i+1
    target, mask = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:] > 0  # [B, L-1]
    return ((pred == target) | ~mask).all(-1)


def sft_settings(
    model_dir: str, batch_size: int, lr: float, warmup_steps: int, seed: int, threads: int | None = None
) -> TrainerSettings:
    """The trainer's settings for SFT steps of `batch_size` examples (one micro-batch each),
    logprobs at temperature 1 (what `evaluate` measures)."""
    from rl_engine.trainer import TrainerSettings

    return TrainerSettings(
        model_path=model_dir,
        seed=seed,
        train_batch_size=batch_size,
        micro_batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup_steps,
        num_threads=threads,
        temperature=1.0,
    )


def calculator_examples(n: int, seed: int, tool_rate: float = TOOL_RATE) -> list[tuple[str, list[tuple[str, bool]]]]:
    """`n` SFT episodes of train calculator problems (drawn uniformly): a fraction `tool_rate`
    call the tool, the rest answer directly (`calculator_transcript`)."""
    from rl_engine.demos.calculator import calculator_problem, calculator_problems, calculator_transcript

    rng, pool = random.Random(seed), calculator_problems("train")
    out = []
    for _ in range(n):
        a, b = rng.choice(pool)
        out.append((calculator_problem(a, b)["question"], calculator_transcript(a, b, rng.random() < tool_rate)))
    return out


def evaluate_calculator(trainer: Any, pairs: list[tuple[int, int]]) -> dict[str, float]:
    """The calculator policy on `pairs`, exactly (no sampling), each problem scored on its two
    good episodes: P(tool) = P(the first response token is "<"); P(right with the tool) =
    P("<calc>a*b</calc>", then the product and EOS after the tool's reply); P(right without) =
    P(the product then EOS as the first turn). expected_exact_t1 is their sum, the expected
    success at temperature 1 (a lower bound: another right episode, "<calc>b*a</calc>" say,
    is not counted); success_with_tool / success_without_tool are the conditional rates.
    Greedy: the argmax path, teacher-forced through the tool's reply."""
    from rl_engine.demos.calculator import calculator_problem, calculator_transcript

    examples = []
    for a, b in pairs:
        q = calculator_problem(a, b)["question"]
        examples += [(q, calculator_transcript(a, b, True)), (q, calculator_transcript(a, b, False))]
    batch = encode_segments(trainer.tokenizer, examples)
    logprobs = trainer.compute_logprobs(batch).cpu()  # [2P, L]
    mask = batch["loss_mask"]  # [2P, L]
    p_path = torch.exp((logprobs * mask).sum(-1)).view(-1, 2)  # [P, 2]: (tool, direct)
    first = mask.argmax(-1)  # [2P]: first response position
    p_tool = torch.exp(logprobs[torch.arange(len(examples)), first]).view(-1, 2)[:, 0]  # [P]
    greedy = _greedy_matches(trainer, batch).view(-1, 2)  # [P, 2]
    tool, with_tool, without = float(p_tool.mean()), float(p_path[:, 0].mean()), float(p_path[:, 1].mean())
    return {
        "tool_rate": tool,
        "success_with_tool": with_tool / max(tool, 1e-9),
        "success_without_tool": without / max(1.0 - tool, 1e-9),
        "expected_exact_t1": with_tool + without,
        "greedy_exact": float(greedy.any(-1).float().mean()),
        "greedy_tool_exact": float(greedy[:, 0].float().mean()),
    }


def evaluate_dir(
    model_dir: str, max_operand: int = DEFAULTS["max_operand"], task: str = "arithmetic"
) -> dict[str, float]:
    """`evaluate` of a saved model directory (e.g. a run's final `model/`) on `task_problems(task)`
    (arithmetic: the held-out problems; calculator: `evaluate_calculator` on its held-out problems)."""
    from rl_engine.trainer import build_trainer

    # Logprobs only, 16 rows per forward pass; the optimizer values are never used.
    trainer = build_trainer(sft_settings(model_dir, 16, 1e-5, 0, seed=42))
    if task == "calculator":
        from rl_engine.demos.calculator import calculator_problems

        return evaluate_calculator(trainer, calculator_problems("heldout"))
    return evaluate(trainer, *task_problems(task, max_operand))


def warmstart(
    out_dir: str,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    seed: int,
    max_operand: int,
    threads: int | None = None,
    task: str = "arithmetic",
    max_n: int = DEFAULT_MAX_N,
    alpha: float = DEFAULT_ALPHA,
) -> dict[str, Any]:
    """Build, train and save the warm-started model; returns the summary written to warmstart.json."""
    from rl_engine.tiny_model import make_tiny_model
    from rl_engine.trainer import build_trainer

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rft-warmstart-") as tmp:
        base = make_tiny_model(Path(tmp) / "base", seed=seed)
        trainer = build_trainer(sft_settings(str(base), batch_size, lr, warmup_steps, seed, threads))
        # One task seed per step: the first k steps are the same whatever the total (a longer
        # run continues a shorter one), and no step repeats another's sample.
        if task == "calculator":
            from rl_engine.demos.calculator import calculator_problems

            heldout = calculator_problems("heldout")

            def batch_of(step_seed: int) -> dict[str, torch.Tensor]:
                return encode_segments(trainer.tokenizer, calculator_examples(batch_size, step_seed))

            def measure(final: bool) -> dict[str, float]:
                return evaluate_calculator(trainer, heldout if final else heldout[:200])
        else:
            problems, weights = task_problems(task, max_operand, max_n, alpha)

            def batch_of(step_seed: int) -> dict[str, torch.Tensor]:
                return encode_examples(
                    trainer.tokenizer, task_rows(task, batch_size, step_seed, max_operand, max_n, alpha)
                )

            def measure(final: bool) -> dict[str, float]:
                return evaluate(trainer, problems, weights)

        log_every = max(1, steps // 10)
        for step in range(steps):
            metrics = trainer.sft_step(batch_of(seed * 1_000_003 + step))
            if (step + 1) % log_every == 0 or step + 1 == steps:
                acc = measure(final=False)
                extra = f"  tool {acc['tool_rate']:.3f}" if "tool_rate" in acc else ""
                print(
                    f"warmstart step {step + 1}/{steps}: loss {metrics['loss']:.4f}  exact@T=1 {acc['expected_exact_t1']:.3f}  greedy {acc['greedy_exact']:.3f}{extra}",
                    flush=True,
                )
        final = measure(final=True)
        trainer.save_hf(out_dir)
    summary = {
        "task": task,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "warmup_steps": warmup_steps,
        "seed": seed,
        **(
            {"max_operand": max_operand, "sft_split": "train", "measured_on": "held-out problems"}
            if task == "arithmetic"
            else {"max_n": max_n, "alpha": alpha}
            if task == "countdown"
            else {"tool_rate_in_sft": TOOL_RATE, "measured_on": "held-out problems"}
        ),
        "final_loss": metrics["loss"],
        **final,
        "seconds": round(time.time() - started, 1),
    }
    (Path(out_dir) / "warmstart.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: `rft warmstart OUT_DIR [--task countdown] [--steps N] [--seed S] ...`."""
    ap = argparse.ArgumentParser(
        prog="rft warmstart",
        description="Build a demo's base model: the tiny model after SFT on the demo task (arithmetic, the long-tail countdown, or the calculator tool's episodes).",
    )
    ap.add_argument("out_dir", help="output directory (Hugging Face layout), e.g. runs/models/tiny-arith-sft")
    ap.add_argument(
        "--task",
        choices=TASKS,
        default="arithmetic",
        help="the task to learn (default arithmetic); its defaults: "
        + ", ".join(f"{t} {_shown({**DEFAULTS, **d})}" for t, d in TASK_DEFAULTS.items()),
    )
    ap.add_argument("--steps", type=int, default=None, help="SFT steps")
    ap.add_argument("--batch-size", type=int, default=None, help="examples per step")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear LR warmup")
    ap.add_argument(
        "--seed", type=int, default=DEFAULTS["seed"], help="seed of the model init, data order and trainer (default 0)"
    )
    ap.add_argument(
        "--max-operand",
        type=int,
        default=DEFAULTS["max_operand"],
        help="arithmetic: operands 0..MAX, as the task set (default 20)",
    )
    ap.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"countdown: start values 1..MAX, as the task set (default {DEFAULT_MAX_N})",
    )
    ap.add_argument(
        "--alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help=f"countdown: P(n) ~ n^-alpha, as the task set (default {DEFAULT_ALPHA})",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a = ap.parse_args(argv)
    d = {**DEFAULTS, **TASK_DEFAULTS[a.task]}
    steps, batch_size, lr, warmup = (
        d[k] if v is None else v
        for k, v in (("steps", a.steps), ("batch_size", a.batch_size), ("lr", a.lr), ("warmup_steps", a.warmup_steps))
    )
    if steps < 1 or not 2 <= batch_size <= 1024:
        raise UserError(f"warmstart: --steps must be >= 1 and --batch-size within 2..1024 (got {steps}, {batch_size})")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    s = warmstart(a.out_dir, steps, batch_size, lr, warmup, a.seed, a.max_operand, a.threads, a.task, a.max_n, a.alpha)
    tool = (
        f", tool use {s['tool_rate']:.3f} (right {s['success_with_tool']:.3f} with the tool, {s['success_without_tool']:.3f} without)"
        if "tool_rate" in s
        else ""
    )
    print(
        f"warm-started model in {a.out_dir}: exact@T=1 {s['expected_exact_t1']:.3f}, greedy {s['greedy_exact']:.3f}{tool} ({s['seconds']} s)"
    )
    return 0


def _shown(d: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {d[k]}" for k in ("steps", "batch_size", "lr", "warmup_steps"))


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
