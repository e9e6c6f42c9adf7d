"""Timeline: spans recorded from many threads/processes round-trip intact, utilization numbers,
the Gantt PNG, and the `rft timeline` entry point."""

from __future__ import annotations

import io
import multiprocessing
import threading
from collections import Counter

import pytest

from rl_engine.errors import UserError
from rl_engine.run.timeline import (
    Span,
    TimelineRecorder,
    gantt_figure,
    lane_order,
    last_steps_window,
    load_spans,
    main,
    render_gantt,
    startup_end,
    summary_markdown,
    utilization,
)
from rl_engine.storage import open_storage

T0 = 1_700_000_000.0


def _key(s: Span):
    return (s.component, s.kind, s.start, s.end, s.step, s.version, s.method)


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_span_context_records_times_fields_and_exceptions(tmp_path, monkeypatch):
    clock = FakeClock(T0)
    monkeypatch.setattr("rl_engine.run.timeline.time.time", clock)
    rec = TimelineRecorder(*open_storage(str(tmp_path / "run")), component="explorer-0")
    with rec.span("sync", step=3, method="collective") as s:
        clock.t = T0 + 2.5
        s.version = 2  # learnt inside the span
    with pytest.raises(RuntimeError), rec.span("rollout", step=4, version=2):
        clock.t = T0 + 4.0
        raise RuntimeError("engine died")
    assert rec.flush() is not None
    assert rec.flush() is None  # nothing new: no empty file
    got = [_key(s) for s in load_spans(str(tmp_path / "run"))]
    assert got == [
        ("explorer-0", "sync", T0, T0 + 2.5, 3, 2, "collective"),
        ("explorer-0", "rollout", T0 + 2.5, T0 + 4.0, 4, 2, None),  # recorded although it raised
    ]


def test_bad_spans_and_names_rejected(tmp_path):
    rec = TimelineRecorder(*open_storage(str(tmp_path)), component="trainer")
    with pytest.raises(ValueError, match="kind"):
        rec.add(Span("trainer", "nap", T0, T0 + 1))
    with pytest.raises(ValueError, match="method"):
        rec.add(Span("trainer", "train", T0, T0 + 1, method="collective"))
    with pytest.raises(ValueError, match="ends before"):
        rec.add(Span("trainer", "train", T0 + 1, T0))
    with pytest.raises(ValueError, match="component name"):
        TimelineRecorder(*open_storage(str(tmp_path)), component="../trainer")


def test_disabled_recorder_writes_nothing(tmp_path):
    rec = TimelineRecorder(*open_storage(str(tmp_path / "run")), component="trainer", enabled=False)
    with rec.span("train", step=1):
        pass
    assert rec.flush() is None
    assert load_spans(str(tmp_path / "run")) == []


def _record_many(run_url, options, component, worker, n, barrier=None):
    """n spans, flushing after every third so flushes of different writers interleave."""
    rec = TimelineRecorder(*open_storage(run_url, options), component=component)
    if barrier is not None:
        barrier.wait()
    for i in range(n):
        rec.add(
            Span(component, "rollout", T0 + worker * 1000 + i, T0 + worker * 1000 + i + 0.5, step=i, version=worker)
        )
        if i % 3 == 2:
            rec.flush()
    rec.flush()


