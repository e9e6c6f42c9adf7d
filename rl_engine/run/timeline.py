"""Timeline of a run: every component records spans (engine_start, rollout, train, sync, wait,
write, eval; reward: a reward service's scoring of a step, inside its rollout), they are stored as JSON lines under `<run>/timeline/`, and rendered as a Gantt chart plus
a utilization summary: the picture a user compares sync modes by.

`engine_start` is a role building its engine before its first step (an explorer's vLLM engine
and its first-call warm-up, the trainer's DeepSpeed engine). It is start-up, not work: the
utilization reports it apart and computes busy fractions over the run after it, and the Gantt
chart has a second panel zoomed on the last trainer steps, readable however long start-up took.

    rec = TimelineRecorder(*run.fs(), component="explorer-0")   # the run's (filesystem, directory)
    with rec.span("rollout", step=e, version=v):
        ...
    with rec.span("sync", step=e, method="collective") as s:
        s.version = receive_weights()     # fields may be filled in inside the span
    rec.flush()                           # writes the spans recorded since the last flush

    spans = load_spans(run_url, storage_options)      # or read_spans(*run.fs()) with the run's context
    render_gantt(spans, "timeline.png", title="synchronous")
    print(summary_markdown(utilization(spans)))

    rft timeline RUN_URL [--out PNG] [--storage-options JSON]
    python -m rl_engine.run.timeline runs/synchronous-20261121-120000

Each flush writes a new file `timeline/component=<name>/part-<time>-<recorder id>-<seq>.jsonl`
atomically; nothing is ever appended, so recorders in any number of threads or processes, on
local disk or S3, can never tear each other's files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from rl_engine.errors import UserError
from rl_engine.storage import add_storage_options_arg, join, open_storage, parse_storage_options, write_bytes_atomic

KINDS = ("engine_start", "rollout", "train", "sync", "wait", "write", "eval", "reward")
STARTUP = "engine_start"
SYNC_METHODS = ("collective", "checkpoint")
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Span:
    """One interval of one component's work or waiting; times are unix seconds."""

    component: str
    kind: str
    start: float
    end: float
    step: int | None = None
    version: int | None = None
    method: str | None = None  # sync only: collective | checkpoint
    cut: int | None = None  # rollout under partial rollouts: generations cut (to be continued) in this step
    resumed: int | None = None  # rollout under partial rollouts: generations continued from earlier steps
    turns: float | None = None  # rollout of a multi-turn workflow: model turns per episode (mean)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _check_span(kind: str, method: str | None) -> None:
    if kind not in KINDS:
        raise ValueError(f"span kind {kind!r}: expected one of {KINDS}")
    if method is not None and (kind != "sync" or method not in SYNC_METHODS):
        raise ValueError(
            f"span method {method!r} on kind {kind!r}: only sync spans have a method, one of {SYNC_METHODS}"
        )


# --------------------------------------------------------------------------- recording


class TimelineRecorder:
    """Records spans of one component in memory and writes them out on `flush()` (thread-safe).

    `enabled=False` (monitor.timeline off) keeps the same calls but stores nothing.
    """

    def __init__(self, fs: Any, root: str, component: str = "trainer", enabled: bool = True):
        """Spans of `component` of the run at `root` of filesystem `fs`."""
        if not _COMPONENT.match(component):
            raise ValueError(f"component name {component!r}: use letters, digits, '-', '_' or '.' (e.g. explorer-0)")
        self.fs, self.root, self.component, self.enabled = fs, root, component, enabled
        self._id = uuid.uuid4().hex[:8]  # two recorders of one component (a restart) never share a file name
        self._lock = threading.Lock()
        self._pending: list[Span] = []
        self._seq = 0

    @contextlib.contextmanager
    def span(
        self, kind: str, step: int | None = None, version: int | None = None, method: str | None = None
    ) -> Iterator[Span]:
        """Time the body as a span; it is recorded even if the body raises (that time was spent)."""
        _check_span(kind, method)
        s = Span(self.component, kind, time.time(), 0.0, step, version, method)
        try:
            yield s
        finally:
            s.end = time.time()
            self.add(s)

    def add(self, span: Span) -> None:
        """Record a span measured elsewhere (e.g. a wait computed from two timestamps)."""
        _check_span(span.kind, span.method)
        if span.end < span.start:
            raise ValueError(f"span ends before it starts: {span}")
        if self.enabled:
            with self._lock:
                self._pending.append(span)

    def flush(self) -> str | None:
        """Write the spans recorded since the last flush as one new file; returns its path (None if none)."""
        with self._lock:
            spans, self._pending = self._pending, []
            self._seq += 1
            seq = self._seq
        if not spans:
            return None
        name = f"part-{int(spans[0].start * 1000):015d}-{self._id}-{seq:05d}.jsonl"
        path = join(self.root, "timeline", f"component={self.component}", name)
        try:
            # Not fsynced, like the metrics (`record_step`): spans are a report, not state a resume needs.
            write_bytes_atomic(
                self.fs, path, "".join(json.dumps(asdict(s)) + "\n" for s in spans).encode(), fsync=False
            )
        except BaseException:
            with self._lock:  # keep them for the next flush rather than lose them
                self._pending[:0] = spans
            raise
        return path

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> TimelineRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _span_from_dict(d: dict[str, Any]) -> Span:
    # Unknown keys are ignored so spans written by a newer version still load.
    known = {f.name for f in fields(Span)}
    return Span(**{k: v for k, v in d.items() if k in known})


