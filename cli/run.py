"""Entry points behind `rft run` and `rft demo`: pick the flow of the configured mode and run it.

The flow runs on Prefect's ephemeral server unless PREFECT_API_URL points at a server; its
parameter is the config model itself, so deployments get it as a form in the Prefect UI.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from rl_engine.config import RFTConfig, load_config, validate_config
from rl_engine.errors import UserError, hide_user_error_tracebacks
from rl_engine.model_dir import is_model_dir
from rl_engine.proc.starts import count_start

REPO = Path(__file__).resolve().parents[1]


def flow_for(mode: str) -> Callable[..., Any]:
    """The Prefect flow of a sync mode (explicit mapping, no registry)."""
    from flows.decoupled import fully_async, multi_explorer
    from flows.rendezvous import one_step_off_policy, synchronous

    return {
        "synchronous": synchronous,
        "one_step_off_policy": one_step_off_policy,
        "fully_async": fully_async,
        "multi_explorer": multi_explorer,
    }[mode]


def run_config(cfg: RFTConfig, resume: str | None = None) -> Any:
    """Run the flow of `cfg.synchronizer.mode`; returns the run summary (or the final state if cancelled)."""
    return flow_for(cfg.synchronizer.mode)(cfg=cfg, resume=resume)


def run_watched(cfg: RFTConfig, resume: str | None = None, term: TextIO | None = None) -> Any:
    """`run_config` as the terminal shows it (cli/progress.py): a progress line followed from the
    run's storage, the engines' and libraries' output in `<run>/logs/engines.log` (`run_output`);
    an error still reaches the terminal, with where the log is. `term`: the terminal of a caller
    that routed the output already (`run_output` around more than the run)."""
    import logging

    from cli.progress import SERVICE_REWARDS, follow

    cfg = named(cfg, resume)
    if term is None:
        with run_output(cfg, resume) as terminal:
            return run_watched(cfg, resume, terminal)
    url, opts = run_url(cfg, resume)
    service = cfg.taskset.reward.type in SERVICE_REWARDS
    with follow(url, opts, cfg.trainer.total_steps, cfg.monitor.log_every, term, reward_service=service):
        try:
            return run_config(cfg, resume)
        finally:
            # Their shutdown chatter stays off the terminal: Prefect's, and vLLM's from an engine's
            # bounded close (rollout/engine.py) still finishing in its helper thread.
            logging.getLogger("prefect").setLevel(logging.WARNING)
            logging.getLogger("vllm").setLevel(logging.ERROR)


def named(cfg: RFTConfig, resume: str | None = None) -> RFTConfig:
    """A new run's config with its name drawn now (as the flow would draw it), so the terminal
    knows where the run's files appear before the run starts; a named or resumed run's as it is."""
    if resume is None and cfg.name is None:
        return validate_config({**cfg.model_dump(mode="json"), "name": cfg.resolved().name}, "the run's name")
    return cfg


def run_url(cfg: RFTConfig, resume: str | None = None) -> tuple[str, dict[str, Any]]:
    """(the run's URL, its storage options) of a `named` config, or of the run `resume` names."""
    return (resume.rstrip("/") if resume else cfg.run_url), cfg.buffer.storage.fs_options()


@contextmanager
def run_output(cfg: RFTConfig, resume: str | None = None) -> Iterator[TextIO]:
    """While the block runs, this process's stdout and stderr and every child's (engines,
    libraries) go to the run's `<run>/logs/engines.log` (rl_engine/proc/logfile.py), said first on
    the terminal; yields the terminal. An error leaving the block says where the log is."""
    from rl_engine.proc.logfile import output_logged
    from rl_engine.run.logs import run_log

    url, opts = run_url(named(cfg, resume), resume)
    with (
        run_log(url, opts) as log,
        output_logged(
            log, f"run {url}: engine and library logs in {log}", f"the run's engine and library logs: {log}"
        ) as term,
    ):
        yield term


def run_from_cli(config: str, overrides: list[str], resume: str | None = None) -> int:
    """`rft run`: check the inputs (rl_engine.run.preflight) before any engine starts, then run the flow.
    The ephemeral Prefect server (if the run uses one) comes up beside preflight's model checks.
    A UserError raised later, inside the flow, reaches the user as its message, without the
    traceback Prefect would log for it."""
    from cli.config_warnings import migration_warnings, print_warnings
    from rl_engine.config import config_warnings, migrate, read_yaml
    from rl_engine.config.base import redact_overrides

    source = config + (f" with --set {' '.join(redact_overrides(overrides))}" if overrides else "")
    cfg = load_config(config, overrides)
    check_prefect_api()
    cfg = checked(cfg, resume, source)
    print_warnings(config_warnings(cfg) + migration_warnings(config, migrate(read_yaml(config))[1]))
    hide_user_error_tracebacks("prefect.flow_runs", "prefect.task_runs")
    summary = run_watched(cfg, resume)
    if not isinstance(summary, dict):
        print(f"run ended: {summary}")
        return 1
    print_summary(summary)
    return 0


def checked(cfg: RFTConfig, resume: str | None = None, source: str = "the config") -> RFTConfig:
    """rl_engine.run.preflight's checks as `rft run` makes them: its model checks (seconds of
    imports) beside the start of the run's ephemeral Prefect server. Returns the run's config."""
    from rl_engine.run.preflight import check_inputs, check_model

    inputs = check_inputs(cfg, resume, source)
    with prefect_server_ahead():
        check_model(inputs, resume)
    return inputs.cfg


@contextmanager
def prefect_server_ahead() -> Iterator[None]:
    """The run's ephemeral Prefect server starts in a thread while the block runs.

    Its process comes up (3.5 s on 2 cores) beside the block's work (preflight's model checks:
    seconds of imports that the run needs anyway) instead of after it. The block's end waits for
    the start: the flow never meets a server that does not answer yet. A start that fails is left
    to Prefect, which tries again when the flow begins and reports it there. Nothing with
    PREFECT_API_URL set (check_prefect_api: that server answers already)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        yield
        return

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        count_start("prefect_server")
        try:
            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - reported by Prefect's own start when the flow begins
            pass

    thread = threading.Thread(target=start, name="rft-prefect-server-start")
    thread.start()
    try:
        yield
    finally:
        thread.join()


def check_prefect_api(timeout_s: float = 10.0) -> None:
    """With PREFECT_API_URL set (environment or Prefect profile), a Prefect server answers there: checked
    before anything of the run is created (its log file included), since Prefect's own client retries
    for seconds and then fails with tracebacks. Unset: the run starts an ephemeral server of its own."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        return
    with get_client(sync_client=True, httpx_settings={"timeout": timeout_s}) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        raise UserError(
            f"PREFECT_API_URL = {url!r}: cannot reach a Prefect server there ({type(failure).__name__}: {str(failure)[:300]}); nothing of the run was created. "
            "Start the server (`prefect server start`) or fix PREFECT_API_URL, or unset it to run on an ephemeral server of the run's own"
        )


def print_summary(summary: dict[str, Any], out: TextIO | None = None) -> None:
    from rl_engine.run.report import summary_lines

    out = out or sys.stdout
    print(file=out)
    print("\n".join(summary_lines(summary)), file=out)
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "Prefect UI: this run used the ephemeral server; start `prefect server start`, export PREFECT_API_URL=http://127.0.0.1:4200/api and run again to follow it in the UI.",
            file=out,
        )
    out.flush()


