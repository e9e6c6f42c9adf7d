"""`make demo-real` (`rft demo --model smollm2`): the real model end to end, shrunk by --set to 2
steps: fetch (the session's converted SmolLM2 is linked in), tasks, held-out scores before, the
synchronous run of configs/smollm2.yaml with collective sync (its engine on every core of the run's
process), the summary, held-out after.

    .venv/bin/python -m pytest tests/flows/test_demo_real.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.flows.test_cli_progress import rft

pytestmark = pytest.mark.slow

SHRINK = [
    "trainer.total_steps=2",
    "trainer.checkpoint_interval=2",
    "explorer.batch_size=2",
    "algorithm.repeat_times=4",
    "trainer.micro_batch_size=8",
    "explorer.sampling.max_tokens=12",
    "trainer.lr=1e-5",
]


@pytest.mark.timeout(600)
def test_demo_real_scores_trains_and_scores_again(smollm2_dir, real_model_turn, tmp_path):
    from safetensors import safe_open

    root = tmp_path / "runs"
    (root / "models").mkdir(parents=True)
    (root / "models" / "smollm2-135m").symlink_to(smollm2_dir)  # fetched once per session
    args = ["demo", "--model", "smollm2", "--root", str(root), "--heldout", "8"]
    res = rft([*args, *(x for s in SHRINK for x in ("--set", s))], tmp_path, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    run_dir = Path(re.search(r"^run:\s+(\S+)\s+\(mode synchronous\)$", out, re.M).group(1))
    # explorer.engine.num_threads: all reached vLLM's worker: bound to every core this machine lets the run use
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert f"VLLM_CPU_OMP_THREADS_BIND='{cores}'" in (run_dir / "logs" / "engines.log").read_text()
    assert re.search(r"^trained:\s+2 steps -> version 2, 2 explorer steps$", out, re.M), out
    assert re.search(r"^experiences: 16 generated, 16 trained, 0 dropped as stale, 0 left untrained$", out, re.M), out
    m = re.search(r"^held-out exact match over 8 problems: greedy ([\d.]+)% -> ([\d.]+)%, temperature 1 ([\d.]+)% -> ([\d.]+)% \(before -> after GRPO\); trained model: (\S+)$", out, re.M)
    assert m and Path(m.group(5)) == run_dir / "model", out
    # The task sets were written; the held-out ones are never asked in training.
    train = {json.loads(line)["question"] for line in (root / "data" / "words-train.jsonl").read_text().splitlines()}
    heldout = [json.loads(line)["question"] for line in (root / "data" / "words-heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == 320 and not train & set(heldout)
    # The trained model is a tied-embedding HF directory whose weights moved from the base model's.
    cfg = json.loads((run_dir / "model" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["vocab_size"] == 49152
    with safe_open(str(run_dir / "model" / "model.safetensors"), "pt") as new, safe_open(str(Path(smollm2_dir) / "model.safetensors"), "pt") as old:
        assert "lm_head.weight" not in new.keys()  # tied: stored once, as the embedding
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not (new.get_tensor(name) == old.get_tensor(name)).all()
