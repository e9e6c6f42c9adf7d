"""bench.peer's figures from per-seed rows, by hand (the bench itself: tests/flows/test_demo_real.py)."""

from __future__ import annotations

import pytest

from bench.peer import summarise, with_gains


def _row(system: str, seed: int, after: float | None, step: float, startup: float, end: float) -> dict:
    return with_gains(
        {
            "system": system,
            "seed": seed,
            "held_out_before": 0.325,
            "held_out_after": after,
            "s_per_step": step,
            "startup_s": startup,
            "end_to_end_s": end,
        }
    )


def test_three_seeds_by_hand():
    rows = [
        _row("rft", 42, 0.534, 20.0, 30.0, 700.0),
        _row("reference", 42, 0.659, 30.0, 10.0, 1000.0),
        _row("rft", 43, 0.759, 22.0, 34.0, 800.0),
        _row("reference", 43, 0.681, 34.0, 11.0, 1100.0),
        _row("rft", 44, 0.625, 21.0, 32.0, 750.0),
        _row("reference", 44, 0.625, 32.0, 12.0, 1050.0),
    ]
    assert rows[0]["gain_points"] == pytest.approx(20.9) and rows[0]["gain_per_s"] == pytest.approx(20.9 / 700)
    out = summarise(rows)
    rft_gain, ref_gain = (20.9 + 43.4 + 30.0) / 3, (33.4 + 35.6 + 30.0) / 3
    assert out["heldout_gain_rft"] == pytest.approx(rft_gain, abs=1e-3)
    assert out["heldout_gain_vs_reference"] == round(rft_gain / ref_gain, 3)
    assert out["heldout_spread"] == 22.5 and out["heldout_spread_reference"] == 5.6  # max - min, points
    assert out["step_over_reference_step"] == round(21.0 / 32.0, 3)
    assert out["startup_over_reference"] == round(32.0 / 11.0, 3)
    assert out["end_to_end_over_reference"] == round(750.0 / 1050.0, 3)
    rft_per_s = (20.9 / 700 + 43.4 / 800 + 30.0 / 750) / 3
    ref_per_s = (33.4 / 1000 + 35.6 / 1100 + 30.0 / 1050) / 3
    assert out["heldout_gain_per_s_vs_reference"] == round(rft_per_s / ref_per_s, 3)
    assert out["held_out_after_rft"] == [0.534, 0.759, 0.625]


def test_unscored_rows_give_null_gains_and_keep_the_times():
    out = summarise([_row("rft", 42, None, 20.0, 30.0, 60.0), _row("reference", 42, None, 40.0, 10.0, 50.0)])
    assert out["heldout_gain_vs_reference"] is None and out["heldout_gain_per_s_vs_reference"] is None
    assert out["heldout_spread"] is None
    assert out["step_over_reference_step"] == 0.5 and out["startup_over_reference"] == 3.0


def test_a_reference_that_did_not_learn_gives_no_ratio():
    out = summarise([_row("rft", 42, 0.5, 20.0, 30.0, 60.0), _row("reference", 42, 0.3, 40.0, 10.0, 50.0)])
    assert out["heldout_gain_vs_reference"] is None and out["heldout_gain_per_s_vs_reference"] is None
