"""The end-of-run report: metrics table, reward curve, timeline Gantt chart and utilization.

Every role records each step's metrics as it goes (`record_step`: one JSON file per step under
`<run>/metrics/role=<role>/`, so roles in other processes or on other machines report through
storage alone, and a resumed run rewrites only the steps it redoes). The report is built from
those and the timeline, and written under `<run>/report/` (JSON, PNG) so it outlives any Prefect
server; the flows mirror it as Prefect artifacts. Prefect-free: `build_report(run)`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from typing import Any, Callable

from rl_engine.run.context import RunContext
from rl_engine.storage import join, read_json, write_bytes_atomic, write_json
from rl_engine.run.timeline import load_spans, render_gantt, summary_markdown, utilization

TABLE_KEYS = ("step", "version", "reward_mean", "reward_std", "loss", "kl", "entropy", "clip_frac", "grad_norm", "staleness_max", "wait_experience_s", "train_s")
# Columns of the algorithm knobs that report them (a correction, dynamic sampling), shown when a step has them.
KNOB_KEYS = ("offpolicy_clamped_frac", "offpolicy_masked_frac", "is_weight_mean", "filtered_experiences")


METRICS_DIR = "metrics"


TIME_KEY = "time"  # when the step was recorded (Unix seconds), added to the stored record


def record_step(run: RunContext, role: str, step: int, metrics: dict[str, Any]) -> None:
    """Store one step's metrics of `role` (trainer step t, or explorer step e of explorer-i), with
    the wall-clock time it was recorded at (`time`)."""
    fs, root = run.fs()
    write_json(fs, join(root, METRICS_DIR, f"role={role}", f"step={step:08d}.json"), {**metrics, TIME_KEY: metrics.get(TIME_KEY, time.time())}, fsync=False)


def metric_roles(run: RunContext) -> list[str]:
    """The roles that recorded steps so far (`trainer`, `explorer-0`, ..., any other), sorted."""
    fs, root = run.fs()
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/role=", 1)[1] for p in fs.glob(join(root, METRICS_DIR, "role=*")))


class StepFeed:
    """Steps another process records for `role` (`record_step`), handed to `on_step` once each,
    in step order, as `poll()` finds them: new files, or files rewritten since (a resumed run
    redoes steps), not those there before the feed was made (unless `since_start`: all of them)."""

    def __init__(self, run: RunContext, role: str, on_step: Callable[[str, dict[str, Any]], Any] | None, since_start: bool = False):
        self.run, self.role, self.on_step = run, role, on_step
        self.metrics: list[dict[str, Any]] = []
        self._seen = {} if since_start else self._listing()

    def _listing(self) -> dict[str, Any]:
        fs, root = self.run.fs()
        fs.invalidate_cache()
        found = fs.glob(join(root, METRICS_DIR, f"role={self.role}", "step=*.json"), detail=True)
        return {path: (info.get("size"), info.get("mtime") or info.get("LastModified"), info.get("ETag")) for path, info in found.items()}

    def poll(self) -> None:
        fs, _ = self.run.fs()
        for path, stamp in sorted(self._listing().items()):
            if self._seen.get(path) != stamp:
                self._seen[path] = stamp
                m = read_json(fs, path)
                self.metrics.append(m)
                if self.on_step is not None:
                    self.on_step(self.role, m)


def load_metrics(run: RunContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(trainer metrics by step, explorer metrics by explorer and step) recorded so far."""
    fs, root = run.fs()
    fs.invalidate_cache()
    trainer, explorer = [], []
    for path in sorted(fs.glob(join(root, METRICS_DIR, "role=*", "step=*.json"))):
        (trainer if "/role=trainer/" in path else explorer).append(read_json(fs, path))
    return trainer, explorer


@dataclasses.dataclass
class Report:
    summary: dict[str, Any]
    table: list[dict[str, Any]]
    markdown: str
    images: dict[str, bytes]