def test_concurrent_threads_round_trip(tmp_path):
    run = str(tmp_path / "run")
    shared = TimelineRecorder(*open_storage(run), component="buffer")  # one recorder used by two threads at once
    barrier = threading.Barrier(6)

    def use_shared(worker):
        barrier.wait()
        for i in range(20):
            shared.add(
                Span("buffer", "write", T0 + worker * 1000 + i, T0 + worker * 1000 + i + 0.1, step=i, version=worker)
            )
            shared.flush()

    # Two recorders share the component name "trainer" (a restarted trainer): distinct files still.
    comps = ["explorer-0", "explorer-1", "trainer", "trainer"]
    threads = [threading.Thread(target=_record_many, args=(run, None, c, w, 20, barrier)) for w, c in enumerate(comps)]
    threads += [threading.Thread(target=use_shared, args=(w,)) for w in (10, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = Counter()
    for w, c in enumerate(comps):
        expected.update(("rollout", c, w, i) for i in range(20))
    expected.update(("write", "buffer", w, i) for w in (10, 11) for i in range(20))
    got = Counter((s.kind, s.component, s.version, s.step) for s in load_spans(run))
    assert got == expected  # every span exactly once, none torn or lost


def test_concurrent_processes_round_trip(tmp_path):
    run = str(tmp_path / "run")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(run, None, f"explorer-{w}", w, 10)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    spans = load_spans(run)
    assert sorted((s.component, s.step) for s in spans) == sorted(
        (f"explorer-{w}", i) for w in range(3) for i in range(10)
    )


@pytest.mark.slow
def test_round_trip_on_s3(s3_bucket):
    url, options = s3_bucket
    run = f"{url}/runs/r1"
    threads = [
        threading.Thread(target=_record_many, args=(run, options, c, w, 7))
        for w, c in enumerate(["explorer-0", "trainer"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = load_spans(run, options)
    assert Counter(s.component for s in spans) == {"explorer-0": 7, "trainer": 7}
    png = f"{run}/timeline.png"
    render_gantt(spans, png, storage_options=options)
    import s3fs

    assert s3fs.S3FileSystem(**options).cat_file(png)[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- analysis


def _s(comp, kind, a, b, step=None, version=None, method=None):
    return Span(comp, kind, T0 + a, T0 + b, step, version, method)


HAND_MADE = [
    # explorer-0: rollout 0-4, waits for the trainer 4-6, syncs 6-7, rollout 7-10 -> busy 8 of 10
    _s("explorer-0", "rollout", 0, 4, 1, 0),
    _s("explorer-0", "wait", 4, 6, 1),
    _s("explorer-0", "sync", 6, 7, 1, 1, "collective"),
    _s("explorer-0", "rollout", 7, 10, 2, 1),
    # explorer-1 starts late; a write overlapping its rollout counts once: busy = union 2-6 = 4
    _s("explorer-1", "rollout", 2, 5, 1, 0),
    _s("explorer-1", "write", 4, 6, 1, 0),
    # buffer: two writes of 0.5 s
    _s("buffer", "write", 4, 4.5, 1),
    _s("buffer", "write", 9.5, 10, 2),
    # trainer: waits for experiences 0-4, trains 4-6, syncs 6-7, waits 7-10 -> busy 3 of 10
    _s("trainer", "wait", 0, 4, 1),
    _s("trainer", "train", 4, 6, 1, 0),
    _s("trainer", "sync", 6, 7, 1, 1, "collective"),
    _s("trainer", "wait", 7, 10, 2),
]


def test_utilization_exact_numbers():
    u = utilization(HAND_MADE)
    assert u["wall_s"] == 10.0
    assert list(u["lanes"]) == ["explorer-0", "explorer-1", "buffer", "trainer"]
    fractions = {c: v["busy_fraction"] for c, v in u["lanes"].items()}
    assert fractions == pytest.approx({"explorer-0": 0.8, "explorer-1": 0.4, "buffer": 0.1, "trainer": 0.3}, abs=1e-12)
    assert u["lanes"]["explorer-0"]["kinds_s"] == {"rollout": 7.0, "sync": 1.0, "wait": 2.0}
    assert u["lanes"]["trainer"]["wait_s"] == 7.0
    assert u["trainer_wait_for_experiences_s"] == 7.0
    assert u["explorer_wait_for_sync_s"] == 2.0
    assert utilization([])["wall_s"] == 0.0


def test_summary_markdown_table():
    md = summary_markdown(utilization(HAND_MADE))
    assert "| explorer-0 | 80.0% | 8.00 | 2.00 | 7.00 | 0.00 | 1.00 | 0.00 | 0.00 |" in md
    assert "| trainer | 30.0% | 3.00 | 7.00 | 0.00 | 2.00 | 1.00 | 0.00 | 0.00 |" in md
    assert "- wall time: 10.00 s, of which start-up (until the last engine was up): 0.00 s" in md
    assert "- trainer waiting for experiences: 7.00 s" in md
    assert "- explorers waiting for sync: 2.00 s" in md


# A run whose engines take long to start: explorer-0's vLLM engine 0-20 (rollout 1 is 20-21),
# explorer-1's 0-30 (it waited for the start lock), the trainer's DeepSpeed engine 0-5; then 8
# trainer steps of 2 s each.
LONG_STARTUP = [
    _s("explorer-0", "engine_start", 0, 20, None, 0),
    _s("explorer-1", "engine_start", 0, 30, None, 0),
    _s("trainer", "engine_start", 0, 5, None, 0),
    _s("explorer-0", "rollout", 20, 21, 1, 0),
    _s("explorer-0", "wait", 21, 30, None, 0),
    _s("explorer-1", "rollout", 30, 31, 1, 0),
    _s("trainer", "wait", 20, 31, 1, 0),
    *[_s("trainer", "train", 31 + 2 * i, 32 + 2 * i, i + 1, i) for i in range(8)],  # train 1 s, then 1 s of...
    *[_s("trainer", "wait", 32 + 2 * i, 33 + 2 * i, i + 2, i + 1) for i in range(8)],  # ...waiting
    *[_s(f"explorer-{j}", "rollout", 31 + 2 * i, 32.5 + 2 * i, i + 2, i) for i in range(8) for j in (0, 1)],
]


def test_engine_start_is_start_up_not_work():
    u = utilization(LONG_STARTUP)
    assert u["wall_s"] == 47.0 and u["startup_s"] == 30.0  # until the last engine (explorer-1's) was up
    lanes = u["lanes"]
    assert [lanes[c]["engine_start_s"] for c in ("explorer-0", "explorer-1", "trainer")] == [20.0, 30.0, 5.0]
    # Busy over the 17 s after start-up: 8 rollouts of 1.5 s each (explorer-1's rollout 1 too).
    assert lanes["explorer-0"]["busy_s"] == pytest.approx(12.0) and lanes["explorer-1"]["busy_s"] == pytest.approx(13.0)
    assert lanes["explorer-0"]["busy_fraction"] == pytest.approx(12.0 / 17)
    assert lanes["trainer"]["busy_fraction"] == pytest.approx(8.0 / 17)
    # Engine start is not rollout (or any) work; waits before start-up ended are not counted either.
    assert (
        lanes["explorer-0"]["kinds_s"]["rollout"] == pytest.approx(13.0)
        and lanes["explorer-0"]["kinds_s"]["engine_start"] == 20.0
    )
    assert lanes["explorer-0"]["wait_s"] == 0.0 and u["explorer_wait_for_sync_s"] == 0.0
    assert lanes["trainer"]["wait_s"] == pytest.approx(1.0 + 8.0)  # 30-31, then 1 s after each step
    md = summary_markdown(u)
    assert "| explorer-1 | 76.5% | 13.00 | 0.00 | 13.00 | 0.00 | 0.00 | 0.00 | 30.00 |" in md
    assert "of which start-up (until the last engine was up): 30.00 s" in md


def test_a_resumed_attempts_engine_start_is_not_the_runs_start_up():
    resumed = LONG_STARTUP + [
        _s("explorer-0", "engine_start", 47, 60, None, 0),
        _s("explorer-0", "rollout", 60, 61, 10, 8),
    ]
    assert startup_end(resumed) == T0 + 30
    u = utilization(resumed)
    assert u["startup_s"] == 30.0 and u["lanes"]["explorer-0"]["busy_s"] == pytest.approx(13.0)  # 12 + rollout 10
    assert u["lanes"]["explorer-0"]["engine_start_s"] == 33.0
    assert startup_end(HAND_MADE) == T0  # no engine_start spans: no start-up


def test_lane_order():
    assert lane_order(["trainer", "explorer-10", "buffer", "explorer-2", "other"]) == [
        "explorer-2",
        "explorer-10",
        "buffer",
        "trainer",
        "other",
    ]


# --------------------------------------------------------------------------- rendering


def _pixels(png: bytes):
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    return img, Counter(img.getdata())


def _has_color(counts, hex_color, min_pixels=200):
    rgb = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return counts[rgb] >= min_pixels


def test_render_gantt_png(tmp_path):
    out = tmp_path / "g.png"
    spans = HAND_MADE + [_s("trainer", "sync", 9, 9.5, 2, 2, "checkpoint")]
    data = render_gantt(spans, str(out), title="hand made")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and out.read_bytes() == data
    img, counts = _pixels(data)
    assert img.width > 800 and img.height > 200
    assert len(counts) > 50  # text, hatching, antialiasing: not a blank canvas
    # Every kind is drawn in its own colour (bars + legend patches).
    for color in ("#4E79A7", "#F28E2B", "#B07AA1", "#59A14F", "#EDC948"):
        assert _has_color(counts, color), color
    with pytest.raises(UserError, match="no spans"):
        render_gantt([], None)


def test_gantt_has_a_second_panel_of_the_last_steps_after_a_long_start_up(tmp_path):
    # The zoomed panel starts where trainer step 3 ended (the last 5 of 8 steps follow) and ends with the run.
    assert last_steps_window(LONG_STARTUP) == (T0 + 36, T0 + 47)
    fig = gantt_figure(LONG_STARTUP, title="long start-up")
    full, zoom = fig.axes
    assert full.get_xlim() == pytest.approx((0.0, 47.0 * 1.01))
    assert zoom.get_xlim() == pytest.approx((36.0, 47.0 + 0.11))
    assert zoom.get_title(loc="left") == "the last 5 trainer steps (from 36.0 s on)"
    assert [t.get_text() for t in full.get_legend().get_texts()] == ["engine start", "rollout", "train", "waiting"]
    assert zoom.get_legend() is None
    # Only what overlaps the window is drawn below: the bars there are rollouts 5-9 (x2) and trainer steps.
    assert len(zoom.patches) == sum(1 for s in LONG_STARTUP if s.end >= T0 + 36 and s.start <= T0 + 47.11)
    img, counts = _pixels(render_gantt(LONG_STARTUP, str(tmp_path / "g.png")))
    assert _has_color(counts, "#76B7B2")  # engine start in its own colour
    assert img.height > 2 * 200
    # A short run with no start-up needs one panel only; a run of few steps after a start-up gets
    # the time after start-up below.
    assert len(gantt_figure(HAND_MADE).axes) == 1 and last_steps_window(HAND_MADE) is None
    short = [s for s in LONG_STARTUP if s.step is None or s.step <= 3]
    assert last_steps_window(short) == (T0 + 30, max(s.end for s in short))
    assert gantt_figure(short).axes[1].get_title(loc="left").startswith("the last 3 trainer steps")


def test_cli_main_on_run_dir(tmp_path, capsys):
    run = tmp_path / "synchronous-1"
    for comp in ("explorer-0", "trainer"):
        rec = TimelineRecorder(*open_storage(str(run)), component=comp)
        for span in HAND_MADE:
            if span.component == comp:
                rec.add(span)
        rec.flush()
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "| explorer-0 | 80.0% |" in out and "| trainer | 30.0% |" in out
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(run), "--out", str(tmp_path / "x.png"), "--title", "t"]) == 0
    assert (tmp_path / "x.png").is_file()
    with pytest.raises(UserError, match="no timeline spans"):
        main([str(tmp_path / "empty")])
    with pytest.raises(UserError, match="storage-options"):
        main([str(run), "--storage-options", "{nope"])


def test_load_spans_tolerates_new_keys_and_names_a_bad_file(tmp_path):
    d = tmp_path / "run" / "timeline" / "component=trainer"
    d.mkdir(parents=True)
    (d / "part-1.jsonl").write_text(
        '{"component": "trainer", "kind": "train", "start": 1.0, "end": 2.0, "step": 1, "gpu": 0}\n'
    )
    (d / ".tmp-123").write_text("half written")  # a writer's temp file is never read
    assert [_key(s) for s in load_spans(str(tmp_path / "run"))] == [("trainer", "train", 1.0, 2.0, 1, None, None)]
    (d / "part-2.jsonl").write_text('{"component": "trainer"}\n')
    with pytest.raises(ValueError, match=r"part-2.jsonl: line 1: not a timeline span"):
        load_spans(str(tmp_path / "run"))


def test_a_workflow_rollout_is_labelled_with_its_turns():
    from rl_engine.run.timeline import Span, _label

    assert _label(Span("explorer-0", "rollout", 0.0, 1.0, step=3, version=2, turns=1.5)) == "3·1.5t"
    assert _label(Span("explorer-0", "rollout", 0.0, 1.0, step=3, version=2)) == "3"
