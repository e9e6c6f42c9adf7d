"""What the tracker tests read back, with the trackers' own readers: TensorBoard scalars, a
W&B offline run's history, and an `mlflow server` on loopback to log to."""

from __future__ import annotations

import contextlib
import glob
import os
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from rl_engine.trainer.dist import free_port


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, value, wall_time), ...]} of every event file in `log_dir`, by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: str) -> list[object]:
    """The records of a W&B `.wandb` transaction log (a LevelDB-style log of `Record` protobufs:
    a 7-byte header, 32 KiB blocks, records split into chunks with 7-byte headers); wandb ships
    the format's writer in its Go core only."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a W&B transaction log"
    block, pos, chunk, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def wandb_history(wandb_dir: str, run_id: str) -> list[dict[str, str]]:
    """Every history row logged to W&B run `run_id` offline under `wandb_dir`, over all its offline
    run directories (a resumed run adds one), as {key: JSON value}."""
    rows = []
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in rec.history.item})
    return rows


@contextlib.contextmanager
def mlflow_server(root: Path, start_timeout_s: float = 90.0) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 (a free port, a sqlite store under `root`) until the block
    ends; yields its URI. Its output is in `root/server.log`."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "server.log", "wb")
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server not up after {start_timeout_s} s:\n{(root / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.3)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(15)
        log.close()
