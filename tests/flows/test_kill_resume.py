"""Kill a run anywhere, resume it exactly once (issue 13 item 2), as a user meets it.

`rft run CONFIG` (the real CLI, its own process group, its own ephemeral Prefect server) with
partial rollouts on (one case: a multi-turn workflow instead), SIGKILLed at a seeded random point (mid-rollout, right after a trainer
checkpoint, mid-continuation-save, mid-weight-sync), either the whole process group or only the main process;
then no process of the killed run may survive (vLLM engine cores and workers, the resource
tracker, the ephemeral Prefect server: the tree is collected just before the kill), and
`rft run CONFIG --resume RUN` must finish the run with every committed experience trained once,
no experience stored twice, every group whole, every continuation pending at the kill written
once or still pending, each explorer's prompt order continued, and the mode's schedule (its
staleness bound) held by every segment generated after the resume.

    .venv/bin/python -m pytest tests/flows/test_kill_resume.py      # 4 runs killed and resumed, minutes
    .venv/bin/python -m bench.faults                                # the same trials as a report

The trial and its checks are harness/kill_resume.py's (bench.faults runs them too).

RFT_KILL_SEED picks other kill points and delays (default 13).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from harness.kill_resume import (
    DELTA_POINT,
    EARLY,
    GONE_TIMEOUT_S,
    POINTS,
    REWARD_POINT,
    TOTAL_STEPS,
    kill_trial,
    prompt_order_breaks,
    schedule_breaks,
    trained_twice,
    untrained,
)

pytestmark = pytest.mark.slow

# CI's reduced matrix: every mode killed once, both scopes, both sync methods (fully async syncs by
# checkpoint, the others collectively), features on together as users turn them on: synchronous
# with LoRA (adapter sync by broadcast) and a reward model, killed while its service holds the
# explorer's request; one-step
# off-policy with a multi-turn workflow, evaluation and a tracker; fully async with delta sync in
# bf16, evaluation and a tracker, killed between a delta's file and its marker. The soak matrix
# below (`make test-soak`) kills every feature at every point; bench.faults runs the modes' full
# one (5 kills per mode, and 10 multi-explorer kills, half of them before the first trainer state).
CASES = [
    ("synchronous", "group"),
    ("one_step_off_policy", "main"),
    ("fully_async", "main"),
    ("multi_explorer", "group"),
]
WORKFLOW_CASES = {("one_step_off_policy", "main")}
FEATURES = {
    ("synchronous", "group"): frozenset({"lora", "reward_model"}),
    ("one_step_off_policy", "main"): frozenset({"eval", "trackers"}),
    ("fully_async", "main"): frozenset({"delta", "bf16", "eval", "trackers"}),
}
FIXED_POINTS = {("fully_async", "main"): DELTA_POINT, ("synchronous", "group"): REWARD_POINT}


def kill_points(seed: int) -> dict[tuple[str, str], str]:
    """A kill point per case: multi-explorer before its first trainer state (its resumed trainer
    starts at version 0, which once left the run stuck: issue 27), synchronous while its reward
    service holds the explorer's request, fully async between a delta's file and its marker
    (FIXED_POINTS), one-step off-policy at a seeded random point."""
    rest = [c for c in CASES if c[0] != "multi_explorer"]
    points = dict(zip(rest, random.Random(seed).sample(POINTS, k=len(rest))))
    for case in WORKFLOW_CASES:  # no continuations without partial rollouts: kill mid-rollout instead
        points[case] = "rollout" if points[case] == "continuation" else points[case]
    return {**points, ("multi_explorer", "group"): EARLY, **FIXED_POINTS}


SEED = int(os.environ.get("RFT_KILL_SEED", "13"))


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory):
    """One Prefect home for the module's trials, which run in turn (harness.kill_resume.run_env)."""
    return tmp_path_factory.mktemp("prefect-home")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,scope", CASES)
def test_kill_anywhere_then_resume_exactly_once(mode, scope, tiny_model_dir, task_file, tmp_path, prefect_home):
    point = kill_points(SEED)[(mode, scope)]
    trial = kill_trial(
        tiny_model_dir,
        task_file,
        tmp_path,
        mode,
        scope,
        point,
        random.Random(f"{SEED}-{mode}-{scope}"),
        workflow=(mode, scope) in WORKFLOW_CASES,
        features=FEATURES.get((mode, scope), frozenset()),
        prefect_home=prefect_home,
    )
    check_trial(trial, (mode, scope) in WORKFLOW_CASES)


