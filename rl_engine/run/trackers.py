"""Experiment trackers: every recorded step's metrics and the run's resolved config, sent to
TensorBoard, MLflow and/or W&B (`monitor.trackers`).

The roles record their steps to storage (`rl_engine.run.report.record_step`); a `TrackerFeed` in
the mode flow's process follows every role's records (`trainer`, `explorer-<i>`, any role that
appears later) and logs them, under the role's name as prefix: the trainer's by trainer version,
an explorer's by its explorer step (the version it ran with is its `version` metric), another
role's by its `version` (else `step`); each with the time it was recorded. Nested metrics are
flattened (`buffer/consumed`), non-numbers dropped.

A resumed run continues the same tracker runs: each tracker stores its run's id under
`<run>/trackers/<name>.json` on first start and reuses it (MLflow's run id, W&B's run id;
TensorBoard writes a new event file into the same directory). Credentials come from the
trackers' own environment variables (MLFLOW_TRACKING_TOKEN, WANDB_API_KEY, ...) and are never
written anywhere. A tracker that fails (a server down) is warned about once, naming it and the
error, and is off for the rest of the run; the run goes on. Prefect-free.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from rl_engine.config import MLflowTracker as MLflowSettings
from rl_engine.config import TrackerConfig
from rl_engine.config import WandbTracker as WandbSettings
from rl_engine.config.base import redact
from rl_engine.run.context import RunContext
from rl_engine.run.report import TIME_KEY, StepFeed, metric_roles, step_of_path
from rl_engine.storage import is_local, join, read_json, write_json

log = logging.getLogger(__name__)

TRACKERS_DIR = "trackers"
Warn = Callable[..., Any]


class Tracker(Protocol):
    """One experiment tracker's run."""

    name: str

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float, prefix: str) -> None: ...

    def log_config(self, cfg: dict[str, Any]) -> None: ...

    def flush(self) -> None:
        """Make what was logged durable: a kill after it loses none of it."""
        ...

    def close(self) -> None: ...


def flatten_metrics(m: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{'buffer/consumed': 32.0, ...}: nested dicts joined with '/', numbers as floats, the rest
    (lists, strings, booleans, None) dropped."""
    out: dict[str, float] = {}
    for k, v in m.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_metrics(v, f"{key}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def step_of(role: str, m: dict[str, Any]) -> int | None:
    """The x-axis step of a role's record: an explorer's explorer step, the trainer's (or another
    role's) version, else its `step`."""
    keys = ("explorer_step", "step") if role.startswith("explorer-") else ("version", "step")
    for k in keys:
        if isinstance(m.get(k), int) and not isinstance(m.get(k), bool):
            return int(m[k])
    return None


def hide_credentials(text: str) -> str:
    """`text` with the user and password of every URL in it replaced (`http://<redacted>@host`)."""
    return re.sub(r"://[^/@\s]+@", "://<redacted>@", text)


# ---- the run's tracker ids (<run>/trackers/<name>.json)


def load_tracker_state(run: RunContext, name: str) -> dict[str, Any] | None:
    fs, root = run.fs()
    path = join(root, TRACKERS_DIR, f"{name}.json")
    return read_json(fs, path) if fs.exists(path) else None


def save_tracker_state(run: RunContext, name: str, state: dict[str, Any]) -> None:
    fs, root = run.fs()
    write_json(fs, join(root, TRACKERS_DIR, f"{name}.json"), state)


def _local_dir(run: RunContext, name: str) -> tuple[str, str | None]:
    """(local directory the tracker writes to, run path to copy it to at close, or None): the run's
    `trackers/<name>` itself on local storage, else a temporary directory."""
    fs, root = run.fs()
    target = join(root, TRACKERS_DIR, name)
    if is_local(fs):
        os.makedirs(target, exist_ok=True)
        return target, None
    return tempfile.mkdtemp(prefix=f"rft-{name}-"), target


def _upload(run: RunContext, local: str, target: str) -> None:
    """Copy the temporary directory `local` to the run's `target`, then remove it."""
    fs, _ = run.fs()
    for dirpath, _, files in os.walk(local):
        for f in files:
            src = os.path.join(dirpath, f)
            fs.put_file(src, join(target, os.path.relpath(src, local).replace(os.sep, "/")))
    shutil.rmtree(local, ignore_errors=True)


# ---- the three trackers


class TensorBoard:
    """Event files under `<run>/trackers/tensorboard/` (`tensorboard --logdir` it); for a remote run
    written to a temporary directory and copied there at close."""

    name = "tensorboard"

    def __init__(self, run: RunContext):
        from torch.utils.tensorboard import SummaryWriter

        self.run = run
        self.log_dir, self.upload_to = _local_dir(run, self.name)
        if load_tracker_state(run, self.name) is None:
            save_tracker_state(run, self.name, {"log_dir": join(run.url, TRACKERS_DIR, self.name)})
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=5)

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float, prefix: str) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"{prefix}/{k}", v, global_step=step, walltime=wall_time)

    def log_config(self, cfg: dict[str, Any]) -> None:
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(cfg, sort_keys=False) + "```")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self.upload_to is not None:
            _upload(self.run, self.log_dir, self.upload_to)


