"""Benchmark of the rollout engine against vLLM's own `LLM.generate` on the same engine.

Both sides run the same prompts with the same per-request SamplingParams (n samples, the
configured temperature, distinct seeds, sampled-token logprobs), so vLLM does identical work;
the difference is what `VLLMRolloutEngine.generate` adds: prompt checks and turning vLLM's
outputs into `Rollout`s (token ids, logprobs, finish reason, version). Rounds alternate
between the two to spread out noise from other processes.

    python -m bench.rollout            # 64 prompts x 4 samples x 64 tokens, 5 rounds
    python -m bench.rollout --quick    # 16 prompts, 3 rounds
    python -m bench.rollout --smoke    # CI smoke test: 4 prompts x 2 samples x 8 tokens, 1 round (the engine start dominates)

Prints a table, then one JSON line with `rollout_over_raw` (tokens/s of ours over vLLM's).
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer prompts and rounds")
    size.add_argument("--smoke", action="store_true", help="CI smoke test: the fewest prompts, samples, tokens and rounds")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny model")
    ap.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    a = ap.parse_args(argv)
    num_prompts, rounds, n, max_tokens = (4, 1, 2, 8) if a.smoke else (16, 3, 4, 64) if a.quick else (64, 5, 4, 64)

    from vllm.inputs import TokensPrompt

    from rl_engine.config import RFTConfig
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as work:
        model_dir = str(make_tiny_model(f"{work}/model", seed=0, hidden_size=a.hidden, num_layers=a.layers))
        cfg = RFTConfig.model_validate(
            {
                "model": {"path": model_dir, "max_model_len": 128},
                "taskset": {"path": "unused.jsonl"},
                "explorer": {"engine": {"kv_cache_space_gib": 0.5}, "sampling": {"max_tokens": max_tokens, "temperature": 1.0}},
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
                return sum(len(c.token_ids) for o in engine.llm.generate(inputs, params, use_tqdm=False) for c in o.outputs)

            ours(seed=10_000), raw(seed=10_000)  # warm-up
            tps: dict[str, list[float]] = {"rollout engine": [], "vLLM LLM.generate": []}
            for i in range(rounds):
                order = [("rollout engine", ours), ("vLLM LLM.generate", raw)]
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    tokens = fn(seed=i)  # same seed for both: identical samples, identical token counts
                    tps[name].append(tokens / (time.perf_counter() - t0))
        finally:
            engine.close()

    rows = [{"side": k, "tokens/s (median)": statistics.median(v), "min": min(v), "max": max(v)} for k, v in tps.items()]
    print_table(rows, title=f"rollout throughput, {num_prompts} prompts x {n} samples x <= {max_tokens} tokens, tiny model {a.hidden}x{a.layers} (vLLM CPU, shared 2-core machine)")
    ratio = statistics.median(tps["rollout engine"]) / statistics.median(tps["vLLM LLM.generate"])
    emit_json(
        {
            "bench": "rollout",
            "quick": a.quick,
            "smoke": a.smoke,
            "rollout_tokens_per_s": round(statistics.median(tps["rollout engine"]), 1),
            "raw_tokens_per_s": round(statistics.median(tps["vLLM LLM.generate"]), 1),
            "rollout_over_raw": round(ratio, 4),
        }
    )


if __name__ == "__main__":
    main()
