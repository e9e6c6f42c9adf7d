"""Kill a run anywhere, resume it exactly once: one trial and the checks on what it left.

`kill_trial` starts `rft run CONFIG` (the real CLI, its own process group, its own ephemeral
Prefect server) with partial rollouts on, SIGKILLs it at a point (mid-rollout, right after a
trainer checkpoint, mid-continuation-save, mid-weight-sync; the whole process group or only the
main process), collects what survived, resumes it with `rft run CONFIG --resume RUN` and returns
what tests/flows/test_kill_resume.py asserts on and bench.faults counts; `trained_twice`,
`untrained`, `prompt_order_breaks` and `schedule_breaks` are those checks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from harness.runs import MODES, partial_config, stored_rows, write_config
from rl_engine.buffer import ContinuationStore
from rl_engine.buffer.sweep import uncommitted_files
from rl_engine.proc.failpoints import ENV as FAILPOINT_ENV
from rl_engine.rewards import TaskIterator, load_taskset
from rl_engine.run.context import open_run
from rl_engine.run.state import STATE_DIR, latest_state_step
from rl_engine.schedule import rendezvous_version
from rl_engine.storage import open_storage
from rl_engine.sync.delta import FAILPOINT as DELTA_FAILPOINT
from rl_engine.trainer.checkpoint import COMMIT_MARKER

RFT = str(Path(sys.executable).with_name("rft"))  # the venv's, next to its python
POINTS = ("rollout", "checkpoint", "continuation", "sync")  # where a trial kills the run
EARLY = "before_checkpoint"  # a trainer step done, no trainer state saved yet: the resumed trainer starts at version 0
REWARD_POINT = "reward"  # while the reward model's service holds the explorer's request (feature reward_model)
REWARD_DELAY_S = 1.0  # the service holds every batch this long: most of an explorer step is its scoring
SCOPES = ("group", "main")  # the whole process group, or only the `rft run` process
TOTAL_STEPS = 6
# Bounds that add up to less than test_kill_resume's own timeout (900 s), so a slow trial fails here and
# kills its run, rather than leaving it running when pytest-timeout ends the session.
START_TIMEOUT_S = 240.0  # engines and the ephemeral server start on a loaded 2-core machine
POINT_TIMEOUT_S = 120.0  # from then to the kill point
GONE_TIMEOUT_S = 30.0
RESUME_TIMEOUT_S = 450.0
POLL_S = 0.002  # short: a continuation save is a file write and a manifest write apart


def run_env(root: Path, prefect_home: Path | None = None) -> dict[str, str]:
    """The environment of a user's shell: no test Prefect server; `prefect_home`, which trials in
    turn share as a user's runs share ~/.prefect (its database migrated once: ~5 s of each trial's
    first start on 2 cores), else a Prefect home of the trial's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    # A fresh Prefect home migrates its database first: more than the default 20 s on a busy machine.
    return {
        **env,
        "PREFECT_HOME": str(prefect_home or root / "prefect-home"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }


# A trial's multi-turn workflow instead of partial rollouts (they exclude each other): a game whose
# every missed guess gets the environment's feedback, so episodes span several engine calls.
WORKFLOW = {"type": "guess_number", "max_turns": 2}


# Features a trial may turn on together (`kill_trial(features=...)`), as a user's run would:
# delta checkpoint sync (a full checkpoint every 3 versions), bf16 weights, evaluation every 2
# versions, a TensorBoard tracker, the multi-turn workflow instead of partial rollouts, LoRA adapters
# (synced as adapters into engines serving the base model), a reward model (a tiny sequence
# classifier in its reward service, which holds every batch REWARD_DELAY_S).
FEATURES = ("delta", "bf16", "eval", "trackers", "workflow", "lora", "reward_model")
LORA = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
DELTA_POINT = "delta_marker"  # killed by the failpoint between the file and the marker of version 2's delta


def trial_config(
    model: str,
    tasks: str,
    root: Path,
    mode: str,
    name: str,
    workflow: bool = False,
    checkpoint_interval: int = 2,
    features: frozenset[str] = frozenset(),
) -> str:
    sync = dict(MODES[mode])
    if "delta" in features:
        sync["sync_method"] = "checkpoint"
    data = partial_config(
        model, tasks, str(root), name=name, total_steps=TOTAL_STEPS, checkpoint_interval=checkpoint_interval, **sync
    )
    if "delta" in features:
        data["synchronizer"]["delta"] = {"enabled": True, "full_every": 3}
    if "bf16" in features:
        data["model"]["dtype"] = "bfloat16"
    if "eval" in features:
        data["eval"] = {"tasksets": [{"name": "heldout", "path": tasks, "n": 2, "max_tasks": 4}], "every_versions": 2}
    if "trackers" in features:
        data["monitor"]["trackers"] = ["tensorboard"]
    if "lora" in features:
        data["model"]["lora"] = dict(LORA)
    if "reward_model" in features:
        from rl_engine.tiny_model import make_tiny_classifier

        rm = root / "reward-model"
        if not (rm / "config.json").exists():
            make_tiny_classifier(rm, num_labels=1)
        data["taskset"]["reward"] = {"type": "model", "path": str(rm), "timeout_s": 60}
    if workflow or "workflow" in features:
        del data["explorer"]["partial"]
        data["taskset"]["workflow"] = dict(WORKFLOW)
        data["explorer"]["sampling"]["max_tokens"] = 3
    data["synchronizer"]["collective"].pop("port")  # a free one per start: the killed run's may linger in TIME_WAIT
    data["monitor"]["artifacts"] = False
    return write_config(root / f"{name}.yaml", data)


def _wait(what: str, cond, proc: subprocess.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"rft run ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(POLL_S)


def _trainer_version(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "control" / "trainer.json").read_text())["version"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def _state_steps(run_dir: Path) -> set[int]:
    return {int(p.parent.name.split("=")[1]) for p in (run_dir / STATE_DIR).glob(f"step=*/{COMMIT_MARKER}")}


def _store_files(run_dir: Path) -> set[str]:
    d = run_dir / "continuations" / "explorer=0"
    return set(os.listdir(d)) if d.exists() else set()


def _sync_marks(run_dir: Path) -> tuple[int, frozenset[str]]:
    """What a weight sync changes first: collective, explorer 0's join of a broadcast (posted
    before the trainer's go); checkpoint, a new checkpoints/version=v folder (before its commit)."""
    joining, checkpoints = run_dir / "control" / "explorer-0-joining.json", run_dir / "checkpoints"
    mtime = joining.stat().st_mtime_ns if joining.exists() else 0
    return mtime, frozenset(os.listdir(checkpoints) if checkpoints.exists() else ())


def wait_for_point(point: str, run_dir: Path, proc: subprocess.Popen, log: Path, rng: random.Random) -> None:
    """Return at the kill point: EARLY as soon as the trainer reached version 1 (its first state
    comes at the last step: `kill_trial`), the others once the trainer reached version 2 and saved
    a checkpoint."""
    if point == EARLY:
        _wait("trainer version 1", lambda: _trainer_version(run_dir) >= 1, proc, log)
        if _state_steps(run_dir):
            raise AssertionError(f"a trainer state was saved before the {EARLY} kill point: {_state_steps(run_dir)}")
        return
    _wait(
        "trainer version 2 and a checkpoint",
        lambda: _trainer_version(run_dir) >= 2 and _state_steps(run_dir),
        proc,
        log,
    )
    if point == "rollout":  # somewhere in the next step or two (a step takes ~0.5 s): rollouts, writes, syncs
        time.sleep(rng.uniform(0.0, 0.5))
    elif point == REWARD_POINT:  # after the next sync the explorer generates (~0.2 s), then waits on the service
        version = _trainer_version(run_dir)
        _wait("the next trainer version", lambda: _trainer_version(run_dir) > version, proc, log, POINT_TIMEOUT_S)
        time.sleep(rng.uniform(0.3, 0.9))
        if not any("reward_model_server" in " ".join(_cmdline(p)) for p in process_tree(proc.pid)):
            raise AssertionError(f"no reward service in the run's processes at the {REWARD_POINT} kill point")
    elif point == "checkpoint":  # the moment a new trainer state is committed
        seen = _state_steps(run_dir)
        _wait("a new checkpoint", lambda: _state_steps(run_dir) - seen, proc, log, POINT_TIMEOUT_S)
    elif point == "continuation":  # a new continuation file, written before the manifest names it (or just after)
        seen = _store_files(run_dir)
        _wait(
            "a continuation save",
            lambda: {f for f in _store_files(run_dir) - seen if f.startswith("part-")},
            proc,
            log,
            POINT_TIMEOUT_S,
        )
    else:  # a weight sync that has begun
        marks = _sync_marks(run_dir)
        _wait("a weight sync", lambda: _sync_marks(run_dir) != marks, proc, log, POINT_TIMEOUT_S)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def process_tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def describe(procs: list[psutil.Process]) -> list[str]:
    """`pid name` of each, read while they live (a process gone already is named by its pid)."""
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()}")
        except (psutil.NoSuchProcess, FileNotFoundError):
            out.append(f"{p.pid} (gone)")
    return out


def survivors(procs: list[psutil.Process], timeout_s: float = GONE_TIMEOUT_S) -> list[str]:
    """Processes of `procs` still running after `timeout_s` (a zombie runs nothing: gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def pending_groups(run_url: str, explorers: int) -> set[str]:
    out: set[str] = set()
    for i in range(explorers):
        store = ContinuationStore(*open_storage(run_url, {}), i)
        ids = [e.id for e in store.list() if e.kind == "pending"]
        if ids:
            out |= {str(g) for g in store.load(ids).column("group_id")}
    return out


def trainer_lineage(run_url: str) -> list[dict]:
    """The trainer steps of the model the run ended with: per step, the last record written
    (a step trained again after a resume replaces the one whose state the kill threw away)."""
    lines = [json.loads(line) for line in Path(run_url, "report", "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in lines if "explorer_steps" in m}
    return [by_step[t] for t in sorted(by_step)]


def kill_trial(
    model: str,
    tasks: str,
    root: Path,
    mode: str,
    scope: str,
    point: str,
    rng: random.Random,
    workflow: bool = False,
    features: frozenset[str] = frozenset(),
    prefect_home: Path | None = None,
) -> dict[str, Any]:
    """One trial: start, kill at `point`, check what survives, resume to the end. Returns what
    the test asserts on (bench.faults counts the same). `workflow`: multi-turn episodes
    (`WORKFLOW`) instead of partial rollouts; `features`: others of FEATURES on too; `prefect_home`:
    `run_env`'s. At
    DELTA_POINT the run kills itself (a failpoint, the main process: `scope` main) between the
    file and the marker of version 2's delta (the chain: 1 full, 2 and 3 deltas, 4 full, ...)."""
    tag = "".join(f"-{f}" for f in sorted(features))
    name = f"kill-{mode.replace('_', '-')}-{scope}{'-workflow' if workflow else ''}{tag}"
    run_dir, log = root / name, root / f"{name}.log"
    # EARLY kills between the trainer's first step and its first state: with a state every 2 steps
    # that window was one step (~40 ms), which a poller on a busy machine (two test workers) can
    # miss; with none before the last step it spans the run.
    interval = TOTAL_STEPS if point == EARLY else 2
    config = trial_config(model, tasks, root, mode, name, workflow, checkpoint_interval=interval, features=features)
    env = run_env(root, prefect_home)
    if "reward_model" in features:
        from rl_engine.rewards.reward_model_server import DELAY_ENV

        env[DELAY_ENV] = str(REWARD_DELAY_S)
    if point == DELTA_POINT:
        env[FAILPOINT_ENV] = f"{DELTA_FAILPOINT}@2"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [RFT, "run", config],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        if point == DELTA_POINT:  # the run's own process kills itself; its engine processes are left to die
            _wait("trainer version 1", lambda: _trainer_version(run_dir) >= 1, proc, log)
            tree = process_tree(proc.pid)
            names = describe(tree)
            proc.wait(START_TIMEOUT_S)
        else:
            wait_for_point(point, run_dir, proc, log, rng)
            tree = process_tree(proc.pid)
            names = describe(tree)
            os.killpg(proc.pid, signal.SIGKILL) if scope == "group" else proc.kill()
            proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    killed_at = time.monotonic() - started
    left = survivors(tree)
    for p in tree:  # never leave a survivor to the next trial
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass

    run = open_run(str(run_dir))
    explorers = run.cfg.explorer.count
    before = {r["experience_id"] for r in stored_rows(run.url)}
    held = pending_groups(run.url, explorers)
    saved = latest_state_step(run) or 0
    env.pop(FAILPOINT_ENV, None)  # the resume runs through
    res = subprocess.run(
        [RFT, "run", config, "--resume", str(run_dir)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=RESUME_TIMEOUT_S,
        start_new_session=True,
    )
    rows = stored_rows(run.url)
    ids = Counter(r["experience_id"] for r in rows)
    still = pending_groups(run.url, explorers)
    return {
        "mode": mode,
        "scope": scope,
        "point": point,
        "run": run,
        "tree": names,
        "survivors": left,
        "killed_after_s": killed_at,
        "total_s": time.monotonic() - started,
        "resume_rc": res.returncode,
        "resume_out": res.stdout + res.stderr,
        "before": before,
        "held": held,
        "saved": saved,
        "rows": rows,
        "duplicated": [i for i, n in ids.items() if n > 1],
        "lost": sorted(before - set(ids)),
        "still_pending": still,
        "continuations_lost": held - {r["group_id"] for r in rows} - still,
        "lineage": trainer_lineage(run.url) if res.returncode == 0 else [],
        "uncommitted": uncommitted_files(*run.fs()),
        "killed_rc": proc.returncode,
        "features": features,
    }


def trained_twice(trial: dict[str, Any]) -> list[int]:
    """Explorer steps the final model was trained on more than once. Several explorers' steps are
    not told apart in the metrics: then a step counts twice when it was trained more often than
    there are explorers."""
    counts = Counter(s for m in trial["lineage"] for s in m["explorer_steps"])
    return [s for s, n in counts.items() if n > trial["run"].cfg.explorer.count]


def untrained(trial: dict[str, Any]) -> list[str]:
    """Committed batches the final model neither trained nor dropped as stale (its reader counts
    those: partial rollouts can make a group staler than its explorer's version), and reads the
    trainer consumed other than its steps' batches."""
    cfg, lineage = trial["run"].cfg, trial["lineage"]
    if not lineage:
        return ["no trainer step"]
    counters, bad = lineage[-1]["buffer"], []
    if counters["consumed"] != len(lineage) * cfg.trainer.train_batch_size:
        bad.append(f"the reader consumed {counters['consumed']} experiences for {len(lineage)} steps")
    if cfg.explorer.count == 1:  # one explorer step per trainer step: skipped steps are the dropped ones
        trained = {s for m in lineage for s in m["explorer_steps"]}
        skipped = set(range(1, max(trained) + 1)) - trained
        if len(skipped) * cfg.explorer.batch_size * cfg.algorithm.repeat_times != counters["dropped_stale"]:
            bad.append(
                f"explorer steps {sorted(skipped)} not trained, {counters['dropped_stale']} experiences dropped as stale"
            )
    return bad


def prompt_order_breaks(trial: dict[str, Any]) -> list[str]:
    """Groups whose task is not the one the explorer's seeded stream gives their draw number, and
    draw numbers used twice: a resumed explorer that replays its first prompts shows up here."""
    cfg = trial["run"].cfg
    tasks = load_taskset(cfg.taskset)
    groups = {r["group_id"] for r in trial["rows"]} | trial["still_pending"]
    bad, seen = [], Counter()
    for i in range(cfg.explorer.count):
        mine = sorted(
            (int(g.split("-")[1].removeprefix("d")), g.split("-", 2)[2]) for g in groups if g.startswith(f"{i}-")
        )
        stream = TaskIterator(tasks, cfg.explorer.batch_size, seed=cfg.seed + 1000 * i, shuffle=cfg.taskset.shuffle)
        expected = [stream.next_task().task_id for _ in range(max((d for d, _ in mine), default=0))]
        for d, task in mine:
            seen[(i, d)] += 1
            if expected[d - 1] != task:
                bad.append(f"explorer {i} draw {d}: task {task}, its stream gives {expected[d - 1]}")
    return bad + [f"explorer {i} draw {d} used {n} times" for (i, d), n in seen.items() if n > 1]


def schedule_breaks(trial: dict[str, Any]) -> list[str]:
    """Segments of the experiences written after the kill by a version the mode does not allow:
    rendezvous, the schedule's version of their explorer step; decoupled, admission control's
    floor (explorer step e is trained as batch b >= e, which the explorer may start only holding
    version b - 1 - max_staleness or newer)."""
    s = trial["run"].cfg.synchronizer
    bad = []
    for r in trial["rows"]:
        if r["experience_id"] in trial["before"]:
            continue
        for seg in r["segments"]:
            e, v = seg["explorer_step"], seg["version"]
            if s.mode in ("synchronous", "one_step_off_policy") and v != rendezvous_version(
                e, s.sync_interval, s.sync_offset
            ):
                bad.append(
                    f"{r['group_id']} step {e}: v{v}, schedule v{rendezvous_version(e, s.sync_interval, s.sync_offset)}"
                )
            elif s.mode in ("fully_async", "multi_explorer") and v < e - 1 - s.max_staleness:
                bad.append(f"{r['group_id']} step {e}: v{v}, older than v{e - 1 - s.max_staleness}")
    return bad
