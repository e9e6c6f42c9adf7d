"""bench/reference_loop.py on the tiny model: the reference loop bench.peer runs beside rft.

Its samples are laid out as rft's trainer batches are, its behavior logprobs are the training
forward's (left-padded generation and right-padded training see the same tokens at the same
positions), it walks the tasks in the explorer's order, and a short loop trains and writes a model.

    .venv/bin/pytest -q tests/bench/test_reference_loop.py
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import torch

from bench.reference import sequence_logprobs
from bench.reference_loop import reference_loop, sample_groups, to_batch
from bench.step_floor import typical_step


def tiny_cfg(model_dir: str, task_file: str, **trainer):
    from rl_engine.config import RFTConfig

    return RFTConfig.model_validate(
        {
            "model": {"path": model_dir, "max_model_len": 128},
            "taskset": {"path": task_file},
            "explorer": {"batch_size": 2, "sampling": {"max_tokens": 8, "temperature": 0.9}},
            "algorithm": {"repeat_times": 3},
            "trainer": {"micro_batch_size": 3, "lr": 1e-3, "num_threads": 1, **trainer},
        }
    )


def test_samples_are_a_trainer_batch_with_the_generating_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_engine.config import SamplingConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[40, 41, 42, 43, 44], [50, 51]]  # ragged: the second is left-padded for generate
    sampling = SamplingConfig(temperature=0.9, max_tokens=6)
    samples = sample_groups(model, prompts, 3, sampling, pad_id=0, eos_ids={1})
    assert [s["prompt_ids"] for s in samples] == [prompts[0]] * 3 + [prompts[1]] * 3
    for s in samples:
        ids = s["response_ids"]
        assert 1 <= len(ids) <= 6 and len(s["logprobs"]) == len(ids)
        assert (s["finish_reason"] == "stop") == (ids[-1] == 1) and 1 not in ids[:-1]
    batch = to_batch(samples, [1.0, 0.0, 0.5, 0.0, 0.0, 1.0], 3, pad_id=0)
    assert batch["group_index"].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch["loss_mask"].sum(1).tolist() == [len(s["response_ids"]) for s in samples]
    with torch.no_grad():
        logp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.9)  # [B, L]
    m = batch["loss_mask"] > 0
    torch.testing.assert_close(logp[m], batch["behavior_logprobs"][m], rtol=1e-4, atol=1e-4)


def test_loop_walks_the_explorers_task_order_trains_and_writes_the_model(tiny_model_dir, task_file, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_engine.rewards import TaskIterator, load_taskset

    cfg = tiny_cfg(tiny_model_dir, task_file)
    out = reference_loop(cfg, 2, str(tmp_path / "ref"))
    assert len(out["step_s"]) == len(out["rewards"]) == 2 and out["end_to_end_s"] > 0
    assert [m["lr"] for m in out["metrics"]] == [1e-3, 1e-3]  # warmup_steps 0 here
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"))
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = [n for (n, p), (_, q) in zip(trained.named_parameters(), start.named_parameters()) if not torch.equal(p, q)]
    # rewards of the untrained tiny model are mostly 0: the loop moved the weights only if some group differed
    assert bool(moved) == any(m["grad_norm"] > 0 for m in out["metrics"])
    order = TaskIterator(load_taskset(cfg.taskset), 2, seed=cfg.seed, shuffle=cfg.taskset.shuffle)
    assert [t.task_id for t in order.next_batch()] == out["task_ids"][0]


def test_peer_summary_figures():
    """bench.peer's JSON figures from per-seed rows: ratios of means, spreads in points, nulls where undefined."""
    from bench.peer import summarise, with_gains

    def row(system, seed, after, step, e2e, startup=10.0):
        return with_gains(
            {
                "system": system,
                "seed": seed,
                "held_out_before": 0.3,
                "held_out_after": after,
                "s_per_step": step,
                "startup_s": startup if system == "rft" else startup / 4,
                "end_to_end_s": e2e,
            }
        )

    rows = [row("rft", 1, 0.7, 20.0, 100.0), row("reference", 1, 0.5, 40.0, 200.0)]
    rows += [row("rft", 2, 0.5, 30.0, 100.0), row("reference", 2, 0.6, 40.0, 200.0)]
    s = summarise(rows)
    # gains: rft 40, 20 (mean 30); reference 20, 30 (mean 25); per second: rft .4, .2; reference .1, .15
    assert s["heldout_gain_vs_reference"] == 1.2 and s["heldout_spread"] == 20.0
    assert s["heldout_spread_reference"] == 10.0
    assert s["step_over_reference_step"] == 0.625 and s["end_to_end_over_reference"] == 0.5
    assert s["heldout_gain_per_s_vs_reference"] == 2.4
    assert s["startup_over_reference"] == 4.0 and s["startup_s_rft"] == 10.0
    assert s["held_out_after_rft"] == [0.7, 0.5]
    unlearned = summarise([row("rft", 1, 0.7, 20.0, 100.0), row("reference", 1, 0.2, 40.0, 200.0)])
    assert unlearned["heldout_gain_vs_reference"] is None and unlearned["heldout_gain_per_s_vs_reference"] is None
    unscored = summarise([row("rft", 1, None, 20.0, 100.0), row("reference", 1, None, 40.0, 200.0)])
    assert unscored["heldout_gain_vs_reference"] is None and unscored["heldout_spread"] is None
    assert unscored["step_floor_s"] is None and unscored["heldout_gain_per_s_bound_vs_reference"] is None


