"""The trainer role: the DeepSpeed trainer fed from the buffer, with resumable state.

`TrainerRole.step()` is one trainer step: wait for `train_batch_size` committed experiences (FIFO,
whole groups, within `max_staleness` if set), train on them, post the new version on the
control board. `publish(version)` announces a version on the board and sends it to the
explorers by the configured method: at a rendezvous it waits until every explorer acknowledged
loading it; in the decoupled modes a background thread sends a snapshot while training goes on
(a failed background send is raised by the next `publish` or by `finish`). `save_state()` writes
`trainer_state/step=<t>/` with the buffer cursor in it, so a resumed trainer consumes exactly
what it consumed after step t and nothing before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow.compute as pc

from rl_engine.board import TRAINER, TRAINER_KEY, Stopped, StopSignal
from rl_engine.buffer import BufferReader
from rl_engine.config import DecoupledSync
from rl_engine.run import retention
from rl_engine.run.context import RunContext
from rl_engine.run.lease import Fence
from rl_engine.run.state import STATE_DIR, latest_state_step
from rl_engine.run.timeline import STARTUP, TimelineRecorder
from rl_engine.sync import build_weight_sender, drop_versions_from
from rl_engine.trainer import build_trainer, trainer_settings


def token_versions(batch: Any, trainer_version: int) -> dict[str, float]:
    """How old the trained tokens are: the version gap (trainer version at training time minus
    each token's version) and the fraction of tokens from an older version than the newest
    segment of their own trajectory (mixed versions under partial rollouts)."""
    table = batch.to_table()
    lengths = pc.list_value_length(table.column("versions")).to_numpy()  # [B]
    versions = pc.list_flatten(table.column("versions")).to_numpy().astype(np.int64)  # [T]
    if not len(versions):
        return {"version_gap_mean": 0.0, "version_gap_max": 0, "tokens_older_fraction": 0.0}
    newest = np.repeat(
        np.maximum.reduceat(versions, (np.cumsum(lengths) - lengths)[lengths > 0]), lengths[lengths > 0]
    )  # [T]
    gap = trainer_version - versions
    return {
        "version_gap_mean": float(gap.mean()),
        "version_gap_max": int(gap.max()),
        "tokens_older_fraction": float((versions < newest).mean()),
    }


def host_snapshot(named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Copies of (name, tensor) pairs in host memory, taken one tensor at a time: a decoupled send
    reads them while training goes on, and the device holds no second copy of the model (the
    sender moves one bucket at a time back to the group's device)."""
    return [(n, t.detach().to("cpu", copy=True)) for n, t in named]


class TrainerRole:
    """Trainer + buffer reader + checkpoints of one run."""

    def __init__(
        self,
        run: RunContext,
        resume: bool = False,
        stop: StopSignal | None = None,
        fence: Fence | None = None,
        local_device: int = 0,
    ):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        self.fence = fence or Fence(*run.fs(), None)  # checked before each update and state written
        self.timeline = TimelineRecorder(*run.fs(), TRAINER)
        self.board = run.board
        with self.timeline.span(STARTUP, version=0):  # the DeepSpeed engine: start-up, before step 1
            self.trainer = build_trainer(
                trainer_settings(cfg, local_device)
            )  # alone in its process: on the plan's device
        # Decoupled modes: batches in the order admission control numbered them (rl_engine.schedule.batch_number).
        self.reader = BufferReader(
            *run.fs(),
            cfg.buffer,
            explorers=cfg.explorer.count if isinstance(cfg.synchronizer, DecoupledSync) else None,
        )
        self.resumed_from: int | None = None
        if resume and (t := latest_state_step(run)) is not None:
            extra = self.trainer.load_state(self._state_url(t), run.storage_options)
            self.reader.load_state_dict(extra["cursor"])
            self.resumed_from = t
        self.state_version = self.resumed_from or 0  # the latest version with resumable state
        if (
            resume
        ):  # the stopped attempt's published weights from here on: published again, each announced before it is written
            drop_versions_from(cfg, *run.fs(), self.resumed_from or 0)
        self.published = -1
        self._sending: threading.Thread | None = None
        self._skipped: int | None = None  # a decoupled publish skipped while a send was in flight
        self._send_error: tuple[int, BaseException] | None = None
        self._post()
        self.sender = build_weight_sender(
            cfg, self.board, pinned=lambda: retention.lineage_model(run), device=self.trainer.device
        )  # prunes checkpoints/ itself
        self.sender.connect(stop)  # collective: blocks until every explorer's workers joined the group

    def _lost_rows(self) -> int:
        c = self.reader.stats  # rows the reader dropped or skipped: the explorers make up for them
        return int(c.get("dropped_stale", 0)) + int(c.get("skipped_corrupt_rows", 0))

    def _post(self) -> None:
        self._posted_lost = self._lost_rows()
        self.board.post(
            TRAINER_KEY, {"version": self.version, "published": self.published, "lost_rows": self._posted_lost}
        )

    def _post_lost(self) -> None:
        """While the trainer waits for a batch: rows dropped meanwhile must reach the explorers now,
        or they stop one batch short of the run's end and the trainer waits out its read timeout."""
        if self._lost_rows() != self._posted_lost:
            self._post()

    def _while_waiting(self, stop: StopSignal | None) -> None:
        """The trainer waits for a batch: post rows dropped meanwhile, and publish the version whose
        publish was skipped while an earlier send was in flight, once that send is done (the
        explorers may need it to start the very batch the trainer waits for: admission control)."""
        self._post_lost()
        if (
            self._skipped == self.version
            and stop is not None
            and (self._sending is None or not self._sending.is_alive())
        ):
            self.publish(self.version, stop, wait_for_explorers=False)

    @property
    def version(self) -> int:
        return self.trainer.version

    def _state_url(self, t: int) -> str:
        return f"{self.run.url}/{STATE_DIR}/step={t}"

    def step(self, stop: StopSignal | None = None, announce: bool = False) -> dict[str, Any]:
        """One trainer step; returns its metrics (loss, kl, staleness, waits, ...). With `announce`
        (a rendezvous publishes the new version right after) the board post of the new version
        says it is published too: the explorers start joining its broadcast while the step is
        recorded, and `publish` posts nothing more."""
        cfg, t = self.cfg, self.version + 1
        started = time.time()
        with self.timeline.span("wait", step=t, version=self.version):
            # Only the decoupled modes have a max_staleness; the rendezvous schedule bounds staleness itself.
            bound = cfg.synchronizer.max_staleness if isinstance(cfg.synchronizer, DecoupledSync) else None
            batch = self.reader.read_batch(
                cfg.trainer.train_batch_size, self.version, bound, stop=stop, on_wait=lambda: self._while_waiting(stop)
            )
        waited = time.time() - started
        staleness = self.version - batch.min_versions()  # [B] versions behind at training time
        self.fence.check()  # a trainer whose driver lost the run's lease publishes no new version
        with self.timeline.span("train", step=t, version=self.version):
            metrics = self.trainer.train_step(batch.to_tensors(self.trainer.pad_token_id))
        if announce:
            self.published = self.version
        self._post()
        self.timeline.flush()
        rewards = batch.column("reward")
        return {
            **metrics,
            "step": t,
            "version": self.version,
            "reward_mean": float(np.mean(rewards)),
            "reward_std": float(np.std(rewards)),
            "staleness_max": int(staleness.max()),
            "staleness_mean": float(staleness.mean()),
            "staleness_hist": {int(s): int(c) for s, c in zip(*np.unique(staleness, return_counts=True))},
            **token_versions(batch, self.version - 1),
            "explorer_steps": sorted({int(x) for x in batch.column("explorer_step")}),
            "wait_experience_s": waited,
            "train_s": time.time() - started - waited,
            "buffer": dict(self.reader.stats),
        }

    def save_state(self) -> str:
        """Write resumable trainer state (with the buffer cursor) for the current version."""
        url = self._state_url(self.version)
        self.fence.check()
        with self.timeline.span("write", step=self.version, version=self.version):
            self.trainer.save_state(url, self.run.storage_options, extra={"cursor": self.reader.state_dict()})
            retention.prune_states(self.run)  # trainer.keep_last_states
        self.state_version = self.version
        return url

    def save_model(self) -> str:
        """Write the current policy as a Hugging Face model (safetensors) to `<run>/model/`."""
        url = f"{self.run.url}/model"
        with self.timeline.span("write", step=self.version, version=self.version):
            self.trainer.save_hf(url, self.run.storage_options)
        return url

    # ---- weight sync

    def _send(self, named: Any, version: int, stop: StopSignal) -> None:
        with self.timeline.span("wait", step=version, version=version):
            self.sender.prepare(version, stop)  # collective: every explorer joined the broadcast
        with self.timeline.span("sync", step=version, version=version, method=self.sender.method):
            self.sender.send(named, version)
        self.timeline.flush()

    def _send_in_background(self, named: Any, version: int, stop: StopSignal) -> None:
        try:
            self._send(named, version, stop)
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the trainer loop by _raise_send_error
            self._send_error = (version, e)

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            version, e = self._send_error
            raise RuntimeError(
                f"sending weights version {version} to the explorers failed: {type(e).__name__}: {e}"
            ) from e

    def _announce(self, version: int) -> None:
        self.published = version
        self._post()  # explorers now ask for this version

    def publish(self, version: int, stop: StopSignal, wait_for_explorers: bool = True) -> float:
        """Send weights `version` to the explorers; returns seconds spent in this call."""
        started = time.time()
        self._raise_send_error()
        if stop.is_set():
            raise Stopped(f"stopped before publishing version {version}")
        if wait_for_explorers:
            if self.published != version:  # else the step posted it (`step(announce=True)`)
                self._announce(version)
            self._send(self.trainer.named_weights(), version, stop)
            with self.timeline.span("wait", step=version, version=version):
                self.sender.wait_loaded(version, stop)
        elif self._sending is None or not self._sending.is_alive():
            # Decoupled: train on while a snapshot waits for the explorers to take it between their steps.
            self._skipped = None
            snapshot = host_snapshot(self.trainer.named_weights())
            self._announce(version)
            self._sending = threading.Thread(
                target=self._send_in_background, args=(snapshot, version, stop), name=f"send-v{version}", daemon=True
            )
            self._sending.start()
        else:
            # The explorers have not taken the previous version yet: skip this one rather than make
            # the trainer wait; it goes out once that send is done if the trainer is still at it
            # then, waiting for a batch (_while_waiting), else at the next publish.
            self._skipped = version
        return time.time() - started

    def finish(self) -> None:
        """End of training: wait for a decoupled send still in flight and raise its failure, if any."""
        if self._sending is not None:
            with self.timeline.span("wait", version=self.version):
                self._sending.join(self.cfg.synchronizer.wait_timeout_s)
            if self._sending.is_alive():
                raise RuntimeError(
                    f"sending weights version {self.published} did not finish within synchronizer.wait_timeout_s = {self.cfg.synchronizer.wait_timeout_s} s"
                )
            self._sending = None
        self._raise_send_error()

    def close(self) -> None:
        """Release the sync (explorers still waiting for a broadcast are released) and post `closed`."""
        self.board.post(TRAINER_KEY, {"version": self.version, "published": self.published, "closed": True})
        self.sender.close()
        self.trainer.close()
        self.timeline.flush()
