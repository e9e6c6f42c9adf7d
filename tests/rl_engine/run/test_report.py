"""What people read of a run's report: floats rounded to a few significant digits in every
artifact (metrics table, summary markdown, continuation catalog, progress), and the summary as a
few lines (what `rft run` prints and the mode flow logs last), sharing one formatting."""

from __future__ import annotations

import math

from rl_engine.config import RFTConfig
from rl_engine.run.context import RunContext
from rl_engine.run.report import build_report, number, record_step, rounded, summary_lines

SUMMARY = {
    "run": "runs/synchronous-x",
    "mode": "synchronous",
    "trainer_steps": 4,
    "final_version": 4,
    "explorer_steps": 5,
    "reward_first": 0.5687500000000001,
    "reward_last": 0.534375,
    "max_staleness_seen": 1,
    "experiences": {
        "generated": 40,
        "trained": 32,
        "filtered": 0,
        "dropped_stale": 0,
        "skipped_corrupt": 0,
        "untrained": 8,
        "wasted_fraction": 0.2,
    },
    "utilization": {"startup_s": 3.21, "lanes": {"trainer": {"busy_fraction": 0.4567, "wait_s": 1.25}}},
    "model": "runs/synchronous-x/model",
}


def test_rounded_keeps_four_significant_digits_of_every_float():
    assert (
        rounded(0.5687500000000001) == 0.5688 and rounded(1.2345678e-05) == 1.235e-05 and rounded(12345.678) == 12350.0
    )
    assert rounded({"a": [0.1 + 0.2, 3, True, "x", None], "b": (2 / 3,)}) == {
        "a": [0.3, 3, True, "x", None],
        "b": (0.6667,),
    }
    assert math.isnan(rounded(float("nan"))) and rounded(float("inf")) == float("inf")
    assert (number(0.5687500000000001), number(0.0), number(1.2345678e-05), number(None), number(7)) == (
        "0.5688",
        "0.0",
        "1.235e-05",
        "n/a",
        "7",
    )


def test_summary_lines_say_run_steps_reward_experiences_staleness_report_and_model():
    text = "\n".join(summary_lines(SUMMARY))
    assert "4 steps -> version 4" in text and "0.569 (first quarter) -> 0.534 (last quarter)" in text
    assert "40 generated, 32 trained" in text and "staleness:  max 1" in text and "trainer      46%" in text
    assert "runs/synchronous-x/report/" in text and "model:      runs/synchronous-x/model" in text
    assert "0.5687500000000001" not in text and "{" not in text  # not a dict
    bare = summary_lines(
        {
            **SUMMARY,
            "trainer_steps": 0,
            "final_version": None,
            "reward_first": None,
            "reward_last": None,
            "utilization": {},
            "model": None,
        }
    )
    assert "n/a (first quarter)" in "\n".join(bare) and not any(line.startswith("model:") for line in bare)


def test_report_table_and_markdown_are_rounded_the_stored_metrics_are_not(tmp_path, tiny_model_dir):
    cfg = RFTConfig.model_validate(
        {
            "name": "r",
            "model": {"path": tiny_model_dir},
            "taskset": {"path": "unused.jsonl"},
            "buffer": {"storage": {"url": str(tmp_path)}},
        }
    ).resolved()
    run = RunContext(cfg=cfg, url=cfg.run_url)
    for t, reward in enumerate([0.5687500000000001, 0.1 + 0.2], start=1):
        record_step(
            run,
            "trainer",
            t,
            {
                "step": t,
                "version": t,
                "reward_mean": reward,
                "reward_std": 0.1,
                "loss": 1.2345678e-05,
                "staleness_max": 0,
                "wait_experience_s": 0.123456,
                "train_s": 2.0,
            },
        )
    rep = build_report(run)
    assert (
        rep.table[0]["reward_mean"] == 0.5688
        and rep.table[1]["reward_mean"] == 0.3
        and rep.table[0]["loss"] == 1.235e-05
        and rep.table[0]["wait_experience_s"] == 0.1235
    )
    assert "0.5688 -> 0.3\n" in rep.markdown and "0.5687500000000001" not in rep.markdown
    assert (
        rep.summary["reward_first"] == 0.5687500000000001 and rep.summary["model"] is None
    )  # summary.json keeps full precision


def test_continuation_catalog_artifact_is_rounded(monkeypatch):
    import tasks.continuations as c

    tables = []
    monkeypatch.setattr(c, "create_table_artifact", lambda rows, **kw: tables.append(rows))
    monkeypatch.setattr(c, "create_link_artifact", lambda *a, **kw: None)
    group = {
        "group": "g",
        "task": "t",
        "finished": "1/2",
        "segments": 2,
        "tokens": 9,
        "versions": [1, 2],
        "age_steps": 1,
        "score": 0.1 + 0.2,
    }
    c.publish_continuations(
        {
            "explorer_id": 0,
            "explorer_step": 3,
            "partial": {"continuations": {"publish": True, "run": "r", "manifest": "m", "groups": [group]}},
        }
    )
    assert tables == [[{**group, "versions": "1,2", "score": 0.3}]]
