"""The end-of-run report: metrics table, reward curve, timeline Gantt chart and utilization, held-out evaluations.

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
import math
import time
from collections.abc import Callable
from typing import Any

from rl_engine.run.context import RunContext
from rl_engine.run.timeline import read_spans, render_gantt, summary_markdown, utilization
from rl_engine.storage import join, read_json, write_bytes_atomic, write_json

TABLE_KEYS = (
    "step",
    "version",
    "reward_mean",
    "reward_std",
    "loss",
    "kl",
    "entropy",
    "clip_frac",
    "grad_norm",
    "staleness_max",
    "wait_experience_s",
    "train_s",
)
# Columns of the algorithm knobs that report them (a correction, dynamic sampling), shown when a step has them.
KNOB_KEYS = ("offpolicy_clamped_frac", "offpolicy_masked_frac", "is_weight_mean", "filtered_experiences")


METRICS_DIR = "metrics"


# --------------------------------------------------------------------------- held-out evaluations
# Explorer 0 writes them (rl_engine.roles.evaluation): a record per evaluated version under
# `<run>/metrics/role=eval/step=<v>.json`, and `<run>/eval/best.json` with `eval.keep_best`.

EVAL_ROLE = "eval"  # the metrics role of the evaluation records
EVAL_DIR = "eval"  # <run>/eval/: saved weights of due versions, best.json
EVAL_COMMITTED = "COMMITTED"  # <run>/eval/version=<v>/COMMITTED: that version's saved weights are whole
BEST = "best.json"
_CURVE = ("pass@1",)  # the metric drawn per set (avg@n is pass@1's estimate too)


def load_evaluations(run: RunContext) -> list[dict[str, Any]]:
    """Every evaluation record of the run, by version."""
    fs, root = run.fs()
    fs.invalidate_cache()
    paths = fs.glob(join(root, METRICS_DIR, f"role={EVAL_ROLE}", "step=*.json"))
    return sorted((read_json(fs, p) for p in paths), key=lambda r: r["version"])


def read_best(run: RunContext) -> dict[str, Any] | None:
    """`<run>/eval/best.json` ({version, metric, value, model}), or None."""
    fs, root = run.fs()
    path = join(root, EVAL_DIR, BEST)
    return read_json(fs, path) if fs.exists(path) else None


def set_names(records: list[dict[str, Any]]) -> list[str]:
    return sorted({k.split("/", 1)[0] for r in records for k in r if k.endswith("/tasks")})


def eval_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (version, set): the set's metrics, rounded for people (4 significant digits)."""
    rows = []
    for r in records:
        for name in set_names([r]):
            metrics = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith(f"{name}/")}
            rows.append(
                {
                    "version": r["version"],
                    "set": name,
                    **{k: float(f"{v:.4g}") for k, v in metrics.items()},
                    "seconds": round(r["seconds"], 2),
                }
            )
    return rows


def eval_markdown(table: list[dict[str, Any]], best: dict[str, Any] | None) -> str:
    """The evaluations as a Markdown table (version, set, avg@n, pass@k, lengths), and the best version."""
    cols = list(dict.fromkeys(k for row in table for k in row if not k.startswith("finish/")))
    lines = ["## Held-out evaluation", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in cols) + " |" for row in table]
    if best is not None:
        lines += [
            "",
            f"best: version {best['version']} ({best['metric']} = {best['value']:.4g}), model `{best['model']}`",
        ]
    return "\n".join(lines) + "\n"


