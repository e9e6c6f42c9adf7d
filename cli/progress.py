"""What `rft run` and `rft demo` show on the terminal while a run goes: one progress line (trainer
step / total, latest reward, seconds per step, ETA, and with a reward that asks a service, the
service's latest time per request) instead of the engines' and libraries' logs,
which go to `<run>/logs/engines.log`; and a line for work in stages (`StageLine`: `rft demo
--model smollm2`'s held-out scoring).

The progress follows the run's storage (the trainer's per-step metrics, `<run>/metrics/role=trainer/`),
never live objects, so it reads the same whether the roles are tasks of this process or flow runs
on a worker. On a TTY the line is redrawn in place; elsewhere (a pipe, CI) a plain line is printed
every `monitor.log_every` trainer steps.

For the run, this process's stdout and stderr descriptors point at the log file (every child
inherits them; rl_engine/proc/logfile.py says why), and the terminal keeps a duplicate for the
progress line; both are restored before the run's error or summary is printed.

    with run_log(url, opts) as log, terminal_to(log) as term, follow(url, opts, total, 1, term):
        run_config(cfg)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from rl_engine.run.report import METRICS_DIR
from rl_engine.storage import is_local, join, open_storage, read_json


def fmt_duration(s: float) -> str:
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressLine:
    """The line's state and text: steps seen with the time they were seen, the latest reward."""

    WIDTH = 20  # characters of the bar

    def __init__(self, out: TextIO, total: int, every: int, tty: bool, clock: Any = time.monotonic):
        self.out, self.total, self.every, self.tty, self.clock = out, total, every, tty, clock
        self.started = clock()
        self.first: tuple[float, int] | None = None  # (time, step) of the first step seen: the rate excludes start-up
        self.step, self.reward, self.seen_at = 0, None, self.started
        self.service: str | None = None  # the reward service's latest figures (reward_service_text)
        self.printed = -1  # the step of the last plain line (non-TTY)

    def seen(self, step: int, reward: float | None) -> None:
        if step <= self.step and self.first is not None:
            return
        now = self.clock()
        if self.first is None:
            self.first = (now, step)
        self.step, self.reward, self.seen_at = step, reward, now

    def seconds_per_step(self) -> float | None:
        if self.first is None or self.step <= self.first[1]:
            return None
        return (self.seen_at - self.first[0]) / (self.step - self.first[1])

    def text(self) -> str:
        if self.first is None:
            return f"step 0/{self.total}  starting: engines and Prefect ({self.clock() - self.started:.0f} s)"
        done = int(self.WIDTH * min(self.step, self.total) / self.total)
        sps = self.seconds_per_step()
        reward = "-" if self.reward is None else f"{self.reward:.3f}"
        eta = "--:--:--" if sps is None else fmt_duration(sps * max(self.total - self.step, 0))
        rate = "" if sps is None else f"  {sps:.1f} s/step"
        service = "" if self.service is None else f"  {self.service}"
        return f"step {self.step}/{self.total} [{'#' * done}{'.' * (self.WIDTH - done)}] {100 * self.step // self.total:3d}%  reward {reward}{rate}{service}  ETA {eta}"

    def draw(self, final: bool = False) -> None:
        """TTY: redraw in place. Otherwise: a line at the first step, every `every` steps and at the end."""
        if self.tty:
            self.out.write("\r" + self.text() + "\x1b[K" + ("\n" if final else ""))
        elif self.first is not None and self.step != self.printed:
            crossed = self.step // self.every > self.printed // self.every
            if self.printed < 0 or crossed or self.step >= self.total or final:
                self.out.write(self.text() + "\n")
                self.printed = self.step
        self.out.flush()


def latest_metrics(fs: Any, root: str, role: str) -> tuple[str, dict[str, Any]] | None:
    """(path, metrics) of `role`'s newest step metrics on the run's storage, or None before its first step."""
    paths = fs.glob(join(root, METRICS_DIR, f"role={role}", "step=*.json"))
    return (max(paths), read_json(fs, max(paths))) if paths else None


def latest_trainer_step(fs: Any, root: str) -> tuple[int, float | None] | None:
    """(step, reward_mean) of the newest trainer metrics on the run's storage, or None before step 1."""
    fs.invalidate_cache()
    if (latest := latest_metrics(fs, root, "trainer")) is None:
        return None
    path, m = latest
    return int(m.get("step", path.rsplit("=", 1)[-1].split(".")[0])), m.get("reward_mean")