# The soak matrix (`make test-soak`): delta checkpoint sync killed at every point (between a delta's
# file and its marker, mid-sync, at a checkpoint, before the first trainer state) in both modes that
# sync by checkpoint, fp32 and bf16; and evaluation with a tracker, and a workflow with evaluation,
# killed at a seeded random point in every mode.
SOAK = (
    [
        (mode, "group", point, frozenset({"delta", *dtype}))
        for mode in ("fully_async", "one_step_off_policy")
        for dtype in ((), ("bf16",))
        for point in (DELTA_POINT, "sync", "checkpoint", EARLY)
    ]
    + [
        (mode, scope, random.Random(f"{SEED}-{mode}-{extra}").choice(POINTS[:2] + POINTS[3:]), frozenset(extra))
        for mode in ("synchronous", "one_step_off_policy", "fully_async", "multi_explorer")
        for scope, extra in (("group", ("eval", "trackers")), ("main", ("workflow", "eval")))
    ]
    + [  # LoRA adapters synced by checkpoint (full and delta) and by broadcast, killed mid-sync and at a checkpoint
        (mode, "group", point, frozenset({"lora", *extra}))
        for mode, extra in (("fully_async", ("delta",)), ("multi_explorer", ()))
        for point in ("sync", "checkpoint")
    ]
)


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "mode,scope,point,features", SOAK, ids=lambda x: "+".join(sorted(x)) if isinstance(x, frozenset) else str(x)
)
def test_soak_kill_features_then_resume_exactly_once(
    mode, scope, point, features, tiny_model_dir, task_file, tmp_path, prefect_home
):
    workflow = "workflow" in features
    rng = random.Random(f"{SEED}-{mode}-{scope}-{point}")
    trial = kill_trial(
        tiny_model_dir,
        task_file,
        tmp_path,
        mode,
        scope,
        point,
        rng,
        workflow=workflow,
        features=features - {"workflow"},
        prefect_home=prefect_home,
    )
    check_trial(trial, workflow)


def check_trial(trial: dict, workflow: bool) -> None:
    """What every killed and resumed run must show (the features' own checks included)."""
    print(
        f"\n{trial['mode']} killed ({trial['scope']}) at {trial['point']} after {trial['killed_after_s']:.0f} s (trial {trial['total_s']:.0f} s): checkpoint {trial['saved']}, "
        f"{len(trial['before'])} experiences stored, {len(trial['held'])} groups pending; tree {trial['tree']}"
    )
    # Nothing of the killed run survives: engine cores and workers, resource tracker, Prefect server.
    assert len(trial["tree"]) >= 3, f"expected the engine's processes in the run's tree: {trial['tree']}"
    assert not trial["survivors"], (
        f"processes of the killed run ({trial['scope']} killed) still running after {GONE_TIMEOUT_S:.0f} s: {trial['survivors']}"
    )
    # The resumed run finished; nothing committed before the kill lost, nothing stored twice.
    assert trial["resume_rc"] == 0 and f"-> version {TOTAL_STEPS}" in trial["resume_out"], trial["resume_out"][-4000:]
    assert not trial["lost"] and not trial["duplicated"], (trial["lost"], trial["duplicated"])
    assert not trial["uncommitted"]  # a data file the kill left without its record is gone too
    rows = trial["rows"]
    assert set(Counter(r["group_id"] for r in rows).values()) == {2}  # every group whole, once
    if workflow:  # episodes with the environment's tokens masked
        assert any(0 in r["loss_mask"] for r in rows)
    # Every continuation pending at the kill was written once, or is still pending.
    written = {r["group_id"] for r in rows}
    assert not trial["continuations_lost"], trial["continuations_lost"]
    assert not (written & trial["still_pending"]), written & trial["still_pending"]
    # The final model trained steps 1..T, each on committed experiences no other step trained.
    assert [m["step"] for m in trial["lineage"]] == list(range(1, TOTAL_STEPS + 1))
    assert not trained_twice(trial), trained_twice(trial)
    assert not untrained(trial), untrained(trial)
    # Steps up to the checkpoint are the killed run's, the rest the resumed run's.
    assert [m["resumed_from"] == trial["saved"] for m in trial["lineage"]] == [
        t > trial["saved"] for t in range(1, TOTAL_STEPS + 1)
    ]
    # The prompt order continued, and the mode's schedule held after the resume.
    assert not prompt_order_breaks(trial), prompt_order_breaks(trial)
    assert not schedule_breaks(trial), schedule_breaks(trial)
    check_features(trial)


def check_features(trial: dict) -> None:
    """Evaluation: every due version evaluated once, the restart version included; a tracker: the
    resumed run went on logging into the same TensorBoard run, every trainer step in it."""
    from harness.trackers import tensorboard_scalars
    from rl_engine.roles.evaluation import due_versions
    from rl_engine.run.report import load_evaluations

    run, features = trial["run"], trial["features"]
    if "eval" in features:
        want = sorted(set(due_versions(run.cfg.eval, TOTAL_STEPS)) | ({trial["saved"]} if trial["saved"] else set()))
        assert [r["version"] for r in load_evaluations(run)] == want, trial["resume_out"][-3000:]
    if "trackers" in features:
        steps = {
            s
            for tag, points in tensorboard_scalars(f"{run.url}/trackers/tensorboard").items()
            if tag.startswith("trainer/")
            for s, _, _ in points
        }
        assert set(range(1, TOTAL_STEPS + 1)) <= steps, sorted(steps)