def heldout_curve_png(records: list[dict[str, Any]]) -> bytes:
    """Each set's pass@1 against the trainer version."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name in set_names(records):
        for metric in _CURVE:
            pts = [(r["version"], r[f"{name}/{metric}"]) for r in records if f"{name}/{metric}" in r]
            ax.plot([v for v, _ in pts], [y for _, y in pts], marker="o", label=f"{name} {metric}")
    ax.set_xlabel("trainer version")
    ax.set_ylabel("held-out score")
    ax.set_title("held-out evaluation")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


TIME_KEY = "time"  # when the step was recorded (Unix seconds), added to the stored record


def record_step(run: RunContext, role: str, step: int, metrics: dict[str, Any]) -> None:
    """Store one step's metrics of `role` (trainer step t, or explorer step e of explorer-i), with
    the wall-clock time it was recorded at (`time`)."""
    fs, root = run.fs()
    write_json(
        fs,
        join(root, METRICS_DIR, f"role={role}", f"step={step:08d}.json"),
        {**metrics, TIME_KEY: metrics.get(TIME_KEY, time.time())},
        fsync=False,
    )


def metric_roles(run: RunContext) -> list[str]:
    """The roles that recorded steps so far (`trainer`, `explorer-0`, ..., any other), sorted."""
    fs, root = run.fs()
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/role=", 1)[1] for p in fs.glob(join(root, METRICS_DIR, "role=*")))


class StepFeed:
    """Steps another process records for `role` (`record_step`), handed to `on_step` once each,
    in step order, as `poll()` finds them: new files, or files rewritten since (a resumed run
    redoes steps), not those there before the feed was made (unless `since_start`: all of them)."""

    def __init__(
        self,
        run: RunContext,
        role: str,
        on_step: Callable[[str, dict[str, Any]], Any] | None,
        since_start: bool = False,
        delivered_through: int | None = None,
    ):
        """`delivered_through`: the last step an earlier feed delivered (its durable cursor); the
        files of later steps are handed over although they were there before this feed."""
        self.run, self.role, self.on_step = run, role, on_step
        self.metrics: list[dict[str, Any]] = []
        self._seen = {} if since_start else self._listing()
        if delivered_through is not None:
            self._seen = {p: st for p, st in self._seen.items() if step_of_path(p) <= delivered_through}

    def seen(self) -> list[str]:
        """The step files this feed counts as handed over (or there before it, and not to be)."""
        return list(self._seen)

    def _listing(self) -> dict[str, Any]:
        fs, root = self.run.fs()
        fs.invalidate_cache()
        found = fs.glob(join(root, METRICS_DIR, f"role={self.role}", "step=*.json"), detail=True)
        return {
            path: (info.get("size"), info.get("mtime") or info.get("LastModified"), info.get("ETag"))
            for path, info in found.items()
        }

    def poll(self) -> None:
        fs, _ = self.run.fs()
        for path, stamp in sorted(self._listing().items()):
            if self._seen.get(path) != stamp:
                self._seen[path] = stamp
                m = read_json(fs, path)
                self.metrics.append(m)
                if self.on_step is not None:
                    self.on_step(self.role, m)


def step_of_path(path: str) -> int:
    return int(path.rsplit("step=", 1)[1].split(".", 1)[0])


def load_metrics(run: RunContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(trainer metrics by step, explorer metrics by explorer and step) recorded so far."""
    fs, root = run.fs()
    fs.invalidate_cache()
    trainer, explorer = [], []
    for path in sorted(fs.glob(join(root, METRICS_DIR, "role=*", "step=*.json"))):
        if "/role=trainer/" in path or "/role=explorer-" in path:  # not the evaluations' (load_evaluations)
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
        ax.plot(
            [m["step"] for m in trainer_metrics],
            [m["reward_mean"] for m in trainer_metrics],
            marker="o",
            label="trained batch",
        )
    by_explorer: dict[int, list[dict]] = {}
    for m in explorer_metrics:
        by_explorer.setdefault(m["explorer_id"], []).append(m)
    for i, ms in sorted(by_explorer.items()):
        ax.plot(
            [m["explorer_step"] for m in ms],
            [m["reward_mean"] for m in ms],
            alpha=0.6,
            linestyle="--",
            label=f"explorer {i} rollouts",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


SIGNIFICANT_DIGITS = 4


def rounded(value: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """`value` with every float in it (dicts and lists walked) rounded to `digits` significant
    digits, for what people read (artifacts, log lines): 0.5687500000000001 -> 0.5688, 1.234e-05
    stays 1.234e-05; ints, bools, strings, None, nan and inf unchanged. Stored data keeps full precision."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rounded(v, digits) for v in value)
    return value


def number(value: Any, digits: int = SIGNIFICANT_DIGITS) -> str:
    """A number as people read it: a float to `digits` significant digits (`0.5688`), None as `n/a`."""
    if value is None:
        return "n/a"
    return str(rounded(value, digits))  # 0.0 stays "0.0", 1.234e-05 stays short


def _reward(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The run's summary (`build_report(...).summary`) as a few lines for people: what `rft run`
    prints at the end and the mode flow's last log line in Prefect."""
    util = summary.get("utilization") or {}
    run = summary["run"]
    lines = [
        f"run:        {run}  (mode {summary['mode']})",
        f"trained:    {summary['trainer_steps']} steps -> version {summary['final_version']}, {summary['explorer_steps']} explorer steps",
        f"reward:     {_reward(summary['reward_first'])} (first quarter) -> {_reward(summary['reward_last'])} (last quarter)",
        f"staleness:  max {summary['max_staleness_seen']}",
    ]
    if x := summary.get("experiences"):
        filtered = f", {x['filtered']} filtered (zero-variance groups)" if x.get("filtered") else ""
        lines.append(
            f"experiences: {x['generated']} generated, {x['trained']} trained{filtered}, {x['dropped_stale']} dropped as stale, {x['untrained']} left untrained"
        )
    if util:
        lines.append(
            f"start-up:   {util.get('startup_s', 0.0):.1f} s until every engine was up (busy below is after it)"
        )
    for lane, u in (util.get("lanes") or {}).items():
        lines.append(f"busy:       {lane:<12} {u['busy_fraction']:.0%} (waiting {u['wait_s']:.1f} s)")
    for name in dict.fromkeys(r["set"] for r in summary.get("evaluations") or []):
        mine = [r for r in summary["evaluations"] if r["set"] == name]
        lines.append(
            f"held-out:   {name} pass@1 {mine[0]['pass@1']} (v{mine[0]['version']}) -> {mine[-1]['pass@1']} (v{mine[-1]['version']}), {len(mine)} evaluations"
        )
    lines.append(f"report:     {run}/report/ (timeline.png, reward-curve.png, summary.json)")
    if summary.get("model"):
        lines.append(f"model:      {summary['model']}")
    if best := summary.get("best"):
        lines.append(
            f"best:       version {best['version']} ({best['metric']} = {number(best['value'])}): {best['model']}"
        )
    return lines


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
    consumed, dropped, corrupt = (
        int(counters.get(k, 0)) for k in ("consumed", "dropped_stale", "skipped_corrupt_rows")
    )
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
    spans = read_spans(fs, root) if run.cfg.monitor.timeline else []
    if spans:
        util = utilization(spans)
        images["timeline"] = render_gantt(spans, title=f"{run.cfg.name} ({run.cfg.synchronizer.mode})")
    if trainer_metrics or explorer_metrics:
        images["reward-curve"] = reward_curve_png(trainer_metrics, explorer_metrics)
    evaluations = load_evaluations(run)
    if evaluations:
        images["heldout-curve"] = heldout_curve_png(evaluations)
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
        "model": f"{run.url}/model" if fs.exists(join(root, "model", "config.json")) else None,
        **({"evaluations": eval_table(evaluations), "best": read_best(run)} if evaluations else {}),
    }
    keys = TABLE_KEYS + tuple(k for k in KNOB_KEYS if any(k in m for m in trainer_metrics))
    table = [{k: rounded(m.get(k)) for k in keys} for m in trainer_metrics]
    markdown = f"# Run `{run.cfg.name}`\n\nmode `{run.cfg.synchronizer.mode}`, files in `{run.url}`\n\n"
    markdown += f"reward (first quarter -> last quarter of trainer steps): {number(summary['reward_first'])} -> {number(summary['reward_last'])}\n\n"
    if util:
        markdown += summary_markdown(util)
    if evaluations:
        markdown += "\n" + eval_markdown(eval_table(evaluations), summary["best"])
    out = join(root, "report")
    write_json(fs, join(out, "summary.json"), summary)
    write_bytes_atomic(
        fs,
        join(out, "metrics.jsonl"),
        "".join(json.dumps(m, default=str) + "\n" for m in trainer_metrics + explorer_metrics).encode(),
    )
    for name, png in images.items():
        write_bytes_atomic(fs, join(out, f"{name}.png"), png)
    return Report(summary=summary, table=table, markdown=markdown, images=images)