# A reward that asks a service reports its latency per request (and the model's batch size) in
# the explorer's step metrics (rl_engine/rewards/reward_model.py, judge.py, code_tests.py).
SERVICE_REWARDS = ("model", "judge", "code_tests")  # taskset.reward.type
SERVICES = {  # metric prefix: (label, its time per unit, the unit, its batch size)
    "reward/model/": ("reward model", "latency_ms", "request", "batch_size"),
    "reward/judge/": ("judge", "latency_ms", "request", None),
    "reward/sandbox/": ("sandbox", "run_ms_mean", "run", None),
}


def reward_service_text(metrics: dict[str, Any]) -> str | None:
    """What the progress line says of the reward service in an explorer step's metrics (e.g.
    `reward model 85 ms/request, batch 16`); None for a reward without a service, or no figure yet."""
    import math

    for prefix, (label, latency, per, batch) in SERVICES.items():
        ms = metrics.get(prefix + latency)
        if isinstance(ms, (int, float)) and math.isfinite(ms):
            size = metrics.get(prefix + batch) if batch else None
            text = f"{label} {ms:.0f} ms/{per}"
            return text + (f", batch {size:.0f}" if isinstance(size, (int, float)) and math.isfinite(size) else "")
    return None


@contextlib.contextmanager
def follow(
    run_url: str,
    storage_options: dict[str, Any] | None,
    total: int,
    every: int,
    out: TextIO,
    poll_s: float | None = None,
    reward_service: bool = False,
) -> Iterator[ProgressLine]:
    """Draw the run's progress on `out` from a background thread until the block ends, then once
    more; with `reward_service` (the run's reward asks a service) the line also shows its latency."""
    fs, root = open_storage(run_url, storage_options)
    line = ProgressLine(out, total, every, out.isatty())
    poll = poll_s if poll_s is not None else (0.5 if is_local(fs) else 2.0)
    done = threading.Event()

    def tick() -> None:
        try:
            if (latest := latest_trainer_step(fs, root)) is not None:
                line.seen(*latest)
            if reward_service and (explorer := latest_metrics(fs, root, "explorer-0")) is not None:
                line.service = reward_service_text(explorer[1]) or line.service
        except Exception:  # noqa: BLE001 - a file being written, or a storage hiccup: the next tick reads it
            pass
        line.draw()

    def loop() -> None:
        while not done.wait(poll):
            tick()

    thread = threading.Thread(target=loop, name="rft-progress", daemon=True)
    thread.start()
    try:
        yield line
    finally:
        done.set()
        thread.join(timeout=10)
        tick()
        line.draw(final=True)


class StageLine:
    """One line for work done in stages, each of a length no one knows ahead (held-out scoring:
    the engine's start, greedy samples, temperature-1 samples): `what`, a bar of the stages done,
    the current stage and the seconds so far. On a TTY it is redrawn in place (every second while
    a stage runs) and its last state ends with the result; elsewhere one line when the work
    starts and one with the result.

        with StageLine(term, "scoring the base model on 320 held-out problems", 3) as line:
            line.stage("starting the engine", 0); ...; line.stage("greedy", 1); ...
            line.result = "greedy 3.1%, temperature 1 2.8%"
    """

    WIDTH = 12  # characters of the bar

    def __init__(self, out: TextIO, what: str, stages: int, clock: Any = time.monotonic, tick_s: float = 1.0):
        self.out, self.what, self.stages, self.clock, self.tick_s = out, what, stages, clock, tick_s
        self.tty = out.isatty()
        self.name, self.done, self.result = "", 0, ""
        self.started = clock()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def text(self) -> str:
        bar = int(self.WIDTH * self.done / self.stages)
        return f"{self.what} [{'#' * bar}{'.' * (self.WIDTH - bar)}] {self.name} ({self.clock() - self.started:.0f} s)"

    def stage(self, name: str, done: int) -> None:
        """Stage `name` starts, `done` of the stages behind."""
        self.name, self.done = name, done
        self._draw()

    def _draw(self) -> None:
        if self.tty:
            with self._lock:
                if not self._stop.is_set():  # the result line is written: nothing after it
                    self.out.write("\r" + self.text() + "\x1b[K")
                    self.out.flush()

    def __enter__(self) -> StageLine:
        if self.tty:
            threading.Thread(target=self._tick, name="rft-stage-line", daemon=True).start()
        else:
            self.out.write(f"{self.what} ...\n")
            self.out.flush()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._draw()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        seconds = self.clock() - self.started
        end = (
            f"{self.what}: {self.result} ({seconds:.0f} s)"
            if self.result
            else f"{self.what}: stopped ({seconds:.0f} s)"
        )
        with self._lock:
            self.out.write(("\r" + end + "\x1b[K" if self.tty else end) + "\n")
            self.out.flush()