# Unless set, MLflow's client retries a refused connection for minutes; a dead server should cost seconds.
MLFLOW_CLIENT_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def mlflow_name(name: str) -> str:
    """`name` as MLflow takes a metric's name (alphanumerics, `_ - . : /` and spaces): `@` as `_at_`
    (the evaluation's `heldout/pass@1` is `heldout/pass_at_1`), any other character as `_`. MLflow
    refuses a batch holding one other name, which turned the tracker off for the run."""
    return re.sub(r"[^\w\-.: /]", "_", name.replace("@", "_at_"))


class MLflow:
    """An MLflow run in `experiment` at `tracking_uri` (else MLFLOW_TRACKING_URI), named after the run."""

    name = "mlflow"

    def __init__(self, run: RunContext, settings: MLflowSettings):
        from mlflow.tracking import MlflowClient

        for k, v in MLFLOW_CLIENT_DEFAULTS.items():
            os.environ.setdefault(k, v)
        self.client = MlflowClient(tracking_uri=settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        state = load_tracker_state(run, self.name)
        self.run_id = state["run_id"] if state else None
        if self.run_id is not None and self._exists(self.run_id):
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(settings.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(settings.experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run.cfg.name, tags={"rft.run": run.url}).info.run_id
            save_tracker_state(run, self.name, {"run_id": self.run_id, "experiment": settings.experiment})

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float, prefix: str) -> None:
        from mlflow.entities import Metric

        rows = [
            Metric(mlflow_name(f"{prefix}/{k}"), v, int(wall_time * 1000), step)
            for k, v in metrics.items()
            if math.isfinite(v)
        ]
        for i in range(0, len(rows), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def log_config(self, cfg: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _dotted(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def flush(self) -> None:
        pass  # every call was a request the server answered

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def _dotted(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Wandb:
    """A W&B run (offline: files only, `wandb sync` uploads them), its files under `dir` or
    `<run>/trackers/wandb/` (a remote run's copied there at close); each role's metrics plotted
    against `<role>/step` (W&B's own step only counts log calls)."""

    name = "wandb"

    def __init__(self, run: RunContext, settings: WandbSettings):
        import wandb

        self.run = run
        if settings.dir is not None:
            os.makedirs(settings.dir, exist_ok=True)
            self.dir, self.upload_to = settings.dir, None
        else:
            self.dir, self.upload_to = _local_dir(run, self.name)
        state = load_tracker_state(run, self.name)
        run_id = state["run_id"] if state else uuid.uuid4().hex[:12]
        quiet = wandb.Settings(console="off", save_code=False, disable_git=True, x_disable_stats=True, silent=True)
        self.wb = wandb.init(
            project=settings.project,
            entity=settings.entity,
            id=run_id,
            resume="allow",
            name=run.cfg.name,
            dir=self.dir,
            mode=settings.mode,
            settings=quiet,
            reinit="create_new",
        )
        if state is None:
            save_tracker_state(run, self.name, {"run_id": run_id, "project": settings.project})
        self._axes: set[str] = set()

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float, prefix: str) -> None:
        if prefix not in self._axes:
            self.wb.define_metric(f"{prefix}/step")
            self.wb.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
            self._axes.add(prefix)
        self.wb.log(
            {
                **{f"{prefix}/{k}": v for k, v in metrics.items()},
                f"{prefix}/step": step,
                f"{prefix}/wall_time": wall_time,
            }
        )

    def log_config(self, cfg: dict[str, Any]) -> None:
        self.wb.config.update(cfg, allow_val_change=True)

    def flush(self) -> None:
        pass  # W&B's service writes its own transaction log as it goes

    def close(self) -> None:
        import wandb

        self.wb.finish()
        # finish() may return before W&B's service has written the run's files (wandb 0.31,
        # offline); teardown waits for that (it ends this process's W&B service: the next run starts another).
        wandb.teardown()
        if self.upload_to is not None:
            _upload(self.run, self.dir, self.upload_to)


_TRACKERS: dict[str, Callable[[Any, RunContext], Tracker]] = {
    "tensorboard": lambda _, run: TensorBoard(run),
    "mlflow": lambda settings, run: MLflow(run, settings),
    "wandb": lambda settings, run: Wandb(run, settings),
}


def make_tracker(settings: TrackerConfig, run: RunContext) -> Tracker:
    """The tracker `settings` names, started (its run created or continued)."""
    return _TRACKERS[settings.type](settings, run)


class Guarded:
    """A tracker started on first use, whose first failure (at start too) is warned about once,
    naming it and the error, and turns it off for the rest of the run."""

    def __init__(self, name: str, start: Callable[[], Tracker], warn: Warn):
        self.name, self._start, self._warn = name, start, warn
        self.tracker: Tracker | None = None
        self.failed = False

    def _call(self, what: str, fn: Callable[[Tracker], Any]) -> None:
        if self.failed:
            return
        try:
            if self.tracker is None:
                self.tracker = self._start()
            fn(self.tracker)
        except Exception as e:  # noqa: BLE001 - a tracker never stops the run
            self.failed = True
            self._warn(
                "tracker %s failed (%s): %s: %s; it is off for the rest of the run",
                self.name,
                what,
                type(e).__name__,
                hide_credentials(str(e)),
            )
            if self.tracker is not None:
                try:
                    self.tracker.close()
                except Exception:  # noqa: BLE001 - already warned about this tracker
                    pass

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float, prefix: str) -> None:
        self._call(f"{prefix} step {step}", lambda t: t.log_metrics(metrics, step, wall_time, prefix))

    def log_config(self, cfg: dict[str, Any]) -> None:
        self._call("config", lambda t: t.log_config(cfg))

    def flush(self) -> None:
        if self.tracker is not None:
            self._call("flush", lambda t: t.flush())

    def close(self) -> None:
        if self.tracker is not None:
            self._call("close", lambda t: t.close())


def build_trackers(monitor: Any, run: RunContext, warn: Warn = log.warning) -> list[Guarded]:
    """The run's trackers (`monitor.trackers`), each guarded and started on first use."""
    return [Guarded(s.type, lambda s=s: make_tracker(s, run), warn) for s in monitor.trackers]


CURSOR_FILE = "feed.json"


def _read_cursor(run: RunContext) -> dict[str, int] | None:
    fs, root = run.fs()
    path = join(root, TRACKERS_DIR, CURSOR_FILE)
    try:
        return {str(k): int(v) for k, v in read_json(fs, path).items()} if fs.exists(path) else None
    except (ValueError, AttributeError, TypeError):
        return None  # unreadable: as before the cursor (what was there is not logged again)


class TrackerFeed:
    """Follows the steps every role records (new role directories included) and logs them to
    `trackers`; `start()` logs the run's config and polls every `poll_s` in a background thread,
    `stop()` ends it, logs what is left and closes the trackers (bounded by `stop_timeout_s`).
    After each poll that logged steps, the trackers are flushed and the last step of each role
    written to `<run>/trackers/feed.json`: a resumed run's feed logs every step after it (those a
    killed attempt recorded but never got to its trackers) and the steps the resumed run redoes,
    not those its earlier attempts logged."""

    def __init__(
        self,
        run: RunContext,
        trackers: list[Any],
        poll_s: float = 2.0,
        stop_timeout_s: float = 60.0,
        warn: Warn = log.warning,
    ):
        self.run, self.trackers, self.poll_s, self.stop_timeout_s, self.warn = (
            run,
            trackers,
            poll_s,
            stop_timeout_s,
            warn,
        )
        self.cursor = _read_cursor(run)  # None: a run from before the cursor, whose feed logged all it found
        self.feeds = {
            role: StepFeed(
                run, role, self._on_step, delivered_through=None if self.cursor is None else self.cursor.get(role, 0)
            )
            for role in metric_roles(run)
        }
        if self.cursor is None:
            # Written now, before any step: a run killed before the first poll resumes from it
            # (every step after it logged); an older run's steps already there count as logged.
            self.cursor = {
                role: max((step_of_path(p) for p in feed.seen()), default=0) for role, feed in self.feeds.items()
            }
            self._save_cursor()
        self._delivered = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_failed = False

    def _on_step(self, role: str, m: dict[str, Any]) -> None:
        step = step_of(role, m)
        if step is None:
            return
        wall = m.get(TIME_KEY)
        wall = float(wall) if isinstance(wall, (int, float)) else time.time()
        metrics = flatten_metrics({k: v for k, v in m.items() if k != TIME_KEY})
        for t in self.trackers:
            t.log_metrics(metrics, step, wall, role)
        self.cursor[role] = max(step, self.cursor.get(role, 0))
        self._delivered = True

    def poll(self) -> None:
        """Log every step recorded since the last poll, of every role; then flush and move the cursor."""
        for role in metric_roles(self.run):
            if role not in self.feeds:
                self.feeds[role] = StepFeed(self.run, role, self._on_step, since_start=True)
        for feed in list(self.feeds.values()):
            feed.poll()
        if self._delivered and self.trackers:
            for t in self.trackers:
                t.flush()
            self._save_cursor()
            self._delivered = False

    def _save_cursor(self) -> None:
        fs, root = self.run.fs()
        write_json(fs, join(root, TRACKERS_DIR, CURSOR_FILE), self.cursor, fsync=False)

    def _safe_poll(self) -> None:
        try:
            self.poll()
        except Exception as e:  # noqa: BLE001 - storage hiccups: the next poll reads it again
            if not self._poll_failed:
                self.warn(
                    "trackers: reading the run's metrics failed: %s: %s (trying again every %.0f s)",
                    type(e).__name__,
                    e,
                    self.poll_s,
                )
            self._poll_failed = True

    def _loop(self) -> None:
        cfg = redact(self.run.cfg.model_dump(mode="json"))
        for t in self.trackers:
            t.log_config(cfg)
        while not self._done.wait(self.poll_s):
            self._safe_poll()

    def start(self, run_in: Callable[..., Any] | None = None) -> TrackerFeed:
        """Start following (`run_in(fn)` runs the thread's body, e.g. in a copied context)."""
        if self.trackers:
            body = (lambda: run_in(self._loop)) if run_in is not None else self._loop
            self._thread = threading.Thread(target=body, name="trackers", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following: the steps not yet logged are, then every tracker is closed."""
        if self._thread is None:
            return
        self._done.set()
        self._thread.join(self.stop_timeout_s)
        if self._thread.is_alive():
            self.warn(
                "trackers: still busy after %.0f s (a tracker not answering); the last steps are not logged",
                self.stop_timeout_s,
            )
            return
        self._safe_poll()
        for t in self.trackers:
            t.close()

    def __enter__(self) -> TrackerFeed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