def load_spans(run_url: str, storage_options: dict[str, Any] | None = None) -> list[Span]:
    """All spans flushed under `<run>/timeline/` of the run at `run_url` (`rft timeline`, tests)."""
    return read_spans(*open_storage(run_url, storage_options))


def read_spans(fs: Any, root: str) -> list[Span]:
    """All spans flushed under `<root>/timeline/`, sorted by start time ([] if there are none)."""
    base = join(root, "timeline")
    fs.invalidate_cache(base)  # s3fs caches listings; other components wrote since
    try:
        paths = sorted(p for p in fs.find(base) if p.rsplit("/", 1)[-1].startswith("part-") and p.endswith(".jsonl"))
    except FileNotFoundError:
        return []
    # One batched read: s3fs fetches the many small per-flush files concurrently.
    contents = fs.cat(paths) if paths else {}
    spans = []
    for path in paths:
        for lineno, line in enumerate(contents[path].decode().splitlines(), start=1):
            try:
                spans.append(_span_from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, KeyError) as e:
                raise ValueError(f"{path}: line {lineno}: not a timeline span ({type(e).__name__}: {e})") from None
    return sorted(spans, key=lambda s: (s.start, s.component))


# --------------------------------------------------------------------------- analysis


def lane_order(components: set[str] | list[str]) -> list[str]:
    """Explorers (by number), then the buffer, then the trainer, then anything else: the seeds' layout."""

    def key(c: str) -> tuple[int, int, str]:
        role = (
            ("explorer", "buffer", "trainer").index(c.split("-")[0])
            if c.split("-")[0] in ("explorer", "buffer", "trainer")
            else 3
        )
        num = re.search(r"(\d+)$", c)
        return role, int(num.group(1)) if num else -1, c

    return sorted(set(components), key=key)


