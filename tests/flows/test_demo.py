"""`make demo`, the README's first command: `rft demo` finds the warm-started tiny model and the
arithmetic tasks (the session's demo model, built once per machine by the same code, is linked
in), trains 20 GRPO steps one-step off-policy, and prints the summary docs/quickstart.md shows, ending
with the held-out exact-answer rate before and after (about a minute here).

    .venv/bin/python -m pytest tests/flows/test_demo.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rl_engine.demos.arithmetic import arithmetic_pairs
from tests.cli.test_progress import rft

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_make_demo_builds_trains_and_prints_its_summary(demo_model_dir, tmp_path):
    root = tmp_path / "runs"
    (root / "models").mkdir(parents=True)
    (root / "models" / "tiny-arith-sft").symlink_to(demo_model_dir)  # built once per machine (demo_inputs)
    res = rft(["demo", "--root", str(root)], tmp_path, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "building the demo model" not in out  # found, not built again
    trained = [json.loads(line)["question"] for line in (root / "data" / "arith-train.jsonl").read_text().splitlines()]
    assert trained and not {f"{a}+{b}=" for a, b in arithmetic_pairs("heldout")} & set(trained)  # the train split
    # The summary lines docs/quickstart.md quotes, with the demo's numbers.
    run_dir = Path(re.search(r"^run:\s+(\S+)\s+\(mode one_step_off_policy\)$", out, re.MULTILINE).group(1))
    assert re.search(r"^trained:\s+20 steps -> version 20, 20 explorer steps$", out, re.MULTILINE), out
    assert re.search(r"^staleness:\s+max 1$", out, re.MULTILINE), out
    assert re.search(
        r"^experiences: 1280 generated, 1280 trained, 0 dropped as stale, 0 left untrained$", out, re.MULTILINE
    ), out
    assert re.search(r"^report:\s+.*\(timeline\.png, reward-curve\.png, summary\.json\)$", out, re.MULTILINE), out
    for f in ("timeline.png", "reward-curve.png", "summary.json"):
        assert (run_dir / "report" / f).stat().st_size > 0
    assert (run_dir / "model" / "config.json").is_file() and (run_dir / "model" / "model.safetensors").is_file()
    # The rate over the held-out problems (neither the SFT warm start nor the run drew them) moved up:
    # the trained weights are the ones evaluated, and they generalise past the train problems.
    m = re.search(
        r"^exact answers over the 57 held-out problems \(never trained on\): ([\d.]+)% at temperature 1 \(([\d.]+)% greedy\) before GRPO, ([\d.]+)% \(([\d.]+)% greedy\) after",
        out,
        re.MULTILINE,
    )
    assert m, out
    before, after = float(m.group(1)), float(m.group(3))
    assert after > before, out
