"""`reward: {type: model}`: a Hugging Face sequence classifier (one score) as the reward, served by
a reward service process (rl_engine.rewards.reward_model_server) that the run's explorers share.

    reward: {type: model, path: runs/models/rm, batch_size: 16, max_length: 1024, timeout_s: 60}

`ModelRewardFn` is the explorer's side. Building it only checks `path` (preflight builds one: a
directory that is not a sequence classifier with one label fails the run before anything starts);
the service is started on the first scoring call. Services are kept per process, one per model
setting (rl_engine.rewards.services.SERVICES): every explorer of a run under `placement: local` (the roles are threads of one
process) shares one service, which holds the model once and packs their requests into batches; it
stops when the last client closes, at this process's exit, or, should this process be killed, by
itself (it watches its owner: rl_engine.proc.owner_watch). Under `placement: deployments` the run's
reward role starts the run's one service and posts where it listens (rl_engine.rewards.run_service);
the explorers' ModelRewardFn is built with `locate`, which finds it, and starts none of its own.

A step's samples go to the service `batch_size` at a time, one request after another; each must
be answered within `timeout_s` of being sent (it may wait behind another explorer's batch). A
request that times out, or that finds the service dead or failing, fails its samples and every
later one of the step at once, so a step waits at most `timeout_s` for a broken service. What a
failed sample becomes is `on_failure`'s: `failed_reward` hands it to the run's failure rule
(`taskset.user_code.failed_reward`: scored that value, or left out; counted as reward/timeouts or
reward/crashes), `fail` fails the step with a RewardError naming the service. A dead service is
started again on the next step (with `locate`, the next step looks it up again: the reward role
restarts it).

`normalize: running` turns each score into (score - mean) / std over every score this explorer
has seen so far, the whole of this step's included (Welford's running moments; std 0 leaves the
score centred).
Each step reports `reward/model/...`: latency_ms (mean time of a request), batch_size (mean pairs
per batch the service ran them in), samples_per_s, failures and timeouts (samples).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl_engine.errors import UserError
from rl_engine.rewards.isolation import UserCodeCrashed, UserCodeTimeout
from rl_engine.rewards.remote import ServiceCalls, score_one
from rl_engine.rewards.scoring import RewardError
from rl_engine.rewards.services import SERVICES, Service, acquire_service, start_service

# What makes a service (one process per distinct setting); the variant's other fields (normalize,
# timeout_s, on_failure) are each client's own.
SERVICE_FIELDS = ("path", "batch_size", "max_length", "device", "dtype", "host")


def service_settings(
    path: str, batch_size: int, max_length: int, device: str = "cpu", dtype: str = "float32", host: str = "127.0.0.1"
) -> dict[str, Any]:
    """The settings a classifier service is started with (reward_model_server.py's argument)."""
    return {
        "path": str(Path(path).resolve()),
        "batch_size": int(batch_size),
        "max_length": int(max_length),
        "device": device,
        "dtype": dtype,
        "host": host,
    }


def start_model_service(settings: dict[str, Any]) -> Service:
    """A classifier service of `settings` (service_settings), started and ready; RewardError naming it if it is not."""
    cmd = [sys.executable, "-m", "rl_engine.rewards.reward_model_server", json.dumps(settings)]
    return start_service(
        cmd, f"the reward service of taskset.reward.path = {settings['path']!r}", host=settings["host"]
    )


def check_classifier(path: str, field: str = "taskset.reward.path") -> None:
    """UserError naming `field` unless `path` is a Hugging Face sequence-classification model with
    one label (read from its config.json: nothing is loaded)."""
    fix = (
        "point it at a sequence classifier with one output, e.g. one saved by "
        "AutoModelForSequenceClassification.from_pretrained(BASE, num_labels=1).save_pretrained(DIR) "
        "(and its tokenizer's save_pretrained(DIR)) after training it as a reward model"
    )
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{field} = {path!r}: no config.json there, not a Hugging Face model directory; {fix}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{field} = {path!r}: cannot read its config.json ({e}); {fix}") from None
    archs = cfg.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise UserError(f"{field} = {path!r}: its architectures {archs} hold no *ForSequenceClassification; {fix}")
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    if labels != 1:
        raise UserError(
            f"{field} = {path!r}: a classifier with {labels} labels, a reward needs exactly one score; {fix}"
        )


class RunningMoments:
    """Welford's running mean and variance of every value added."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n else 0.0

    def normalize(self, x: float) -> float:
        std = self.std
        return (x - self.mean) / std if std > 1e-8 else x - self.mean


class ModelRewardFn:
    """The `model` reward (see the module docstring); built from its config variant's fields."""

    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        max_length: int = 1024,
        normalize: str = "none",
        timeout_s: float = 60.0,
        on_failure: str = "failed_reward",
        device: str = "cpu",
        dtype: str = "float32",
        host: str = "127.0.0.1",
        locate: Callable[[], str] | None = None,
    ):
        """`locate`: returns the URL of a service started elsewhere (the run's reward role), used
        instead of one of this process's; None: this process's (SERVICES), started when needed."""
        check_classifier(path)
        self.settings = service_settings(path, batch_size, max_length, device, dtype, host)
        self.locate = locate
        self.path, self.timeout_s, self.normalize = path, float(timeout_s), normalize
        self.calls = ServiceCalls(f"the reward service of taskset.reward.path = {path!r}", on_failure, timeout_s)
        self.describe = self.calls.describe  # how scoring's messages name this reward
        self.moments = RunningMoments()
        self._service: Service | None = None
        self._located: str | None = None  # the URL `locate` gave, until a request fails
        self._http: Any = None

    def __call__(self, prompt: str, response: str, task: Any, finish_reason: str = "stop") -> float:
        return score_one(self, prompt, response, task, finish_reason)

    def score_samples(
        self, samples: Sequence[Any]
    ) -> tuple[list[tuple[float, dict[str, float]] | Exception], dict[str, Any]]:
        """(reward, components) or the exception of each (prompt, response, task, finish_reason)
        sample, in order, and the step's `reward/model/...` metrics."""
        started = time.monotonic()
        pairs = [(str(s[0]), str(s[1])) for s in samples]
        scores: list[float | Exception] = []
        latencies: list[float] = []
        sizes: list[int] = []
        failure: Exception | None = None
        step = self.settings["batch_size"]
        for i in range(0, len(pairs), step):
            chunk = pairs[i : i + step]
            if failure is None:
                sent = time.monotonic()
                try:
                    got = self._post(chunk)
                    latencies.append(1000 * (time.monotonic() - sent))
                    sizes += got["batch_sizes"]
                    scores += [float(x) for x in got["scores"]]
                    continue
                except (UserCodeTimeout, UserCodeCrashed) as e:
                    failure = e
            scores += [failure] * len(chunk)
        if failure is not None:
            self._located = None  # the next step looks the service up again: its role may have restarted it
        self.calls.check_failure(failure)
        outcomes = self._rewards(scores)
        failed = [s for s in scores if isinstance(s, Exception)]
        wall = time.monotonic() - started
        metrics = {
            "reward/model/latency_ms": sum(latencies) / len(latencies) if latencies else float("nan"),
            "reward/model/batch_size": sum(sizes) / len(sizes) if sizes else float("nan"),
            "reward/model/samples_per_s": (len(pairs) - len(failed)) / wall if wall > 0 else float("nan"),
            "reward/model/failures": sum(isinstance(s, UserCodeCrashed) for s in failed),
            "reward/model/timeouts": sum(isinstance(s, UserCodeTimeout) for s in failed),
        }
        return outcomes, metrics

    def _rewards(self, scores: list[float | Exception]) -> list[tuple[float, dict[str, float]] | Exception]:
        """Each score's reward, in order: the score, or with `normalize: running` its z-score under
        the moments of every score so far, this step's all included (their order does not matter)."""
        running = self.normalize == "running"
        if running:
            for x in scores:
                if not isinstance(x, Exception):
                    self.moments.add(x)
        return [x if isinstance(x, Exception) else (self.moments.normalize(x) if running else x, {}) for x in scores]

    def _post(self, chunk: list[tuple[str, str]]) -> dict[str, Any]:
        """The service's answer for `chunk`; UserCodeTimeout past timeout_s, UserCodeCrashed when
        the service is dead, cannot start (or be located), or fails the request."""
        import httpx

        url = self._url()
        if self._http is None:
            self._http = httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=10.0))
        r = self.calls.post(self._http, url + "/score", {"pairs": chunk, "timeout_s": self.timeout_s})
        if r.status_code == 504:
            raise UserCodeTimeout(
                f"{self.calls.describe} did not score within taskset.reward.timeout_s = {self.timeout_s:g} s"
            )
        if r.status_code != 200:
            raise UserCodeCrashed(f"{self.calls.describe} failed the request: HTTP {r.status_code} {r.text[:500]}")
        return r.json()

    def _url(self) -> str:
        """Where the service answers: the located one (waited for), or this process's, started if needed."""
        if self.locate is None:
            self._service = acquire_service(self.settings, lambda: start_model_service(self.settings), self._service)
            return self._service.url
        if self._located is None:
            try:
                self._located = self.locate()
            except RewardError as e:  # not posted in time: counted as reward/crashes, as a service that cannot start
                raise UserCodeCrashed(str(e)) from None
        return self._located

    def close(self) -> None:
        """Done with the service: the last client of this process's stops it (a located one is its role's)."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._service is not None:
            svc, self._service = self._service, None
            SERVICES.release(svc)

    def __repr__(self) -> str:
        return (
            f"ModelRewardFn(path={self.path!r}, batch_size={self.settings['batch_size']}, normalize={self.normalize!r})"
        )
