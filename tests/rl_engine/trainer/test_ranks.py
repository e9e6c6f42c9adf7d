"""The trainer on 2 data-parallel ranks (torchrun, gloo) makes the same update as on 1, and
resumes exactly.

    .venv/bin/python -m pytest tests/rl_engine/trainer/test_ranks.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_engine.trainer.launch import launcher_env
from rl_engine.trainer.ranks import share

SCRIPT = Path(__file__).with_name("ranks_script.py")


def _train(model_dir: str, ranks: int, out: Path) -> dict[int, tuple[list[dict], dict[str, torch.Tensor]]]:
    """{ZeRO stage: (two steps' metrics, updated weights)} of ranks_script.py on `ranks` ranks."""
    env = launcher_env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        f"--log-dir={out / 'logs'}",
        "--redirects=3",  # each rank's stdout and stderr to its own file: a rank that aborts says why
        str(SCRIPT),
        model_dir,
        ",".join(map(str, STAGES)),
        str(out),
    ]
    done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + _rank_tails(out / "logs")
    return {
        z: (json.loads((out / f"zero={z}" / "metrics.json").read_text()), _weights(out / f"zero={z}")) for z in STAGES
    }


def _rank_tails(log_dir: Path, lines: int = 15) -> str:
    """The last lines of each rank's stderr (torchrun --redirects), last in the message: the suite
    report keeps a failure's last lines."""
    return "".join(
        f"\n--- {f.relative_to(log_dir)} ---\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
        for f in sorted(log_dir.rglob("stderr.log"))
    )


def _weights(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return load_file(d / "weights.safetensors"), load_file(d / "weights-resumed.safetensors")


STAGES = (0, 2)


@pytest.mark.slow
def test_two_ranks_make_the_same_update_as_one(tiny_model_dir, tmp_path):
    one, two = _train(tiny_model_dir, 1, tmp_path / "one"), _train(tiny_model_dir, 2, tmp_path / "two")
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    for zero in STAGES:
        (m1, (w1, _)), (m2, (w2, w2_resumed)) = one[zero], two[zero]
        assert m1[1]["kl"] > 0 and m1[1]["clip_frac"] > 0  # every term of the loss is in play
        for step in (0, 1):
            for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl", "grad_norm", "tokens"):
                assert m2[step][key] == pytest.approx(m1[step][key], rel=1e-5, abs=1e-7), (zero, step, key)
        moved = max(float((w1[n] - initial[n]).abs().max()) for n in w1 if n in initial)
        diff = max(float((w1[n] - w2[n]).abs().max()) for n in w1)
        assert moved > 1e-3, zero  # two steps at lr 1e-3
        # fp32, gradients summed in another order: Adam's 1/sqrt(v) turns ~0 gradient entries'
        # noise into a visible share of one step (as with gradient accumulation, test_trainer_steps).
        assert diff <= 1e-5, (zero, diff)
        # Resumed from the state saved after step 1, on 2 ranks again: step 2 exactly as before.
        assert m2[2] == m2[1], zero
        for n in w2:
            assert torch.equal(w2_resumed[n], w2[n]), (zero, n)


def test_a_ranks_share_keeps_groups_whole():
    batch = {
        "input_ids": torch.arange(8)[:, None].repeat(1, 3),
        "group_index": torch.tensor([2, 0, 1, 3, 0, 2, 1, 3]),
    }  # [8, 3]
    parts = [share(batch, r, 2) for r in (0, 1)]
    assert parts[0]["group_index"].tolist() == [0, 0, 1, 1] and parts[1]["group_index"].tolist() == [2, 2, 3, 3]
    assert parts[0]["input_ids"][:, 0].tolist() == [1, 4, 2, 6]
    with pytest.raises(ValueError, match="does not split over 3 trainer ranks"):
        share(batch, 0, 3)
