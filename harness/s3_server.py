"""moto's S3 server on loopback for tests and benches, with S3's atomic conditional writes.

S3 applies a conditional write (`If-None-Match: *`, which `rl_engine.storage.create_exclusive`
sends and the run lease relies on) atomically: of concurrent writers of one new key exactly one
gets 200, the others 412. moto 5 looks the key up and stores the object in two steps with no lock
between, so two racing PUTs can both pass the look-up and both succeed: on a loaded 2-core CI
machine the lease race (tests/rl_engine/run/test_lease.py) saw two winners in 1 of 200 rounds.
`start_s3_server` serializes moto's object writes (PUT, multipart completion), which makes its
conditional writes atomic as S3's are; moto keeps objects in memory, so the lock costs little.

    server, endpoint = start_s3_server()
    ...
    server.stop()
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_WRITES = threading.Lock()
_HANDLERS = ("put_object", "_key_response_post")  # moto.s3.responses.S3Response: the two with If-None-Match


def atomic_conditional_writes() -> None:
    """Make moto's S3 object writes in this process one at a time (idempotent)."""
    from moto.s3.responses import S3Response

    for name in _HANDLERS:
        handler = getattr(S3Response, name)
        if getattr(handler, "_one_at_a_time", False):
            continue

        @functools.wraps(handler)
        def locked(self: Any, *args: Any, _handler: Any = handler, **kwargs: Any) -> Any:
            with _WRITES:
                return _handler(self, *args, **kwargs)

        locked._one_at_a_time = True  # type: ignore[attr-defined]
        setattr(S3Response, name, locked)


def start_s3_server() -> tuple[Any, str]:
    """A started moto S3 server on a free loopback port with atomic conditional writes, and its
    endpoint URL. Credentials are dummies set in the environment (unless set), the way users pass
    real ones."""
    import os

    from moto.server import ThreadedMotoServer

    from rl_engine.trainer.dist import free_port

    for k, v in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    atomic_conditional_writes()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"
