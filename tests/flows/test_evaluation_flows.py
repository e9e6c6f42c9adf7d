"""Evaluation during training, as a real flow run: the versions the schedule names are evaluated with
exactly those weights, recorded, drawn in the timeline and the Prefect UI, and the best one kept.

Fully async with checkpoint sync: the explorer picks up whatever the trainer published last, so
exactness is what is at stake. Each record holds the engine's logprobs of a fixed sequence
(`probe`); recomputed here from the trainer's saved state of that version, they must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.run import run_config
from harness.runs import MODES, small_config
from rl_engine.config import validate_config
from rl_engine.run.context import open_run
from rl_engine.run.report import load_evaluations, read_best
from rl_engine.run.timeline import load_spans

pytestmark = pytest.mark.slow


def hf_probe_logprobs(model_dir: str, weights: str | None, ids: list[int]) -> torch.Tensor:
    """Logprobs of ids[1:] given the prefix, by the HF model with `weights` (a safetensors file) loaded."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if weights is not None:
        missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()  # [L-1, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [L-1]


def register_eval_deployment():
    """prefect.yaml's `rft-eval/default` on the test server (a process pool no worker serves: the
    flow run the completed run starts stays scheduled, which is what is checked)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.evaluation import evaluate_run

    with get_client(sync_client=True) as client:
        if not any(p.name == "rft-cpu" for p in client.read_work_pools()):
            client.create_work_pool(WorkPoolCreate(name="rft-cpu", type="process"))
    return evaluate_run.to_deployment(name="default", work_pool_name="rft-cpu").apply()


def state_weights(run_url: str, version: int) -> str:
    """The weights of the trainer state saved at `version` (trainer.checkpoint_interval divides it)."""
    (path,) = [
        p
        for p in Path(run_url, "trainer_state").glob("step=*/model.safetensors")
        if int(p.parent.name.split("=")[1]) == version
    ]
    return str(path)


def test_async_run_evaluates_exact_versions_and_keeps_the_best(prefect_server, tiny_model_dir, task_file, tmp_path):
    data = small_config(
        tiny_model_dir, task_file, str(tmp_path), total_steps=4, checkpoint_interval=2, **MODES["fully_async"]
    )
    data["eval"] = {
        "tasksets": [{"name": "heldout", "path": task_file, "n": 2, "max_tasks": 6}],
        "every_versions": 2,
        "keep_best": {"metric": "heldout/pass@1"},
    }
    data["eval"]["after_run"] = "rft-eval/default"
    data["lineage"] = {"name": "evals", "promote": "best"}
    deployment_id = register_eval_deployment()
    summary = run_config(validate_config(data))
    run = open_run(summary["run"])
    records = load_evaluations(run)

    assert [r["version"] for r in records] == [0, 2, 4]  # at start, every 2 versions, at the end
    for r in records:
        assert r["heldout/tasks"] == 6 and 0.0 <= r["heldout/pass@1"] <= r["heldout/pass@2"] <= 1.0
        assert r["heldout/avg@2"] == pytest.approx(r["heldout/pass@1"])  # one estimator, two names
        state = None if r["version"] == 0 else state_weights(run.url, r["version"])
        hf = hf_probe_logprobs(tiny_model_dir, state, r["probe"]["ids"])
        gap = (hf - torch.tensor(r["probe"]["logprobs"])).abs().max().item()
        assert gap < 1e-3, f"version {r['version']}: the engine evaluated other weights (logprob gap {gap})"

    evals = [(s.version, s.component) for s in load_spans(run.url) if s.kind == "eval"]
    assert evals == [(0, "explorer-0"), (2, "explorer-0"), (4, "explorer-0")]

    best = read_best(run)
    values = {r["version"]: r["heldout/pass@1"] for r in records}
    assert best["version"] == max(values, key=lambda v: (values[v], -v)) and best["value"] == values[best["version"]]
    kept = sorted(int(p.name.split("=")[1]) for p in Path(run.url, "eval").glob("version=*"))
    assert kept == ([best["version"]] if best["version"] else [])  # every other saved version deleted once evaluated
    if best["version"]:
        assert Path(best["model"], "config.json").exists()
    # `rft export --version best`: that version's model; a full run has no adapter to export.
    from rl_engine.errors import UserError
    from rl_engine.run.export import export

    assert export(run.url, str(tmp_path / "best"), version="best")["version"] == best["version"]
    assert Path(tmp_path, "best", "config.json").exists()
    with pytest.raises(UserError, match=r"model.lora is null\), so it has no adapter"):
        export(run.url, str(tmp_path / "adapter"), adapter=True)
    assert summary["best"] == best and [row["version"] for row in summary["evaluations"]] == [0, 2, 4]
    latest = json.loads(Path(tmp_path, "lineages", "evals", "latest.json").read_text())
    assert latest["model"] == best["model"]  # lineage.promote: best

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.evaluation import artifact_prefix

    key = f"{artifact_prefix(run.cfg.name)}-evaluations"
    with get_client(sync_client=True) as client:
        cards = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert len(cards) == 3  # one card per evaluated version: the held-out curve and the table, beside the timeline
    latest = max(cards, key=lambda a: a.created).data
    assert "data:image/png;base64," in latest and all(f"\n| {v} | heldout |" in latest for v in (0, 2, 4))

    # eval.after_run: the completed run started the evaluation deployment on itself.
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        started = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    assert [r.parameters["run_url"] for r in started] == [run.url]

    # `rft eval RUN`: every saved version, scored as during training (same weights, samples and seeds).
    # Its own process, as a user runs it: called in this process it left Prefect's console handler
    # on a closed stream, and the next flow runs here failed logging (RecursionError).
    import subprocess
    import sys

    out = Path(tmp_path, "curve.png")
    rft = Path(sys.executable).with_name("rft")
    done = subprocess.run([str(rft), "eval", run.url, "--png", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    redone = {r["version"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])["versions"]}
    assert {0, 4} | ({best["version"]} if best["version"] else set()) <= set(redone) and out.stat().st_size > 0
    for v, r in redone.items():
        if v in values:
            during = next(x for x in records if x["version"] == v)
            assert (r["heldout/pass@1"], r["heldout/response_len_mean"]) == (
                during["heldout/pass@1"],
                during["heldout/response_len_mean"],
            ), v

    # The rft-eval flow itself (what that deployment runs): the same scores, and its artifacts.
    from flows.evaluation import evaluate_run

    flowed = {r["version"]: r["heldout/pass@1"] for r in evaluate_run(run.url)}
    assert flowed == {v: r["heldout/pass@1"] for v, r in redone.items()}
    with get_client(sync_client=True) as client:
        saved = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[f"{artifact_prefix(run.cfg.name)}-saved-versions"])
            )
        )
    assert saved


@pytest.mark.parametrize("mode", ["fully_async", "one_step_off_policy"])
def test_a_resumed_run_evaluates_every_due_version_its_restart_included(
    mode, prefect_server, tiny_model_dir, task_file, tmp_path
):
    """Stopped at version 3 and resumed: every version the schedule made due is evaluated once,
    version 3 (where the run restarts, due by eval.at_start) included, each with the weights it
    names (issue 45: the restart version was never evaluated)."""
    from harness.cancel import run_and_cancel

    data = small_config(
        tiny_model_dir,
        task_file,
        str(tmp_path),
        name=f"eval-resume-{mode}",
        total_steps=8,
        checkpoint_interval=1,
        **MODES[mode],
    )
    data["eval"] = {"tasksets": [{"name": "heldout", "path": task_file, "n": 2, "max_tasks": 4}], "every_versions": 4}
    data["trainer"]["keep_last_states"] = None  # every version's state stays: the probe check reads each
    cfg = validate_config(data)
    result, cancelled = run_and_cancel(cfg, at_version=3, post_stop=True)
    assert cancelled and not isinstance(result, dict), result
    run = open_run(cfg.run_url)
    restart = max(int(p.parent.name.split("=")[1]) for p in Path(run.url, "trainer_state").glob("step=*/COMMITTED"))
    assert restart >= 3
    summary = run_config(run.cfg, resume=run.url)
    assert summary["final_version"] == 8
    records = load_evaluations(open_run(run.url))
    want = sorted({0, 4, 8, restart})
    assert [r["version"] for r in records] == want, (restart, [r["version"] for r in records])
    for r in records:
        state = None if r["version"] == 0 else state_weights(run.url, r["version"])
        hf = hf_probe_logprobs(tiny_model_dir, state, r["probe"]["ids"])
        assert (hf - torch.tensor(r["probe"]["logprobs"])).abs().max().item() < 1e-3, r["version"]
    assert not list(Path(run.url, "eval").glob("version=*"))  # every saved copy deleted once evaluated
