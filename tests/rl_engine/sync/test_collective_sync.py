"""Collective sync into live vLLM engines: trainer thread + two explorer threads, one gloo group.

Two real engines (explorer 0 and explorer 1) are the two receivers; the trainer side is a
transformers model whose weights were perturbed, as the trainer's would be after a step.

    .venv/bin/python -m pytest tests/rl_engine/sync/test_collective_sync.py -q
"""

from __future__ import annotations

import pytest

from rl_engine.board import Board
from rl_engine.sync import build_weight_receiver, build_weight_sender
from rl_engine.trainer.dist import free_port
from tests.rl_engine.rollout.engines import load_hf, make_config, max_logprob_diff
from tests.rl_engine.sync.helpers import named_weights, perturbed_hf, rollouts, run_concurrently

LOGPROB_TOL = 1e-5  # fp32 both sides; measured ~1e-6
CHANGED = 1e-2  # a real weight change moves logprobs by far more than this


@pytest.mark.slow
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "stream"])
def test_collective_sync_into_two_engines(shared_memory, tiny_model_dir, engine, engine2, tmp_path):
    cfg = make_config(
        tiny_model_dir,
        explorer={"count": 2, "engine": {"kv_cache_space_gib": 0.25}},
        synchronizer={
            "mode": "multi_explorer",
            "sync_method": "collective",
            "collective": {
                "port": free_port(),
                "bucket_mb": 0.25,
                "timeout_s": 120,
                "shared_memory": shared_memory,
            },
        },
    )
    original = load_hf(tiny_model_dir)
    trained = perturbed_hf(tiny_model_dir, seed=1)
    engines = [engine, engine2]
    for e in engines:
        assert e.version == 0
        assert max_logprob_diff(original, rollouts(e), 1.0) < LOGPROB_TOL

    board = Board.at(str(tmp_path))
    sender = build_weight_sender(cfg, board)
    receivers = [build_weight_receiver(cfg, board, explorer_id=x) for x in (0, 1)]
    # Group formation: trainer and both explorers join concurrently from their own threads.
    run_concurrently(sender.connect, *[lambda r=r, e=e: r.connect(e) for r, e in zip(receivers, engines)])
    # Both engines' workers run on this host and map the trainer's file: the group agreed on it.
    assert sender.transport == ("shared_memory" if shared_memory else "stream")
    try:
        got = run_concurrently(
            lambda: (sender.prepare(1), sender.send(named_weights(trained), version=1)),
            *[lambda r=r, e=e: (r.prepare(1), r.receive(e))[1] for r, e in zip(receivers, engines)],
        )
        assert got[1:] == [1, 1]
        assert sender.last.version == 1 and sender.last.bytes > 0
        for e in engines:
            assert e.version == 1
            after = rollouts(e)
            assert all(r.version == 1 for g in after for r in g)
            d_trained, d_original = max_logprob_diff(trained, after, 1.0), max_logprob_diff(original, after, 1.0)
            print(
                f"explorer {e.explorer_id}: after collective sync max |diff| vs trained {d_trained:.2e}, vs original {d_original:.2e}"
            )
            assert d_trained < LOGPROB_TOL
            assert d_original > CHANGED

        # A second sync on the same group restores the original weights (and leaves the shared
        # engines as the other tests expect them: version 0, original weights).
        got = run_concurrently(
            lambda: sender.send(
                named_weights(original), version=0
            ),  # no handshake needed: both receivers are in receive()
            *[lambda r=r, e=e: r.receive(e, version=0) for r, e in zip(receivers, engines)],
        )
        assert got[1:] == [0, 0]
        for e in engines:
            assert max_logprob_diff(original, rollouts(e), 1.0) < LOGPROB_TOL
    finally:
        for r in receivers:
            r.close()
        sender.close()


@pytest.mark.slow
def test_killed_engine_raises_engine_died(engine2):
    """Runs after the two-engine test (same file, later): explorer 1's engine is not needed afterwards."""
    import psutil

    from rl_engine.rollout.engine import EngineDiedError
    from tests.rl_engine.rollout.engines import discard

    ((worker, _),) = engine2._procs.workers  # its EngineCore runs in this process on CPU
    worker.kill()
    psutil.wait_procs([worker], timeout=30)
    try:
        # In threads with a timeout: a call that waited forever on the dead engine must fail the test, not hang it.
        for call in (lambda: rollouts(engine2), lambda: engine2.rpc("rft_version", timeout=30)):
            with pytest.raises(EngineDiedError, match="explorer 1 died"):
                run_concurrently(call, timeout=60)
    finally:
        discard(1)
