"""Faults report: how the pipeline meets bad input, killed runs and storage outages.

    python -m bench.faults --smoke      # seconds (tests/bench): a bad input per area, no kill trial, short outages, few lease races
    python -m bench.faults --quick      # CI size: every bad input that needs no engine, one kill trial
    python -m bench.faults              # also the bad inputs that start a real run; 5 kill trials per mode and 5 more
                                        # of multi-explorer before its first trainer state (25 trials, 1.5-5 min each on 2 cores)

Bad inputs: every row of the table in harness/bad_input.py (configs, model
directories, task sets, rewards, prompts, storage, resumes, buffer files, the command line), each
met the way a user meets it; a row is *clear* when it ends in a UserError (exit code 2 and no
traceback through `rft`) whose message names the problem and the fix, or in a counted, excluded
sample where the design says so, with every file stored before it unchanged.

Output: one table per section, then one JSON line. Sections are functions `(args) -> (rows,
summary)`; the JSON line merges their summaries. Keys so far: `bad_inputs` (rows tried),
`bad_inputs_clear` (rows clear), `bad_inputs_fixed` (rows that were not clear before issue 13).
Kill trials (harness/kill_resume.py's `kill_trial`: `rft run` with partial rollouts,
SIGKILLed at a seeded random point, the whole process group or only the main process, then
`rft run --resume`): `kill_trials` (= `kills`: trials that reached their kill point;
`kill_errors`: those that did not), `kill_lost` (= `lost`: experiences committed before the kill
and missing after the resume, plus pending continuations lost), `kill_untrained` (trials where a
committed batch was neither trained nor dropped as stale, or the reader consumed more than the
steps trained), `duplicated` (experience ids stored twice), `kill_trained_twice` (explorer steps
the final model trained twice), `kill_survivors` (= `orphans`: processes of the killed run still
running 30 s after the kill), `kill_resume_failed`, `kill_order_breaks` (prompts replayed or
drawn out of order), `kill_schedule_breaks` (segments after the resume outside the mode's
schedule). Storage outages (harness/s3_outage.py's `buffer_outage_trial`: a buffer writer and reader
through a proxy in front of moto that stalls or refuses connections): `outage_seconds_survived`
(the longest outage within the limit that a trial survived), `outage_within_limit_failed`,
`outage_past_limit_clear` (outages past a 5 s limit that failed within 3 s of it, naming the URL),
`outage_lost`, `outage_duplicated`, `outage_not_whole` (visible objects that are not whole).
Each kill trial's run (partial rollouts) is also read back for repetitions: `repeat_rows` (stored
responses holding a complete repetition, by the detector's own rule over the whole response) and
`repeat_late` (those that go on past its first complete occurrence; goal 0).
Lease races (bench/_lease_race.py: processes released at once by a barrier, each calling
RunLease.acquire on the same lease, 200 rounds; 50 with --quick where a round is slow): on local
disk, on local disk with writes landing up to 0.3 s late, on S3 (moto): `lease_races`,
`lease_double_wins` (rounds with two winners; goal 0), `lease_no_wins`. Retention (trainer states
saved at steps 5..40 and pruned after each save, `keep_last_states` null, 1, 2, 3, 10, local and
S3): `retention_cases`, `retention_wrongly_deleted` (states the policy promised to keep that were
gone; goal 0), `retention_kept_extra`.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._report import emit_json, print_table

Section = Callable[[argparse.Namespace], tuple[list[dict[str, Any]], dict[str, Any]]]


def bad_inputs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every row of the bad-input table (`--quick`: those that start no engine)."""
    from harness.bad_input import Env, run_case
    from harness.bad_input_features import TABLE
    from rl_engine.tiny_model import make_tiny_model

    cases = [c for c in TABLE if not ((args.quick or args.smoke) and c.needs == "engine")]
    if args.smoke:  # one row per area
        cases = list({c.area: c for c in reversed(cases)}.values())[::-1]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rft-faults-") as tmp, _S3() as s3:
        model = str(make_tiny_model(Path(tmp) / "model", seed=0))
        for i, case in enumerate(cases):
            case_dir = Path(tmp) / f"case-{i:02d}"
            case_dir.mkdir()
            out = run_case(case, Env(case_dir, model, s3=s3.start))
            rows.append(
                {
                    **{k: out[k] for k in ("area", "case", "outcome", "clear", "before")},
                    "message": _short(out["why"] or out["message"]),
                }
            )
    summary = {
        "bad_inputs": len(rows),
        "bad_inputs_clear": sum(r["clear"] for r in rows),
        "bad_inputs_fixed": sum(r["before"] == "fixed" for r in rows),
    }
    return rows, summary


