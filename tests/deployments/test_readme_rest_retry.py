"""The Prefect guide's REST calls (`curl ... /create_flow_run`) through a Prefect server that is busy.

Prefect's server answers 503 `{"exception_message":"Service Unavailable"}` when its SQLite database
is busy (concurrent writers, a loaded machine: it happened in CI), and its own clients retry. The
guide's curl lines retry too; this checks that what they print after a retry is the answer alone,
one JSON document a script can parse, not the 503's body glued to it. The server here is a loopback
stand-in that answers each path's first request with that 503 and then with a Prefect-shaped answer;
`tests/deployments/test_live_operations.py` runs the same lines against a real server.

    .venv/bin/python -m pytest tests/deployments/test_readme_rest_retry.py -q
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.deployments.test_live_operations import readme_set_block

BUSY = json.dumps({"exception_message": "Service Unavailable"}).encode()
DEPLOYMENT_ID = "94e10527-35ce-4ca8-a7f9-bdbccd6f5eb6"


class BusyOnceHandler(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[Counter] = Counter()

    def _answer(self, body: dict) -> None:
        self.seen[self.command, self.path] += 1
        code, data = (503, BUSY) if self.seen[self.command, self.path] == 1 else (200, json.dumps(body).encode())
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"id": DEPLOYMENT_ID, "name": "synchronous"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(
            {
                "id": "bdb00ea5-7d4e-465d-832e-80ccf3e4a1f0",
                "name": "fascinating-capybara",
                "deployment_id": DEPLOYMENT_ID,
            }
        )

    def log_message(self, *args) -> None:  # the test prints what it needs
        pass


@pytest.fixture
def busy_server() -> Iterator[str]:
    BusyOnceHandler.seen = Counter()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BusyOnceHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/api"
    finally:
        server.shutdown()
        thread.join(timeout=10)


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="the guide's REST lines need curl and jq")
@pytest.mark.timeout(60)
def test_readme_rest_calls_print_only_the_answer_after_a_busy_503(busy_server):
    block = readme_set_block()
    rest = block[block.index("ID=$(curl") :]  # the REST lines; the `prefect deployment run` line needs a real server
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", rest],
        env={"PATH": "/usr/bin:/bin", "PREFECT_API_URL": busy_server},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("returned error: 503") == 2, res.stderr  # both calls met the busy answer once, and said so
    created = json.loads(res.stdout.strip())  # one document: the flow run
    assert created["deployment_id"] == DEPLOYMENT_ID
    assert BusyOnceHandler.seen == {
        ("GET", "/api/deployments/name/synchronous/synchronous"): 2,
        ("POST", f"/api/deployments/{DEPLOYMENT_ID}/create_flow_run"): 2,
    }
