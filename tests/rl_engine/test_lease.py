"""RunLease after its holder was killed: free at once on the holder's machine, never elsewhere
before its ttl (tests/rl_engine/test_roles.py covers a live holder and the ttl itself).

    .venv/bin/python -m pytest tests/rl_engine/test_run_lease.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rl_engine.errors import UserError
from rl_engine.run import RunLease

HOLDER = """
import sys, time
from rl_engine.run import RunLease
RunLease(sys.argv[1], ttl_s=60).acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def killed_holder(tmp_path):
    """The lease of a process that held it (ttl 60 s) and was SIGKILLed a moment ago."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"is being run by pid {proc.pid} "):
            RunLease(str(tmp_path), ttl_s=60).acquire()
    finally:
        proc.kill()
        proc.wait(10)
    return tmp_path


def test_a_killed_holders_lease_is_free_at_once_on_its_machine(killed_holder):
    lease = RunLease(str(killed_holder), ttl_s=60).acquire()
    try:
        assert json.loads((killed_holder / "lease.json").read_text())["holder"] == lease.me["holder"]
    finally:
        lease.release()


def test_a_lease_from_another_machine_waits_for_its_ttl(killed_holder):
    path = killed_holder / "lease.json"
    for field, value in (("boot", 1.0), ("host", "elsewhere")):  # its pid means nothing here
        path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
        with pytest.raises(UserError, match="is being run by pid .* retry in [56]\\d s"):
            RunLease(str(killed_holder), ttl_s=60).acquire()
