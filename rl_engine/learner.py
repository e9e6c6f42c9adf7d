"""The learner: the DeepSpeed trainer fed from the buffer, with resumable state.

`Learner.step()` is one trainer step: wait for `train_batch_size` committed experiences (FIFO,
whole groups, within `max_staleness` if set), train on them, post the new version on the
control board. `publish(version)` sends the weights to the explorers: at a rendezvous it waits
until every explorer acknowledged loading them; in the decoupled modes it does not wait (with
collective sync a background thread holds a snapshot and broadcasts it when the explorers join). `save_state()` writes `trainer_state/step=<t>/` with the buffer cursor in it, so a
resumed learner consumes exactly what it consumed after step t and nothing before.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from rl_engine.buffer import BufferReader
from rl_engine.control import Board, Stopped
from rl_engine.run import RunContext
from rl_engine.storage import join
from rl_engine.sync import build_weight_sender
from rl_engine.timeline import TimelineRecorder
from rl_engine.trainer import build_trainer
from rl_engine.trainer.checkpoint import COMMIT_MARKER

STATE_DIR = "trainer_state"


def latest_state_step(run: RunContext) -> int | None:
    """Highest trainer step with a committed trainer state, or None."""
    fs, root = run.fs()
    steps = []
    for p in fs.glob(join(root, STATE_DIR, "step=*", COMMIT_MARKER)):
        steps.append(int(p.rsplit("step=", 1)[1].split("/")[0]))
    return max(steps, default=None)


class Learner:
    """Trainer + buffer reader + checkpoints of one run."""

    def __init__(self, run: RunContext, resume: bool = False):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        self.timeline = TimelineRecorder(run.url, run.storage_options, "trainer")
        self.board = Board(run.url, run.storage_options, cfg.buffer.poll_interval_s)
        self.trainer = build_trainer(cfg)
        self.reader = BufferReader(run.url, run.storage_options, cfg.buffer)
        self.resumed_from: int | None = None
        if resume and (t := latest_state_step(run)) is not None:
            extra = self.trainer.load_state(self._state_url(t), run.storage_options)
            self.reader.load_state_dict(extra["cursor"])
            self.resumed_from = t
        self.published = -1
        self._went = -1  # last version whose broadcast got its "go"
        self._sending: threading.Thread | None = None
        self._post()
        self.sender = build_weight_sender(cfg)
        self.sender.connect()  # collective: blocks until every explorer's workers joined the group

    def _post(self) -> None:
        self.board.post("trainer", {"version": self.version, "published": self.published})

    @property
    def version(self) -> int:
        return self.trainer.version

    def _state_url(self, t: int) -> str:
        return f"{self.run.url}/{STATE_DIR}/step={t}"

    def step(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """One trainer step; returns its metrics (loss, kl, staleness, waits, ...)."""
        cfg, t = self.cfg, self.version + 1
        started = time.time()
        with self.timeline.span("wait", step=t, version=self.version):
            # max_staleness is only ever set in the decoupled modes (the config rejects it elsewhere).
            batch = self.reader.read_batch(cfg.trainer.train_batch_size, self.version, cfg.synchronizer.max_staleness, stop=stop)
        waited = time.time() - started
        staleness = self.version - batch.min_versions()  # [B] versions behind at training time
        with self.timeline.span("train", step=t, version=self.version):
            metrics = self.trainer.train_step(batch.to_tensors(self.trainer.pad_token_id))
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
            "explorer_steps": sorted({int(x) for x in batch.column("explorer_step")}),
            "wait_experience_s": waited,
            "train_s": time.time() - started - waited,
            "buffer": dict(self.reader.stats),
        }

    def save_state(self) -> str:
        """Write resumable trainer state (with the buffer cursor) for the current version."""
        url = self._state_url(self.version)
        with self.timeline.span("write", step=self.version, version=self.version):
            self.trainer.save_state(url, self.run.storage_options, extra={"cursor": self.reader.state_dict()})
        return url

    def save_model(self) -> str:
        """Write the current policy as a Hugging Face model (safetensors) to `<run>/model/`."""
        url = f"{self.run.url}/model"
        with self.timeline.span("write", step=self.version, version=self.version):
            self.trainer.save_hf(url, self.run.storage_options)
        return url

    # ---- weight sync

    def _send(self, named: Any, version: int, stop: threading.Event) -> None:
        if self.sender.method == "collective":
            self._handshake(version, stop)
        with self.timeline.span("sync", step=version, version=version, method=self.sender.method):
            self.sender.send(named, version)
        self.timeline.flush()

    def _handshake(self, version: int, stop: threading.Event) -> None:
        """Enter a broadcast only once every explorer committed to it (see Explorer._install)."""
        try:
            with self.timeline.span("wait", step=version, version=version):
                for i in range(self.cfg.explorer.count):
                    self.board.wait(f"explorer-{i}-joining", lambda m: m["version"] >= version, what=f"explorer {i} to join the broadcast of version {version}", timeout_s=self.cfg.synchronizer.wait_timeout_s, stop=stop)
        except BaseException:
            self.board.post("sync", {"abandon": version})
            raise
        self.board.post("sync", {"go": version})
        self._went = version

    def _send_in_background(self, named: Any, version: int, stop: threading.Event) -> None:
        try:
            self._send(named, version, stop)
        except Stopped:
            pass

    def publish(self, version: int, stop: threading.Event, wait_for_explorers: bool = True) -> float:
        """Send weights `version` to the explorers; returns seconds spent in this call."""
        started, s = time.time(), self.cfg.synchronizer
        if stop.is_set():
            raise Stopped(f"stopped before publishing version {version}")
        if s.sync_method == "checkpoint":
            self._send(self.trainer.named_weights(), version, stop)  # committed before it is announced
            self.published = version
            self._post()
        elif wait_for_explorers:
            self.published = version
            self._post()  # explorers at this sync point now join the broadcast
            self._send(self.trainer.named_weights(), version, stop)
        elif self._sending is not None and self._sending.is_alive():
            # Decoupled: the explorers have not yet joined the previous broadcast; skip this
            # version rather than make the trainer wait (they get a newer one later).
            return 0.0
        else:
            # Decoupled: train on while a snapshot waits for the explorers to join between their steps.
            snapshot = [(n, t.detach().clone()) for n, t in self.trainer.named_weights()]
            self.published = version
            self._post()
            self._sending = threading.Thread(target=self._send_in_background, args=(snapshot, version, stop), name=f"send-v{version}", daemon=True)
            self._sending.start()
        if wait_for_explorers:
            with self.timeline.span("wait", step=version, version=version):
                for i in range(self.cfg.explorer.count):
                    self.board.wait(f"explorer-{i}", lambda m: m["version"] >= version, what=f"explorer {i} to load version {version}", timeout_s=s.wait_timeout_s, stop=stop)
        return time.time() - started

    def _finish_background_send(self) -> None:
        """Wait for the previous decoupled broadcast (explorers join it between their steps)."""
        if self._sending is not None:
            with self.timeline.span("wait", version=self.version):
                self._sending.join(self.cfg.synchronizer.wait_timeout_s)
            self._sending = None

    def close(self) -> None:
        self._finish_background_send()
        if self.sender.method == "collective" and self.published > self._went:
            # Announced but never broadcast (the trainer failed or stopped): release joined explorers.
            self.board.post("sync", {"abandon": self.published})
        self.board.post("trainer", {"version": self.version, "published": self.published, "closed": True})
        self.sender.close()
        self.timeline.flush()
