"""rl_engine.proc.reaper: a SIGKILLed main process leaves nothing it started running; a main process
that exits without stopping its children gets them stopped too.

    .venv/bin/python -m pytest tests/rl_engine/proc/test_reaper.py
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

# A main process like `rft run`: its reaper, then a child that would outlive it (a server) and a
# grandchild under that; prints their pids and waits (or exits at once with "exit").
MAIN = """
import subprocess, sys, time
import psutil
from rl_engine.proc.reaper import start_reaper
reaper = start_reaper(interval_s=0.05, grace_s=2.0)  # returns once it watches
server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"])
deadline = time.monotonic() + 60
while not psutil.Process(server.pid).children() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # ten times interval_s: the reaper has looked since the grandchild started
print(reaper.pid, server.pid, flush=True)
if sys.argv[1] == "wait":
    time.sleep(120)
"""


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _start(mode: str) -> tuple[subprocess.Popen, int, list[int]]:
    main = subprocess.Popen([sys.executable, "-c", MAIN, mode], stdout=subprocess.PIPE, text=True)
    reaper, server = (int(x) for x in main.stdout.readline().split())
    started = [server, *(c.pid for c in psutil.Process(server).children())]
    assert len(started) == 2, started
    return main, reaper, started


def test_a_killed_main_process_leaves_nothing_it_started():
    main, reaper, started = _start("wait")
    try:
        main.kill()  # SIGKILL: no atexit, no cleanup in the main process
        main.wait(10)
        assert not _gone(started, 10.0), "the server and its child outlived the killed main process"
        assert not _gone([reaper], 10.0), "the reaper did not exit"
    finally:
        for pid in started:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()


def test_a_main_process_that_exits_leaving_children_running_is_cleaned_up_too():
    main, reaper, started = _start("exit")
    try:
        main.wait(10)
        # The server was still running when main exited: the reaper stops it, as for a kill.
        assert not _gone(started + [reaper], 10.0)
    finally:
        for pid in started:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
