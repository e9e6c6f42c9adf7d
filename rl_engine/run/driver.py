"""The driver of one attempt of a run: preflight, the run's lease, its lineage, the start marker
and the device plan (`<run>/devices.json`), and at the end the buffer sweep and the lineage's record. Prefect-free; a mode's flow calls each
step as a task of its flow run (tasks/run.py), so the UI shows them in the run's graph.

    with RunDriver(cfg, resume=None, mode="synchronous") as driver:
        driver.check()                # preflight: nothing starts on a bad input
        run, attempt = driver.start()  # lease, lineage, run directory, start marker
        ...                           # the roles run (entry points in rl_engine/roles/entry.py)
        driver.sweep()                # the roles have stopped: uncommitted buffer files go
        driver.record("completed")    # a lineage's run is recorded, its latest.json moved
    # leaving the block releases the run's lease and the lineage's lock

One driver per run: the lease (rl_engine/run/lease.py) refuses a second driver, and a driver that
lost its lease sweeps and records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl_engine.buffer.sweep import remove_uncommitted
from rl_engine.config import RFTConfig
from rl_engine.errors import UserError
from rl_engine.run.context import ResumePoint, RunContext, open_run, post_start, resume_point, start_run
from rl_engine.run.devices import device_plan, record_plan
from rl_engine.run.lease import RunLease
from rl_engine.run.lineage import LineageRun
from rl_engine.run.lineage import begin as begin_lineage
from rl_engine.run.preflight import check_not_complete, preflight
from rl_engine.run.state import latest_state_step
from rl_engine.run.storage_checks import check_reachable


class RunDriver:
    """One attempt of a run (new, or `resume` = the run's URL) in the `mode` its flow runs."""

    def __init__(
        self,
        cfg: RFTConfig,
        resume: str | None,
        mode: str,
        source: str = "the config",
        log: Callable[[str], Any] = print,
    ):
        if resume is None and cfg.name is None:
            raise ValueError("RunDriver of a new run needs cfg.name set (the flow run's name)")
        self.cfg, self.resume, self.mode, self.source, self.log = cfg, resume, mode, source, log
        self.stored: RunContext | None = None  # the resumed run as stored, before this attempt
        self.lease: RunLease | None = None
        self.lineage: LineageRun | None = None
        self.run: RunContext | None = None
        self.attempt: str | None = None

    def __enter__(self) -> RunDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> None:
        """Preflight before anything starts: a new run's inputs; for a resume, that its storage
        answers, the run is not complete, and no other driver holds it (its lease is taken here)."""
        if self.resume is None:
            preflight(self.cfg, None, self.source)
            return
        opts = self.cfg.buffer.storage.fs_options()
        check_reachable(self.resume, opts)
        self.stored = open_run(self.resume, opts)
        check_not_complete(self.stored.url, self.stored.cfg)
        # One driver per run: a second resume of a run still going is refused before it touches anything.
        self.lease = RunLease(*self.stored.fs()).acquire()

    def start(self) -> tuple[RunContext, str]:
        """Join the lineage (a new run of one starts from its latest model, on its unused tasks),
        create or reopen the run, hold its lease and post the attempt's start marker that every
        role reads; returns the run and the attempt id."""
        if self.resume is not None and self.stored is None:
            raise RuntimeError("RunDriver.start of a resume before check()")
        stored = self.stored
        self.lineage = begin_lineage(stored.cfg if stored else self.cfg, new=stored is None, log=self.log)
        cfg = self.lineage.cfg if self.lineage and not stored else self.cfg
        if cfg.synchronizer.mode != self.mode:
            raise UserError(
                f"synchronizer.mode = {cfg.synchronizer.mode!r}, but this is the {self.mode!r} flow; run the {cfg.synchronizer.mode!r} deployment or set the mode"
            )
        if stored is None:
            run = start_run(cfg)
            at = ResumePoint(0, {i: 1 for i in range(run.cfg.explorer.count)})
        else:
            run = stored  # opened by check(), with the same storage options
            run.board.clear()  # the crashed attempt's markers must not be seen
            at = resume_point(run, latest_state_step(run) or 0)
            self.log(
                f"resuming {run.url}: trainer from version {at.trainer_version}, explorers from steps {at.first_steps}"
            )
        self.lease = self.lease or RunLease(*run.fs()).acquire()
        self.run = run
        self.attempt = post_start(run.board, at, self.lease.generation)
        plan = device_plan(run.cfg)
        record_plan(*run.fs(), plan, self.attempt)  # <run>/devices.json: where this attempt's roles run
        self.log(plan.describe())
        self.log(run.cfg.algorithm.describe())
        if self.lineage and (carried := self.lineage.adopt(run)):
            self.log(
                f"lineage {self.lineage.name}: continuing {sum(map(len, carried.values()))} pending generations of {self.lineage.previous['run']}"
            )
        return run, self.attempt

    def sweep(self) -> list[str]:
        """Every role has stopped: delete the buffer files no commit record names (a killed
        writer's), unless this driver lost the run's lease (then nothing is touched)."""
        run, lease = self._started()
        lease.check()
        return remove_uncommitted(*run.fs())

    def record(self, status: str) -> dict[str, Any] | None:
        """The run's entry in its lineage's runs.jsonl (`completed` also moves latest.json to it);
        None for a run of no lineage."""
        run, _ = self._started()
        return self.lineage.end(run, status) if self.lineage else None

    def close(self) -> None:
        """Release the run's lease and the lineage's lock (idempotent)."""
        lease, lineage, self.lease, self.lineage = self.lease, self.lineage, None, None
        try:
            if lease is not None:
                lease.release()
        finally:
            if lineage is not None:
                lineage.release()

    def _started(self) -> tuple[RunContext, RunLease]:
        if self.run is None or self.lease is None:
            raise RuntimeError("RunDriver: start() first")
        return self.run, self.lease