def _short(text: str, width: int = 90) -> str:
    # Through `rft`, the message is stderr: its `error:` line, not the logs before it.
    text = next((line for line in reversed(text.splitlines()) if line.startswith("error: ")), text)
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


def kill_trials(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Kill trials over the modes (`--quick`: one), each started, killed and resumed through `rft`."""
    import random

    from harness.kill_resume import (
        EARLY,
        POINTS,
        SCOPES,
        kill_trial,
        prompt_order_breaks,
        schedule_breaks,
        trained_twice,
        untrained,
    )
    from harness.runs import MODES
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.tiny_model import make_tiny_model

    if args.smoke:  # the same trial runs in CI as tests/flows/test_kill_resume.py
        return [], {
            k: 0
            for k in (
                "kill_trials",
                "kill_errors",
                "kill_lost",
                "kill_untrained",
                "kill_trained_twice",
                "kill_survivors",
                "kill_resume_failed",
                "kill_order_breaks",
                "kill_schedule_breaks",
                "duplicated",
                "repeat_rows",
                "repeat_late",
                "kills",
                "lost",
                "orphans",
            )
        } | {"kill_seed": args.seed}
    rng = random.Random(args.seed)
    # Multi-explorer also killed before its first trainer state, as often as after: twice the trials.
    plan = (
        [("one_step_off_policy", rng.choice(SCOPES), rng.choice(POINTS))]
        if args.quick
        else [(mode, SCOPES[i % 2], rng.choice(POINTS)) for mode in MODES for i in range(args.trials_per_mode)]
        + [("multi_explorer", SCOPES[i % 2], EARLY) for i in range(args.trials_per_mode)]
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rft-kills-") as tmp:
        model = str(make_tiny_model(Path(tmp) / "model", seed=0))
        tasks = str(Path(tmp) / "tasks.jsonl")
        write_arithmetic_taskset(tasks, n=200, seed=3)
        for i, (mode, scope, point) in enumerate(plan):
            root = Path(tmp) / f"trial-{i:02d}"
            root.mkdir()
            try:
                t = kill_trial(
                    model,
                    tasks,
                    root,
                    mode,
                    scope,
                    point,
                    random.Random(rng.random()),
                    prefect_home=Path(tmp, "prefect-home"),
                )
            except (
                AssertionError,
                OSError,
                subprocess.SubprocessError,
            ) as e:  # the run never reached its kill point, or hung
                rows.append({"mode": mode, "killed": scope, "at": point, "error": _short(str(e))})
                continue
            repeats, late = late_repeats(t["run"])
            rows.append(
                {
                    "mode": mode,
                    "killed": scope,
                    "at": point,
                    "after_s": t["killed_after_s"],
                    "checkpoint": t["saved"],
                    "repeats": repeats,
                    "repeat_late": late,
                    "stored": len(t["before"]),
                    "pending": len(t["held"]),
                    "survivors": len(t["survivors"]),
                    "resumed": t["resume_rc"] == 0,
                    "lost": len(t["lost"]),
                    "untrained": bool(untrained(t)) if t["resume_rc"] == 0 else False,
                    "continuations_lost": len(t["continuations_lost"]),
                    "duplicated": len(t["duplicated"]),
                    "trained_twice": len(trained_twice(t)),
                    "order_breaks": len(prompt_order_breaks(t)),
                    "schedule_breaks": len(schedule_breaks(t)),
                    "trial_s": t["total_s"],
                    "error": "",
                }
            )
    done = [r for r in rows if not r["error"]]
    rows = done + [r for r in rows if r["error"]]  # the table's columns come from its first row
    summary = {
        "kill_trials": len(done),
        "kill_errors": len(rows) - len(done),
        "kill_lost": sum(r["lost"] + r["continuations_lost"] for r in done),
        "kill_untrained": sum(r["untrained"] for r in done),
        "kill_trained_twice": sum(r["trained_twice"] for r in done),
        "kill_survivors": sum(r["survivors"] for r in done),
        "kill_resume_failed": sum(not r["resumed"] for r in done),
        "kill_order_breaks": sum(r["order_breaks"] for r in done),
        "kill_schedule_breaks": sum(r["schedule_breaks"] for r in done),
        "duplicated": sum(r["duplicated"] for r in done),
        "repeat_rows": sum(r["repeats"] for r in done),
        "repeat_late": sum(r["repeat_late"] for r in done),
    }
    return rows, {
        **summary,
        "kills": summary["kill_trials"],
        "lost": summary["kill_lost"],
        "orphans": summary["kill_survivors"],
        "kill_seed": args.seed,
    }


def storage_outages(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Buffer writes and reads across S3 outages (harness/s3_outage.py: a proxy in front of moto that
    stalls or refuses): 20 s (and 60 s without --quick) within a 90 s limit, then past a 5 s limit."""
    import uuid

    import s3fs

    from harness.s3_outage import buffer_outage_trial

    kinds = ("stall", "refuse")
    plan = [(k, s, 90.0) for s in ((20.0,) if args.quick else (20.0, 60.0)) for k in kinds] + [
        (k, 120.0, 5.0) for k in kinds
    ]
    if args.smoke:
        plan = [("stall", 3.0, 90.0), ("refuse", 120.0, 5.0)]
    rows: list[dict[str, Any]] = []
    with _S3() as s3:
        endpoint, options = s3.start()
        for kind, outage_s, limit_s in plan:
            bucket = f"outage-{uuid.uuid4().hex[:8]}"
            s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
            t = buffer_outage_trial(f"s3://{bucket}/run", endpoint, kind, outage_s, limit_s)
            error = t["write_error"] or t["read_error"]
            rows.append(
                {
                    "outage": kind,
                    "outage_s": outage_s if outage_s < limit_s else f">{limit_s:g}",
                    "limit_s": limit_s,
                    "outcome": "survived" if t["survived"] else "failed",
                    "blocked_s": max(t["write_s"], t["read_s"]),
                    "lost": t["lost"],
                    "duplicated": t["duplicated"],
                    "unexpected": t["unexpected"],
                    "not_whole": len(t["visible"]["not_whole"]),
                    "clear": t["survived"]
                    or (f"s3://{bucket}/run/" in error and "outage_timeout_s" in error and t["write_s"] <= limit_s + 3),
                    "error": _short(error),
                }
            )
    survived = [r for r in rows if r["outcome"] == "survived" and r["limit_s"] > 5]
    summary = {
        "outage_trials": len(rows),
        "outage_seconds_survived": max((float(r["outage_s"]) for r in survived), default=0.0),
        "outage_within_limit_failed": len([r for r in rows if r["limit_s"] > 5]) - len(survived),
        "outage_past_limit_clear": sum(r["clear"] for r in rows if r["limit_s"] == 5),
        "outage_lost": sum(r["lost"] + r["unexpected"] for r in rows),
        "outage_duplicated": sum(r["duplicated"] for r in rows),
        "outage_not_whole": sum(r["not_whole"] for r in rows),
    }
    return rows, summary


def lease_races(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Processes racing for one lease (bench/_lease_race.py), round after round: exactly one must
    win each round, on local disk, on local disk with writes landing up to 0.3 s late, and on S3."""
    import time
    import uuid

    import s3fs

    from bench._lease_race import race

    n = 10 if args.smoke else 50 if args.quick else 200
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rft-lease-") as tmp, _S3() as s3:
        _, options = s3.start()
        bucket = f"lease-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
        for storage, url, opts, rounds, procs, slow_s in (
            ("local", tmp + "/fast", {}, 20 if args.smoke else 200, 4, 0.0),
            ("local, writes up to 0.3 s late", tmp + "/slow", {}, n, 4, 0.3),
            ("s3 (moto)", f"s3://{bucket}/race", options, n, 3, 0.0),
        ):
            started = time.monotonic()
            wins = race(url, opts, processes=procs, rounds=rounds, slow_s=slow_s)
            rows.append(
                {
                    "storage": storage,
                    "rounds": rounds,
                    "processes": procs,
                    "double_wins": sum(w > 1 for w in wins),
                    "no_wins": sum(w == 0 for w in wins),
                    "seconds": time.monotonic() - started,
                }
            )
    summary = {
        "lease_races": sum(r["rounds"] for r in rows),
        "lease_double_wins": sum(r["double_wins"] for r in rows),
        "lease_no_wins": sum(r["no_wins"] for r in rows),
    }
    return rows, summary


def retention(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A run saving trainer states at steps 5, 10, ..., 40, pruned after each save as the trainer
    does (rl_engine/run/retention.py): after every save the newest `keep_last_states` (all of them
    while there are fewer) must be there, and nothing else, on local disk and on S3."""
    import uuid

    import s3fs

    from rl_engine.config import validate_config
    from rl_engine.pruning import list_dirs
    from rl_engine.run import retention as ret
    from rl_engine.run.context import RunContext
    from rl_engine.storage import join

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rft-retention-") as tmp, _S3() as s3:
        _, options = s3.start()
        bucket = f"retention-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
        (Path(tmp) / "model").mkdir()
        (Path(tmp) / "model" / "config.json").write_text("{}")
        for storage, url, opts in (("local", tmp + "/runs", {}), ("s3 (moto)", f"s3://{bucket}/runs", options)):
            for keep in (None, 1, 2, 3, 10):
                data = {
                    "model": {"path": f"{tmp}/model"},
                    "taskset": {"path": f"{tmp}/tasks.jsonl"},
                    "name": f"keep-{keep}",
                    "trainer": {"keep_last_states": keep},
                }
                cfg = validate_config({**data, "buffer": {"storage": {"url": url, "options": opts}}})
                run = RunContext(cfg, cfg.run_url)
                fs, root = run.fs()
                saved: list[int] = []
                wrong, extra = 0, 0
                for t in range(5, 45, 5):
                    fs.makedirs(ret.STATES.dir(root, t), exist_ok=True)  # local disk; nothing on S3
                    fs.pipe_file(join(ret.STATES.dir(root, t), "model.safetensors"), b"x")
                    fs.pipe_file(join(ret.STATES.dir(root, t), ret.STATES.marker), b"{}")
                    ret.prune_states(run)
                    saved.append(t)
                    want = set(saved if keep is None else saved[-keep:])
                    have = set(list_dirs(fs, root, ret.STATES)[0])
                    wrong, extra = wrong + len(want - have), extra + len(have - want)
                rows.append(
                    {
                        "storage": storage,
                        "keep_last_states": keep,
                        "saves": len(saved),
                        "kept": len(have),
                        "wrongly_deleted": wrong,
                        "kept_extra": extra,
                    }
                )
    summary = {
        "retention_cases": len(rows),
        "retention_wrongly_deleted": sum(r["wrongly_deleted"] for r in rows),
        "retention_kept_extra": sum(r["kept_extra"] for r in rows),
    }
    return rows, summary


def late_repeats(run: Any) -> tuple[int, int]:
    """(rows whose response holds a complete repetition, rows that go on past its first complete
    occurrence) among a partial-rollouts run's stored experiences: the detector looks at the whole
    response across segments, so every such row must end exactly there."""
    from pyarrow import ipc

    from rl_engine.buffer.stats import committed_files
    from rl_engine.roles.partial import repeat_cut

    p = run.cfg.explorer.partial
    fs, _ = run.fs()
    found = late = 0
    for path in committed_files(*run.fs()):
        table = ipc.open_file(fs.cat_file(path)).read_all()
        for ids in table.column("response_ids").to_pylist():
            if (k := repeat_cut(ids, 0, p.repeat_ngram, p.repeat_threshold)) is not None:
                found, late = found + 1, late + int(k < len(ids))
    return found, late


class _S3:
    """moto's S3 server on loopback, started on first use (the bucket rows), stopped at exit."""

    def __init__(self) -> None:
        self.server: Any = None
        self.value: tuple[str, dict[str, Any]] | None = None

    def start(self) -> tuple[str, dict[str, Any]]:
        if self.value is None:
            from harness.s3_server import start_s3_server

            self.server, endpoint = start_s3_server()
            self.value = (endpoint, {"client_kwargs": {"endpoint_url": endpoint}})
        return self.value

    def __enter__(self) -> _S3:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()


SECTIONS: list[tuple[str, Section]] = [
    ("bad inputs", bad_inputs),
    ("kill trials", kill_trials),
    ("storage outages", storage_outages),
    ("lease races", lease_races),
    ("retention", retention),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI size: bad inputs that start no engine, one kill trial")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: a bad input per area, no kill trial, one short outage each way, 10-20 lease races",
    )
    ap.add_argument("--trials-per-mode", type=int, default=5, help="kill trials per mode (without --quick)")
    ap.add_argument("--seed", type=int, default=13, help="seed of the kill points, scopes and delays")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"quick": args.quick, "smoke": args.smoke}
    for title, section in SECTIONS:
        rows, summary = section(args)
        print_table(rows, title=f"{title}: {summary}")
        print()
        result.update(summary)
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