def reward_curve_png(trainer_metrics: list[dict], explorer_metrics: list[dict]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if trainer_metrics:
        ax.plot([m["step"] for m in trainer_metrics], [m["reward_mean"] for m in trainer_metrics], marker="o", label="trained batch")
    by_explorer: dict[int, list[dict]] = {}
    for m in explorer_metrics:
        by_explorer.setdefault(m["explorer_id"], []).append(m)
    for i, ms in sorted(by_explorer.items()):
        ax.plot([m["explorer_step"] for m in ms], [m["reward_mean"] for m in ms], alpha=0.6, linestyle="--", label=f"explorer {i} rollouts")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def experience_accounting(fs: Any, root: str, trainer_metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the generated experiences went: committed to the buffer (`generated`), trained,
    read by the trainer but left out of the loss as zero-variance groups (`filtered`, dynamic
    sampling), dropped as stale by the trainer's reader, skipped as corrupt, or still `untrained`
    (in the buffer when the run ended). `wasted_fraction` = share of generated never trained. Generations
    still pending as continuations are not counted: they were never committed. The reader's
    counters travel with its cursor, so a resumed run counts from its start."""
    from rl_engine.buffer.stats import commit_records

    generated = sum(int(rec.get("num_rows") or 0) for _, rec in commit_records(fs, root))
    counters = trainer_metrics[-1].get("buffer", {}) if trainer_metrics else {}
    consumed, dropped, corrupt = (int(counters.get(k, 0)) for k in ("consumed", "dropped_stale", "skipped_corrupt_rows"))
    filtered = int(sum(m.get("filtered_experiences", 0) for m in trainer_metrics))
    trained = consumed - filtered
    return {
        "generated": generated,
        "trained": trained,
        "filtered": filtered,
        "dropped_stale": dropped,
        "skipped_corrupt": corrupt,
        "untrained": max(0, generated - consumed - dropped - corrupt),
        "wasted_fraction": round((generated - trained) / generated, 4) if generated else 0.0,
    }


def build_report(run: RunContext) -> Report:
    """Assemble and store the report of a run from the metrics its roles recorded and the timeline."""
    fs, root = run.fs()
    trainer_metrics, explorer_metrics = load_metrics(run)
    images: dict[str, bytes] = {}
    util: dict[str, Any] = {}
    spans = load_spans(run.url, run.storage_options) if run.cfg.monitor.timeline else []
    if spans:
        util = utilization(spans)
        images["timeline"] = render_gantt(spans, title=f"{run.cfg.name} ({run.cfg.synchronizer.mode})")
    if trainer_metrics or explorer_metrics:
        images["reward-curve"] = reward_curve_png(trainer_metrics, explorer_metrics)
    head = trainer_metrics[: max(1, len(trainer_metrics) // 4)]
    tail = trainer_metrics[-max(1, len(trainer_metrics) // 4) :]
    summary = {
        "run": run.url,
        "mode": run.cfg.synchronizer.mode,
        "trainer_steps": len(trainer_metrics),
        "final_version": trainer_metrics[-1]["version"] if trainer_metrics else None,
        "explorer_steps": len(explorer_metrics),
        "reward_first": _mean([m["reward_mean"] for m in head]) if trainer_metrics else None,
        "reward_last": _mean([m["reward_mean"] for m in tail]) if trainer_metrics else None,
        "max_staleness_seen": max((m["staleness_max"] for m in trainer_metrics), default=None),
        "experiences": experience_accounting(fs, root, trainer_metrics),
        "utilization": util,
    }
    keys = TABLE_KEYS + tuple(k for k in KNOB_KEYS if any(k in m for m in trainer_metrics))
    table = [{k: m.get(k) for k in keys} for m in trainer_metrics]
    markdown = f"# Run `{run.cfg.name}`\n\nmode `{run.cfg.synchronizer.mode}`, files in `{run.url}`\n\n"
    markdown += f"reward (first quarter -> last quarter of trainer steps): {summary['reward_first']} -> {summary['reward_last']}\n\n"
    if util:
        markdown += summary_markdown(util)
    out = join(root, "report")
    write_json(fs, join(out, "summary.json"), summary)
    write_bytes_atomic(fs, join(out, "metrics.jsonl"), "".join(json.dumps(m, default=str) + "\n" for m in trainer_metrics + explorer_metrics).encode())
    for name, png in images.items():
        write_bytes_atomic(fs, join(out, f"{name}.png"), png)
    return Report(summary=summary, table=table, markdown=markdown, images=images)
