"""What the Prefect UI shows of a run's evaluations: one artifact card per evaluated version (the
held-out curve and the table of every version so far, under `rft-<run>-evaluations`), not a table
card and a curve card that repeat each other; the rft-eval flow run a completed run starts
(`eval.after_run`) carries the run's name from its creation (issue 44 item 6). No engine: the
run's evaluation records are written as explorer 0 writes them, then published as its evaluation
callback does.

    .venv/bin/python -m pytest tests/flows/test_evaluation_artifacts.py
"""

from __future__ import annotations

from prefect import flow

from harness.runs import small_config
from rl_engine.config import validate_config
from rl_engine.run.context import start_run
from rl_engine.run.report import EVAL_ROLE, METRICS_DIR
from rl_engine.storage import join, write_json
from tasks.evaluation import artifact_prefix, publish_evaluation, start_evaluation
from tests.flows.conftest import artifacts_of


def record(version: int, pass1: float) -> dict:
    """An evaluation record as explorer 0 writes it (rl_engine.roles.evaluation), one set."""
    return {
        "version": version,
        "seconds": 1.5,
        "heldout/tasks": 6.0,
        "heldout/avg@2": pass1,
        "heldout/pass@1": pass1,
        "heldout/pass@2": min(1.0, 2 * pass1),
        "heldout/reward_mean": pass1,
        "heldout/response_len_mean": 3.0,
        "heldout/finish/stop": 1.0,
    }


@flow(name="rft-test-evaluations")
def evaluations_published(run_url: str, versions: list[int]) -> str:
    """Each version evaluated in turn and published by its task run, as during training."""
    from prefect.context import get_run_context

    from rl_engine.run.context import open_run

    run = open_run(run_url)
    fs, root = run.fs()
    keys = artifact_prefix(run.cfg.name)
    for v in versions:
        write_json(fs, join(root, METRICS_DIR, f"role={EVAL_ROLE}", f"step={v}.json"), record(v, 0.25 + 0.1 * v))
        publish_evaluation(run.url, run.storage_options, v, keys)
    return str(get_run_context().flow_run.id)


def test_one_artifact_card_per_evaluated_version(prefect_server, tiny_model_dir, task_file, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    cfg = validate_config(small_config(tiny_model_dir, task_file, str(tmp_path), name="cards", total_steps=4))
    run = start_run(cfg)
    flow_run_id = evaluations_published(run.url, [0, 2, 4])
    key = f"{artifact_prefix('cards')}-evaluations"
    assert set(artifacts_of(flow_run_id)) == {key}  # one key: no separate curve card
    with get_client(sync_client=True) as client:
        cards = sorted(
            client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))),
            key=lambda a: a.created,
        )
    assert len(cards) == 3 and {a.type for a in cards} == {"markdown"}  # one card per evaluated version
    latest = cards[-1].data
    assert latest.startswith("![held-out curve of run cards](data:image/png;base64,")  # the curve ...
    rows = [line for line in latest.splitlines() if line.startswith("| ") and "version" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| 0", "| 2", "| 4"]  # ... and every version's row


@flow(name="rft-test-after-run")
def run_completed(deployment: str, run_url: str) -> str | None:
    return start_evaluation(deployment, run_url, None)


def test_the_evaluation_flow_run_is_named_after_the_run_from_its_creation(prefect_server, tmp_path):
    """`eval.after_run`'s flow run, read while it waits for a worker (none serves its pool here),
    is `<run>-eval`, not a name Prefect drew (which it kept until the run started)."""
    from prefect.client.orchestration import get_client

    from tests.flows.test_evaluation_flows import register_eval_deployment

    register_eval_deployment()
    flow_run_id = run_completed("rft-eval/default", f"{tmp_path}/nightly-3")
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    assert flow_run.state.is_scheduled() and flow_run.name == "nightly-3-eval", (flow_run.name, flow_run.state)