def _measure(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals, so nested or overlapping spans count once."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def startup_end(spans: list[Span]) -> float:
    """When the run's start-up ended: the end of the last engine_start span begun before any
    work (the run's first start if there is none). A resumed attempt's engine start, later in
    the run, is not the run's start-up."""
    first_work = min((s.start for s in spans if s.kind not in ("wait", STARTUP)), default=float("inf"))
    return max(
        (s.end for s in spans if s.kind == STARTUP and s.start < first_work), default=min(s.start for s in spans)
    )


def utilization(spans: list[Span]) -> dict[str, Any]:
    """Busy fraction per lane and time spent waiting, after start-up.

    startup_s = run start (first span) to `startup_end` (all engines up); busy = union of
    a lane's spans other than wait and engine_start, within [end of start-up, end of run];
    busy_fraction = busy / that window (so a lane that starts late counts as idle, and engine
    start-up is neither work nor idleness); wait_s, the lane's wait spans within that window.
    wall_s is the whole run, start-up included; kinds_s the whole run's time per span kind
    (engine_start among them). Trainer wait spans are time waiting for experiences; explorer
    wait spans, for sync.
    """
    if not spans:
        return {
            "wall_s": 0.0,
            "startup_s": 0.0,
            "lanes": {},
            "trainer_wait_for_experiences_s": 0.0,
            "explorer_wait_for_sync_s": 0.0,
            "eval_s": 0.0,
        }
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    ready = startup_end(spans)
    window = t1 - ready
    lanes = {}
    for comp in lane_order({s.component for s in spans}):
        mine = [s for s in spans if s.component == comp]
        after = [(max(s.start, ready), s.end, s.kind) for s in mine if s.end > ready]
        busy = _measure([(a, b) for a, b, kind in after if kind not in ("wait", STARTUP)])
        kinds = {
            k: _measure([(s.start, s.end) for s in mine if s.kind == k])
            for k in KINDS
            if any(s.kind == k for s in mine)
        }
        lanes[comp] = {
            "busy_s": busy,
            "wait_s": _measure([(a, b) for a, b, kind in after if kind == "wait"]),
            "engine_start_s": kinds.get(STARTUP, 0.0),
            "busy_fraction": busy / window if window > 0 else 0.0,
            "kinds_s": kinds,
        }
    return {
        "wall_s": t1 - t0,
        "startup_s": ready - t0,
        "lanes": lanes,
        "trainer_wait_for_experiences_s": sum(v["wait_s"] for c, v in lanes.items() if c.startswith("trainer")),
        "explorer_wait_for_sync_s": sum(v["wait_s"] for c, v in lanes.items() if c.startswith("explorer")),
        "eval_s": sum(
            v["kinds_s"].get("eval", 0.0) for v in lanes.values()
        ),  # held-out evaluations (rl_engine.roles.evaluation)
    }


def summary_markdown(util: dict[str, Any]) -> str:
    """A Markdown table of `utilization(...)`: one row per lane, then the waiting totals."""
    rows = [
        "| lane | busy | busy s | waiting s | rollout s | train s | sync s | write s | engine start s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for comp, v in util["lanes"].items():
        k = v["kinds_s"]
        cells = [f"{k.get(kind, 0.0):.2f}" for kind in ("rollout", "train", "sync", "write", STARTUP)]
        rows.append(
            f"| {comp} | {100 * v['busy_fraction']:.1f}% | {v['busy_s']:.2f} | {v['wait_s']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    rows += [
        "",
        f"- wall time: {util['wall_s']:.2f} s, of which start-up (until the last engine was up): {util['startup_s']:.2f} s; busy is over the rest",
        f"- trainer waiting for experiences: {util['trainer_wait_for_experiences_s']:.2f} s",
        f"- explorers waiting for sync: {util['explorer_wait_for_sync_s']:.2f} s",
    ]
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- rendering

# (legend label, colour, hatch); colour-blind-safe Tableau hues, waiting pale and hatched.
_STYLE = {
    STARTUP: ("engine start", "#76B7B2", None),
    "rollout": ("rollout", "#4E79A7", None),
    "train": ("train", "#F28E2B", None),
    "sync:collective": ("sync (collective)", "#B07AA1", None),
    "sync:checkpoint": ("sync (checkpoint)", "#59A14F", None),
    "sync": ("sync", "#9C755F", None),
    "write": ("buffer write", "#EDC948", None),
    "eval": ("evaluation", "#E15759", None),
    "reward": ("reward service", "#FF9DA7", None),
    "wait": ("waiting", "#E0E0E0", "///"),
}
_DARK = {"rollout", "train", "sync:collective", "sync:checkpoint", "sync", "eval"}
LAST_STEPS = 5  # the Gantt chart's second panel: the last trainer steps


def last_steps_window(spans: list[Span], n: int = LAST_STEPS) -> tuple[float, float] | None:
    """(start, end) of the Gantt chart's zoomed panel: from the end of trainer step (last - n) (or
    of start-up, in a run of at most n steps) to the run's end; None when that is the whole run
    (no start-up and at most n steps: one panel says it all)."""
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    train = sorted((s for s in spans if s.component == "trainer" and s.kind == "train"), key=lambda s: s.end)
    a = train[-n - 1].end if len(train) > n else startup_end(spans)
    return (a, t1) if t0 < a < t1 else None


def _style_key(s: Span) -> str:
    return f"sync:{s.method}" if s.kind == "sync" and s.method else s.kind


def _label(s: Span) -> str:
    if s.kind == "eval":
        return f"eval v{s.version}"
    if s.kind == "sync":
        return f"v{s.version}" if s.version is not None else ""
    if s.kind == "rollout" and s.step is not None and s.turns is not None:
        return f"{s.step}·{s.turns:.1f}t"  # the step and its turns per episode
    if s.kind in ("rollout", "train", "write") and s.step is not None:
        return str(s.step)
    return ""


def _draw_bars(ax: Any, spans: list[Span], lanes: list[str], t0: float) -> list[Span]:
    """One bar per span; returns the spans in drawing order."""
    # Longest first, so a short span nested in a long one (a write in a rollout) is drawn on top.
    ordered = sorted(spans, key=lambda s: -s.duration)
    for s in ordered:
        _, color, hatch = _STYLE[_style_key(s)]
        edge = "white" if hatch is None else "#A0A0A0"
        ax.barh(
            lanes.index(s.component),
            s.duration,
            left=s.start - t0,
            height=0.62,
            color=color,
            hatch=hatch,
            edgecolor=edge,
            linewidth=0.6,
        )
    return ordered


def _decorate(ax: Any, spans: list[Span], lanes: list[str], title: str | None, legend: bool = True) -> None:
    """Lane labels, time axis, legend of the span kinds present, title."""
    from matplotlib.patches import Patch

    ax.set_yticks(range(len(lanes)), labels=lanes)
    ax.set_xlabel("time since run start (s)")
    ax.grid(axis="x", color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    present = [k for k in _STYLE if any(_style_key(s) == k for s in spans)]
    handles = [
        Patch(facecolor=_STYLE[k][1], hatch=_STYLE[k][2], edgecolor="#A0A0A0", label=_STYLE[k][0]) for k in present
    ]
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title, loc="left", fontsize=11)


def _label_bars(ax: Any, spans: list[Span], lanes: list[str], t0: float) -> None:
    """Step numbers (sync: versions) inside the bars wide enough to hold them (the visible part of
    a bar cut by the panel's time range)."""
    px_per_s = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
    lo, hi = ax.get_xlim()
    for s in spans:
        text = _label(s)
        a, b = max(s.start - t0, lo), min(s.end - t0, hi)
        if text and (b - a) * px_per_s > 7 * len(text) + 6:  # ~7 px per glyph at fontsize 8
            dark = _style_key(s) in _DARK
            ax.text(
                (a + b) / 2,
                lanes.index(s.component),
                text,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if dark else "black",
            )


def gantt_figure(spans: list[Span], title: str | None = None) -> Any:
    """The Gantt chart as a matplotlib Figure (Agg canvas attached).

    Top panel: the whole run. Below it, unless that would repeat the top, the last trainer steps
    (`last_steps_window`) on the same time axis: the steady state, however long start-up took.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not spans:
        raise UserError("render_gantt: no spans to draw (was monitor.timeline on, and did the components flush?)")
    lanes = lane_order({s.component for s in spans})
    t0 = min(s.start for s in spans)
    wall = max(s.end for s in spans) - t0
    panels = [(0.0, wall * 1.01 if wall > 0 else 1.0, title)]
    zoom = last_steps_window(spans)
    if zoom is not None:
        a, b = zoom[0] - t0, zoom[1] - t0
        steps = sum(1 for s in spans if s.component == "trainer" and s.kind == "train" and s.end > zoom[0])
        panels.append((a, b + 0.01 * (b - a), f"the last {steps} trainer steps (from {a:.1f} s on)"))
    # Figure object + Agg canvas, not pyplot: no global backend state, safe from worker threads.
    fig = Figure(figsize=(12, len(panels) * (1.4 + 0.55 * len(lanes))), dpi=110)
    FigureCanvasAgg(fig)
    drawn = []
    for i, (lo, hi, panel_title) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        ax.set_xlim(lo, hi)
        ax.set_ylim(len(lanes) - 0.4, -0.6)  # first lane on top
        shown = [s for s in spans if s.end - t0 >= lo and s.start - t0 <= hi]
        drawn.append((ax, _draw_bars(ax, shown, lanes, t0)))
        _decorate(ax, spans, lanes, panel_title, legend=i == 0)
    fig.tight_layout()
    fig.canvas.draw()  # after tight_layout: the final axes geometry gives bar widths in pixels
    for ax, ordered in drawn:
        _label_bars(ax, ordered, lanes, t0)
    return fig


def render_gantt(
    spans: list[Span],
    out_png: str | None = None,
    title: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> bytes:
    """Draw the run as a Gantt chart (PNG, `gantt_figure`); writes it to `out_png` (path or URL) if given, returns the bytes."""
    buf = io.BytesIO()
    gantt_figure(spans, title).savefig(buf, format="png")
    data = buf.getvalue()
    if out_png is not None:
        fs, path = open_storage(out_png, storage_options)
        write_bytes_atomic(fs, path, data)
    return data


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """CLI: `rft timeline RUN_URL [--out PNG]`: render the Gantt chart and print the utilization table."""
    ap = argparse.ArgumentParser(
        prog="rft timeline", description="Render a run's Gantt chart and print its utilization summary."
    )
    ap.add_argument("run_url", help="run directory: a local path or fsspec URL (s3://bucket/runs/NAME)")
    ap.add_argument("--out", help="PNG to write (path or URL); default <run>/timeline.png")
    ap.add_argument("--title", help="chart title; default the run's name")
    add_storage_options_arg(ap)
    a = ap.parse_args(argv)
    options = parse_storage_options(a.storage_options)
    spans = load_spans(a.run_url, options)
    if not spans:
        raise UserError(
            f"{a.run_url}: no timeline spans under {a.run_url.rstrip('/')}/timeline/ (is this a run directory, and was monitor.timeline on?)"
        )
    out = a.out or join(a.run_url, "timeline.png")
    render_gantt(spans, out, title=a.title or a.run_url.rstrip("/").rsplit("/", 1)[-1], storage_options=options)
    print(summary_markdown(utilization(spans)), end="")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
