"""rl_engine.rollout.shm_wait: a reader of vLLM's shared-memory queue sleeps with backoff instead
of spinning, and still gets every message.

    .venv/bin/python -m pytest tests/rl_engine/rollout/test_shm_wait.py -q
"""

from __future__ import annotations

import threading
import time

import pytest

from rl_engine.rollout import shm_wait


class _Condition:
    def __init__(self, last_read: float):
        self.last_read = last_read


@pytest.mark.parametrize(
    ("waited", "timeout_ms", "sleep"),
    [
        (0.0001, None, None),  # just after a message: yield, no sleep
        (0.005, None, 0.0005),  # a tenth of the time waited so far
        (2.0, None, 0.001),  # at most a millisecond late
        (2.0, 0, 0.0),  # never past the caller's deadline
    ],
)
def test_backoff_sleeps_a_tenth_of_the_wait_capped(monkeypatch, waited, timeout_ms, sleep):
    slept, yielded = [], []
    monkeypatch.setattr(shm_wait.time, "monotonic", lambda: 100.0)
    monkeypatch.setattr(shm_wait.time, "sleep", slept.append)
    monkeypatch.setattr(shm_wait.os, "sched_yield", lambda: yielded.append(1))
    shm_wait.backoff_wait(_Condition(last_read=100.0 - waited), timeout_ms)
    assert slept == ([] if sleep is None else [pytest.approx(sleep)])
    assert yielded == ([1] if sleep is None else [])


def test_a_backoff_reader_gets_every_message_without_spinning():
    """A real vLLM MessageQueue, writer and reader threads in this process (as the in-process
    EngineCore reads its worker's replies): messages sent after a pause arrive, in order, and the
    reader's thread used a small part of the pause's CPU time (vLLM's own wait spins through it)."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    shm_wait.wait_with_backoff(reader)
    ready = threading.Thread(target=writer.wait_until_ready, daemon=True)
    ready.start()
    reader.wait_until_ready()
    ready.join(10)
    got, cpu = [], []

    def read() -> None:
        start = time.thread_time()
        for _ in range(3):
            got.append(reader.dequeue(timeout=10))
        cpu.append(time.thread_time() - start)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    for i in range(3):
        time.sleep(0.3)
        writer.enqueue({"step": i})
    t.join(30)
    assert not t.is_alive(), "the reader never got its messages"
    assert got == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert cpu[0] < 0.3 * 0.9, f"the reader used {cpu[0]:.2f} s of CPU over 0.9 s of waiting: it spun"