def test_peer_bounds_from_the_same_run():
    """bench.peer's bounds by hand: rft's end to end with every step at its floor, the engine start
    against the reference's start-up, transformers' generate against vLLM's rollout and sync."""
    from bench.peer import summarise, with_gains

    rft = {"system": "rft", "seed": 1, "held_out_before": 0.3, "held_out_after": 0.5, "startup_s": 12.0}
    rft |= {"s_per_step": 15.0, "end_to_end_s": 500.0, "generate_s": 2.5, "sync_s_explorer": 0.5, "engine_start_s": 8.0}
    ref = {"system": "reference", "seed": 1, "held_out_before": 0.3, "held_out_after": 0.5, "startup_s": 0.5}
    ref |= {"s_per_step": 20.0, "end_to_end_s": 600.0, "generate_s": 6.0}
    rows = [{**rft, "step_floor_s": None}, {**rft, "seed": 2, "step_floor_s": 13.0}, ref, {**ref, "seed": 2}]
    s = summarise([with_gains(r) for r in rows], steps=30)
    # floor 13 s over the reference's 20 s; at the floor rft's end to end is 500 - 30 x (15 - 13) = 440 s
    assert s["step_floor_s"] == 13.0 and s["step_floor_over_reference_step"] == 0.65
    assert s["heldout_gain_per_s_bound_vs_reference"] == round(600 / 440, 3)
    assert s["startup_floor_s"] == 8.0 and s["startup_floor_over_reference"] == 16.0
    assert s["colocated_generate_over_rollout_and_sync"] == 2.0  # 6 s against 2.5 + 0.5 s
    unbounded = summarise([with_gains(rft), with_gains(ref)])  # no steps, no floor: no bound
    assert unbounded["heldout_gain_per_s_bound_vs_reference"] is None


def test_the_floor_is_measured_on_the_step_of_median_tokens():
    # steps 1..4 with 30, 10, 20, 40 tokens: of an even count the lower median, step 3 (20)
    rows = {1: [(3, 12), (4, 11)], 2: [(3, 2), (2, 3)], 3: [(3, 7), (5, 5)], 4: [(20, 20)]}
    table = pa.table(
        {
            "explorer_step": [e for e, rs in rows.items() for _ in rs],
            "prompt_ids": [[0] * p for rs in rows.values() for p, _ in rs],
            "response_ids": [[0] * r for rs in rows.values() for _, r in rs],
        }
    )
    assert typical_step(table) == 3
    first_three = table.filter(pc.not_equal(table.column("explorer_step"), 4))  # 30, 10, 20
    assert typical_step(first_three) == 3  # the median, not the long first step