def demo_inputs(root: str = "runs") -> tuple[Path, Path]:
    """The demo's model (the tiny model warm-started by SFT) and task set under `root`, each built
    if missing; a second call (the next `rft demo`, the test suite's shared copy) reuses them."""
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.demos.warmstart import main as warmstart

    model, tasks = Path(root, "models", "tiny-arith-sft"), Path(root, "data", "arith-train.jsonl")
    if not _demo_model_current(model):
        if model.exists():  # an earlier version's: its SFT drew the held-out problems too
            shutil.rmtree(model)
        print(f"building the demo model (tiny Qwen2 + SFT warm start) in {model} ...")
        warmstart([str(model)])
    if not _demo_tasks_current(tasks):
        write_arithmetic_taskset(str(tasks), n=2000, seed=1, split="train")
    return model, tasks


# An earlier version's demo model and tasks drew the held-out problems too: they are made again.
def _demo_model_current(model: Path) -> bool:
    made = model / "warmstart.json"
    return is_model_dir(model) and made.is_file() and json.loads(made.read_text()).get("sft_split") == "train"


def _demo_tasks_current(tasks: Path) -> bool:
    if not tasks.is_file():
        return False
    with tasks.open() as f:
        first = json.loads(f.readline() or "{}")
    return str(first.get("id", "")).startswith("add-train-")


def demo(root: str = "runs") -> int:
    """Build the demo's model and tasks if missing, then run configs/demo.yaml under `root`."""
    model, tasks = demo_inputs(root)
    cfg = load_config(
        str(REPO / "configs" / "demo.yaml"),
        [f"model.path={model}", f"taskset.path={tasks}", f"buffer.storage.url={root}"],
    )
    check_prefect_api()
    cfg = checked(cfg)
    hide_user_error_tracebacks("prefect.flow_runs", "prefect.task_runs")
    summary = run_watched(cfg)
    if not isinstance(summary, dict):
        print(f"run ended: {summary}")
        return 1
    print_summary(summary)
    from transformers.utils import logging as hf_logging

    from rl_engine.demos.arithmetic import arithmetic_pairs
    from rl_engine.demos.warmstart import evaluate_dir

    hf_logging.disable_progress_bar()  # its "Loading weights" bars would follow the summary
    before, after = evaluate_dir(str(model)), evaluate_dir(f"{summary['run']}/model")
    print(
        f"exact answers over the {len(arithmetic_pairs('heldout'))} held-out problems (never trained on): "
        f"{before['expected_exact_t1']:.1%} at temperature 1 ({before['greedy_exact']:.1%} greedy) before GRPO, "
        f"{after['expected_exact_t1']:.1%} ({after['greedy_exact']:.1%} greedy) after; trained model: {summary['run']}/model"
    )
    return 0
