"""Benchmark of the rollout engine against vLLM's own `LLM.generate` on the same engine.

Both sides run the same prompts with the same per-request SamplingParams (n samples, the
configured temperature, distinct seeds, sampled-token logprobs), so vLLM does identical work;
the difference is what `VLLMRolloutEngine.generate` adds: prompt checks and turning vLLM's
outputs into `Rollout`s (token ids, logprobs, finish reason, version). A third side is a plain
explorer step's rollout, `generate_experiences` (prompt text -> ids, generate, score with a
trivial reward, build the rows with the row builder partial rollouts share) on as many tasks of
the same prompt lengths (other prompts, so its tokens/s is near the engine's, not equal):
`experiences_rows_ms` is the median time a step spends outside `engine.generate` (tokenizing
prompts, scoring, building rows), the part the explorer adds. Rounds alternate the order of the sides to spread out noise from other processes.

    python -m bench.rollout            # 64 prompts x 4 samples x 64 tokens, 5 rounds
    python -m bench.rollout --quick    # 16 prompts, 3 rounds
    python -m bench.rollout --smoke    # CI smoke test: 4 prompts x 2 samples x 8 tokens, 1 round (the engine start dominates)

Prints a table, then one JSON line with `rollout_over_raw` (tokens/s of ours over vLLM's) and
`experiences_rows_ms` (a plain explorer step's time outside the engine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench._report import emit_json, print_table


def _prompts(num: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(8, 33))] for _ in range(num)]


def _tasks(num: int, seed: int) -> list:
    """Tasks whose prompt text is as long as `_prompts`' (the tiny tokenizer: one token a character)."""
    import random

    from rl_engine.rewards import Task

    rng = random.Random(seed)
    return [
        Task(f"t{i}", "".join(rng.choice("0123456789+-=") for _ in range(rng.randrange(8, 33))), None)
        for i in range(num)
    ]


class _TimedEngine:
    """The engine, with the time its `generate` calls took (the rest of a step is prompts and rows)."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.generate_s = engine, engine.tokenizer, 0.0

    def generate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.generate_s += time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer prompts and rounds")
    size.add_argument(
        "--smoke", action="store_true", help="CI smoke test: the fewest prompts, samples, tokens and rounds"
    )
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny model")
    ap.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    a = ap.parse_args(argv)
    num_prompts, rounds, n, max_tokens = (4, 1, 2, 8) if a.smoke else (16, 3, 4, 64) if a.quick else (64, 5, 4, 64)

    import pyarrow.compute as pc
    from vllm.inputs import TokensPrompt

    from rl_engine.config import RFTConfig
    from rl_engine.roles.explorer import generate_experiences
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as work:
        model_dir = str(make_tiny_model(f"{work}/model", seed=0, hidden_size=a.hidden, num_layers=a.layers))
        cfg = RFTConfig.model_validate(
            {
                "model": {"path": model_dir, "max_model_len": 128},
                "taskset": {"path": "unused.jsonl", "template": "{prompt}"},
                "algorithm": {"repeat_times": n},
                "explorer": {
                    "engine": {"kv_cache_space_gib": 0.5},
                    "sampling": {"max_tokens": max_tokens, "temperature": 1.0},
                },
            }
        )
        engine = build_rollout_engine(cfg)
        try:
            sampling = cfg.explorer.sampling
            prompts = _prompts(num_prompts, seed=0)
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

            def ours(seed: int) -> int:
                return sum(len(r.response_ids) for g in engine.generate(prompts, n, sampling, seed) for r in g)

            def raw(seed: int) -> int:
                params = engine.sampling_params(prompts, n, sampling, seed)
                return sum(
                    len(c.token_ids) for o in engine.llm.generate(inputs, params, use_tqdm=False) for c in o.outputs
                )

            tasks = _tasks(num_prompts, seed=0)
            timed = _TimedEngine(engine)
            rows_ms: list[float] = []

            def experiences(seed: int) -> int:
                t0, timed.generate_s = time.perf_counter(), 0.0
                batch, _ = generate_experiences(
                    timed, tasks, lambda *_: 0.0, cfg, 0, seed + 1
                )  # step seed + 1: its own sampling seed
                rows_ms.append(1000 * (time.perf_counter() - t0 - timed.generate_s))
                return int(pc.sum(pc.list_value_length(batch.to_table().column("response_ids"))).as_py())

            ours(seed=10_000), raw(seed=10_000), experiences(seed=10_000)  # warm-up
            rows_ms.clear()
            tps: dict[str, list[float]] = {"rollout engine": [], "vLLM LLM.generate": [], "plain explorer step": []}
            for i in range(rounds):
                # ours and raw alternate next to each other as before; the explorer step goes first or last.
                pair = [("rollout engine", ours), ("vLLM LLM.generate", raw)]
                step = [("plain explorer step", experiences)]
                for name, fn in step + pair if i % 2 == 0 else pair[::-1] + step:
                    t0 = time.perf_counter()
                    tokens = fn(seed=i)  # same seed for ours and raw: identical samples, identical token counts
                    tps[name].append(tokens / (time.perf_counter() - t0))
        finally:
            engine.close()

    rows = [
        {"side": k, "tokens/s (median)": statistics.median(v), "min": min(v), "max": max(v)} for k, v in tps.items()
    ]
    print_table(
        rows,
        title=f"rollout throughput, {num_prompts} prompts x {n} samples x <= {max_tokens} tokens, tiny model {a.hidden}x{a.layers} (vLLM CPU, shared 2-core machine)",
    )
    med = {k: statistics.median(v) for k, v in tps.items()}
    emit_json(
        {
            "bench": "rollout",
            "quick": a.quick,
            "smoke": a.smoke,
            "rollout_tokens_per_s": round(med["rollout engine"], 1),
            "raw_tokens_per_s": round(med["vLLM LLM.generate"], 1),
            "rollout_over_raw": round(med["rollout engine"] / med["vLLM LLM.generate"], 4),
            "experiences_tokens_per_s": round(med["plain explorer step"], 1),
            "experiences_over_rollout": round(med["plain explorer step"] / med["rollout engine"], 4),
            "experiences_rows_ms": round(statistics.median(rows_ms), 2),
        }
    )


if __name__ == "__main__":
    main()
