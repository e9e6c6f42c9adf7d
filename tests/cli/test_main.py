"""The `rft` command's exit (cli.main.exit_now): what the interpreter's exit does that a finished
command needs, without the module teardown (~2 s once torch, vLLM and Prefect are imported).

    .venv/bin/python -m pytest tests/cli/test_main.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, sys, threading, time
from cli.main import exit_now
out = sys.argv[1]
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
def late():
    time.sleep(0.5)
    open(out + "/thread", "w").write("done")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
sys.stdout.write("no newline at the end")
sys.stderr.write("and a warning")
exit_now(3)
print("never printed")
"""


def test_exit_now_joins_threads_runs_atexit_flushes_and_keeps_the_status(tmp_path):
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 3, res.stderr
    assert (res.stdout, res.stderr) == (
        "no newline at the end",
        "and a warning",
    )  # buffered pipes flushed, nothing after
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"


def test_the_rft_script_exits_with_mains_status(tmp_path):
    rft = Path(sys.executable).with_name("rft")
    bad = subprocess.run(
        [str(rft), "validate", str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "missing.yaml" in bad.stderr, bad.stderr
    good = subprocess.run([str(rft), "validate", "--schema"], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and json.loads(good.stdout)["title"] == "RFTConfig", good.stderr[
        -2000:
    ]  # 64 KB through a pipe, whole
