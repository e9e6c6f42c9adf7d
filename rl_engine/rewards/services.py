"""Reward service processes of this process: the model reward's classifier service
(reward_model_server.py) and the judge's own vLLM engine (judge.py with `path`). Each is started
on the first scoring call that needs it and shared by every explorer of this process that asks
for the same settings (`SERVICES`, counted by their clients): it stops when the last client
closes, at this process's exit, or, should this process be killed, by itself (it is given this
process's PID in RFT_ENGINE_OWNER_PID and watches it: rl_engine.proc.owner_watch).
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from rl_engine.proc.owner_watch import OWNER_PID_ENV
from rl_engine.proc.starts import count_start
from rl_engine.rewards.scoring import RewardError

START_TIMEOUT_S = 300.0  # importing torch and loading a model (or starting a vLLM engine) on a busy CPU
_STOP_GRACE_S = 5.0
_HEALTH_POLL_S = 0.5


class Service:
    """One service process and the URL it answers at."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url, self.refs = proc, url, 0

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(_STOP_GRACE_S)


def start_service(
    argv: list[str], what: str, env: dict[str, str] | None = None, port: int | None = None, host: str = "127.0.0.1"
) -> Service:
    """Start `argv` (with `env` added to this process's environment and this process as its owner)
    and wait until it is ready: with `port` None, until it prints `listening <port>` on stdout (the
    one line it writes there); with a `port`, until GET /health there answers 200 (a vLLM server,
    whose output goes where this process's does). Its URL is on `host` (where it listens). A ready
    one counts as a `reward_service` start (rl_engine.proc.starts). RewardError naming `what` when
    it is not ready within START_TIMEOUT_S or exits first."""
    env = {**os.environ, **(env or {}), OWNER_PID_ENV: str(os.getpid())}
    out = subprocess.PIPE if port is None else None
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, env=env, close_fds=True)
    svc = Service(proc, "")
    if port is None:
        readable, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode() if readable else ""
        proc.stdout.close()
        ready = line.startswith("listening ")
        port = int(line.split()[1]) if ready else None
    else:
        ready = _healthy(proc, f"http://{host}:{port}/health")
    if ready:
        svc.url = f"http://{host}:{port}"
        count_start("reward_service")
        return svc
    svc.stop()
    raise RewardError(
        f"{what} did not start within {START_TIMEOUT_S:g} s "
        f"({'exit code ' + str(proc.returncode) if proc.returncode is not None else 'no answer'}); its error is above in the log"
    )


def _healthy(proc: subprocess.Popen, url: str) -> bool:
    """True once `url` answers 200; False if `proc` exits first or START_TIMEOUT_S passes."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=5.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(_HEALTH_POLL_S)
    return False


class ServiceRegistry:
    """This process's services, one per key (a service's settings), counted by their clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._services: dict[str, Service] = {}
        self.started = 0  # services this process started (tests: explorers shared one)

    def acquire(self, key: str, start: Callable[[], Service], held: Service | None) -> Service:
        """The live service of `key` (started by `start()` if there is none, or if the one there
        died), counting the caller once (`held`: the one it already counts)."""
        with self._lock:
            svc = self._services.get(key)
            if svc is None or not svc.alive:
                if svc is not None:
                    svc.stop()
                svc = self._services[key] = start()
                self.started += 1
            if svc is not held:
                svc.refs += 1
            return svc

    def release(self, svc: Service) -> None:
        with self._lock:
            svc.refs -= 1
            if svc.refs > 0:
                return
            for k, v in list(self._services.items()):
                if v is svc:
                    del self._services[k]
        svc.stop()

    def stop_all(self) -> None:
        with self._lock:
            services = list(self._services.values())
            self._services.clear()
        for svc in services:
            svc.stop()


SERVICES = ServiceRegistry()
atexit.register(SERVICES.stop_all)


def acquire_service(settings: dict[str, Any], start: Callable[[], Service], held: Service | None) -> Service:
    """SERVICES.acquire by `settings`; a service that cannot start is UserCodeCrashed (its
    RewardError names it), which scoring counts as reward/crashes, as a request to a dead one."""
    import json

    from rl_engine.rewards.isolation import UserCodeCrashed

    try:
        return SERVICES.acquire(json.dumps(settings, sort_keys=True), start, held)
    except RewardError as e:
        raise UserCodeCrashed(str(e)) from None
