"""A loopback TCP proxy in front of an S3 server that can fail the way a real endpoint does.

The session's moto server runs in-process (it cannot be SIGSTOPped), and restarting it would lose
its buckets, so outages are made here, between the client and the server:

* `stall()`: like SIGSTOP of the server: new connections wait in the kernel's accept backlog
  (the TCP handshake completes, nothing answers) and bytes on open connections stop flowing.
* `refuse()`: like a stopped server: the listening socket is closed (connect gets ECONNREFUSED)
  and open connections are reset.
* `restore()`: back to forwarding; refused -> listening again on the same port.
* `stall_on(marker, seconds)`: a stall that starts when a request carrying `marker` (a path in its
  request line) arrives, holding that very request: an outage at a point of the run's own
  progress, not at a moment a watcher happened to notice.

    with OutageProxy(endpoint) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.endpoint}}
        proxy.outage("stall", 20.0)        # starts now, ends by itself after 20 s
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Any
from urllib.parse import urlparse

from rl_engine.storage import open_storage

_TICK = 0.1  # every blocking call here wakes at least this often to see state changes


class OutageProxy:
    """Forwards 127.0.0.1:<port> to an upstream `http://host:port`; stall/refuse/restore on demand."""

    def __init__(self, upstream_endpoint: str):
        u = urlparse(upstream_endpoint)
        self.upstream = (u.hostname or "127.0.0.1", int(u.port or 80))
        self.state = "forward"  # forward | stall | refuse
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._timer: threading.Timer | None = None
        self._trigger: tuple[bytes, float] | None = None
        self.triggered_at: float | None = None  # time.monotonic() when `stall_on` fired
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="outage-proxy-accept", daemon=True)
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- outages

    def stall(self) -> None:
        with self._lock:
            self.state = "stall"

    def refuse(self) -> None:
        with self._lock:
            self.state = "refuse"
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:  # RST, as a dead server's kernel would answer
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
            except OSError:
                pass

    def restore(self) -> None:
        with self._lock:
            if self._listener is None and not self._closed.is_set():
                self._listener = self._listen(self.port)
            self.state = "forward"

    def outage(self, kind: str, seconds: float) -> None:
        """Start a `kind` ("stall" or "refuse") outage now; it ends by itself after `seconds`."""
        {"stall": self.stall, "refuse": self.refuse}[kind]()
        self._timer = threading.Timer(seconds, self.restore)
        self._timer.daemon = True
        self._timer.start()

    def stall_on(self, marker: bytes, seconds: float) -> None:
        """Arm a `seconds` stall that starts when a client request containing `marker` arrives."""
        with self._lock:
            self._trigger = (marker, seconds)

    def _fire_if_marked(self, data: bytes) -> None:
        with self._lock:
            trigger = self._trigger
            if trigger is None or trigger[0] not in data:
                return
            self._trigger = None
        self.triggered_at = time.monotonic()
        self.outage("stall", trigger[1])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._closed.set()
        self.refuse()
        self._acceptor.join(timeout=5)

    def __enter__(self) -> OutageProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing

    def _listen(self, port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        s.settimeout(_TICK)
        return s

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                listener = self._listener if self.state == "forward" else None
            if listener is None:  # stalled: leave connections in the backlog; refused: no listener
                self._closed.wait(_TICK)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=30)
            except OSError:
                client.close()
                continue
            client.settimeout(30)  # bounds a send; reads wait in select() a tick at a time
            with self._lock:
                self._conns += [client, upstream]
            for a, b, requests in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump, args=(a, b, requests), name="outage-proxy-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while not self._closed.is_set():
                if self.state != "forward":  # stalled: hold the bytes where they are
                    self._closed.wait(_TICK)
                    if self.state == "refuse":
                        return
                    continue
                if not select.select([src], [], [], _TICK)[0]:
                    continue
                data = src.recv(65536)
                if not data:
                    return
                if requests:
                    self._fire_if_marked(data)
                while self.state == "stall" and not self._closed.is_set():  # hold what arrived as it began
                    self._closed.wait(_TICK)
                dst.sendall(data)
        except (OSError, ValueError):  # reset, or closed by refuse()
            return
        finally:
            # Either side ending ends both (the other pump then sees EOF and closes its own side):
            # every socket is closed once its pumps are done, so a long run never runs out of fds.
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                if src in self._conns:
                    self._conns.remove(src)
            src.close()


# --------------------------------------------------------------------------- a buffer across an outage


def visible_objects(fs: Any, run_url: str) -> dict[str, Any]:
    """What a reader of the run's buffer could see: committed steps, and objects that are not whole
    (a temp name, a record that does not parse or does not match its data, a torn Arrow file)."""
    import pyarrow as pa

    from rl_engine.buffer import _files

    root = run_url.removeprefix("s3://")
    fs.invalidate_cache()
    objects = fs.find(f"{root}/buffer")
    bad = [p for p in objects if "/.tmp" in p]
    steps = []
    for p in objects:
        try:
            if "/_commits/" in p:
                rec = _files.read_record(fs, p)
                _files.read_data(
                    fs,
                    f"{root}/buffer/{rec['path']}",
                    size=rec["size"],
                    checksum=_files.checksum_of(rec),
                    uri=p,
                    num_rows=rec["num_rows"],
                )
                steps.append(rec["explorer_step"])
            elif p.endswith(".arrow"):  # committed or not (a PUT that landed after its writer gave up): whole
                pa.ipc.open_file(pa.py_buffer(fs.cat_file(p))).read_all()
        except Exception:  # noqa: BLE001 - any unreadable object is what this looks for
            bad.append(p)
    return {"steps": sorted(steps), "not_whole": bad}


def buffer_outage_trial(
    run_url: str, endpoint: str, kind: str, outage_s: float, limit_s: float, rows: int = 8
) -> dict[str, Any]:
    """Write explorer step 1; start an outage (`kind` for `outage_s`); write steps 2 and 3 while a
    reader waits for them; end the outage (if still on), write step 4 and read everything.

    Returns timings, the errors (StorageUnavailableError) of the writer and the reader, and what a
    reader got: `lost` (acknowledged rows never read), `duplicated`, `unexpected` (rows of a write
    that failed), plus `visible_objects` over a direct connection."""
    import s3fs

    from rl_engine.buffer.reader import BufferReader
    from rl_engine.buffer.synthetic import make_batch
    from rl_engine.buffer.writer import BufferWriter
    from rl_engine.config import BufferConfig

    out: dict[str, Any] = {"kind": kind, "outage_s": outage_s, "limit_s": limit_s, "write_error": "", "read_error": ""}
    acked: list[int] = []
    read: list[str] = []
    with OutageProxy(endpoint) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.endpoint}, "outage_timeout_s": limit_s}
        writer, reader = (
            BufferWriter(*open_storage(run_url, options), explorer_id=0),
            BufferReader(*open_storage(run_url, options), BufferConfig(poll_interval_s=0.2)),
        )

        def write(step: int) -> None:
            writer.write(step, make_batch(rows, explorer_step=step))
            acked.append(step)

        def read_ids(n: int, timeout_s: float) -> None:
            read.extend(reader.read_batch(n, timeout_s=timeout_s).to_table().column("experience_id").to_pylist())

        write(1)
        read_ids(rows, 30)
        proxy.outage(kind, outage_s)
        t0 = time.monotonic()
        reading = threading.Thread(
            target=_timed, args=(out, "read", t0, read_ids, 2 * rows, outage_s + 60), daemon=True
        )
        reading.start()  # the reader's polls cross the outage too
        _timed(out, "write", t0, lambda: (write(2), write(3)))
        reading.join(timeout=outage_s + 70)
        out["survived"] = not (out["write_error"] or out["read_error"] or reading.is_alive())
        proxy.restore()
        time.sleep(1.0)  # a stalled request released now lands (or not) before anyone looks
        write(4)
        read_ids(rows * len(acked) - len(read), 30)
        out["extra_rows"] = reader.poll()
    expected = {f"e0-s{s}-{i}" for s in acked for i in range(rows)}
    out.update(
        acked_steps=acked,
        lost=len(expected - set(read)),
        duplicated=len(read) - len(set(read)),
        unexpected=len(set(read) - expected),
        visible=visible_objects(
            s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint}), run_url
        ),
    )
    return out


def _timed(out: dict[str, Any], what: str, t0: float, fn: Any, *args: Any) -> None:
    """Run fn(*args); record `<what>_s` (seconds since t0) and `<what>_error` (a StorageUnavailableError's message)."""
    from rl_engine.storage import StorageUnavailableError

    try:
        fn(*args)
    except StorageUnavailableError as e:
        out[f"{what}_error"] = str(e)
    finally:
        out[f"{what}_s"] = round(time.monotonic() - t0, 2)
