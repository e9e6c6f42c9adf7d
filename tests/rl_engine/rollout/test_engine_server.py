"""The engine server (`rft engine serve`, rl_engine/rollout/server.py) against a local engine:
same samples and logprobs, one run at a time, clear errors; real vLLM servers on loopback."""

from __future__ import annotations

import time

import httpx
import pytest

from rl_engine.config import SamplingConfig
from rl_engine.errors import UserError
from rl_engine.rollout.server import EngineBusyError, ServerRolloutEngine
from rl_engine.trainer.dist import free_port
from tests.rl_engine.rollout.engines import MAX_MODEL_LEN, make_config


def _client(url: str, model: str, owner: str) -> ServerRolloutEngine:
    srv = ServerRolloutEngine(url, model, MAX_MODEL_LEN, owner)
    srv.rpc("rft_load_checkpoint", model, 0)  # what an explorer does first: the base weights
    srv.mark_synced(0)
    return srv


@pytest.mark.slow
@pytest.mark.parametrize("stop", [[], ["0"]])
def test_a_served_engine_samples_what_a_local_engine_samples(stop, engine, engine_server, tiny_model_dir):
    assert engine.version == 0, "another test left synced weights in the shared engine"
    srv = _client(engine_server.url, tiny_model_dir, "test-same")
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(p) for p in ("12+30=", "The quick brown fox", "x", "7+8=")]
        assert [srv.tokenizer.encode(p) for p in ("12+30=", "The quick brown fox")] == prompts[
            :2
        ]  # the client's own tokenizer, same ids
        sampling = SamplingConfig(temperature=1.0, max_tokens=12, stop=stop)
        local, served = engine.generate(prompts, 4, sampling, seed=11), srv.generate(prompts, 4, sampling, seed=11)
        pairs = [(a, b) for ga, gb in zip(local, served) for a, b in zip(ga, gb)]
        assert len(pairs) == 16
        for a, b in pairs:
            assert (b.prompt_ids, b.response_ids, b.finish_reason, b.text, b.version) == (
                a.prompt_ids,
                a.response_ids,
                a.finish_reason,
                a.text,
                a.version,
            )
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert (
            len({tuple(r.response_ids) for _, r in pairs}) > 4
        )  # distinct seeds per prompt and sample: not one sample repeated
        # Partial rollouts' segments: a budget per prompt and vLLM's repetition detection.
        budgets, repeat = [5, 9, 3, 12], (1, 2)  # any token twice in a row stops a sample
        cut = [
            [(r.response_ids, r.finish_reason) for r in g]
            for g in srv.generate(prompts, 2, sampling, 3, max_tokens=budgets, repeat=repeat)
        ]
        assert cut == [
            [(r.response_ids, r.finish_reason) for r in g]
            for g in engine.generate(prompts, 2, sampling, 3, max_tokens=budgets, repeat=repeat)
        ]
        assert all(len(ids) <= b for g, b in zip(cut, budgets) for ids, _ in g)
        assert {"repeat", "length"} <= {why for g in cut for _, why in g}  # both limits were applied server-side
        each = [(prompts[0], sampling, 5), (prompts[1], sampling.model_copy(update={"temperature": 0.5}), 6)]
        assert [r.response_ids for r in srv.generate_each(each)] == [r.response_ids for r in engine.generate_each(each)]
        seq = [prompts[0] + pairs[0][0].response_ids]
        assert srv.prompt_logprobs(seq)[0] == pytest.approx(engine.prompt_logprobs(seq)[0], abs=1e-5)
    finally:
        srv.close()


@pytest.mark.slow
def test_one_run_at_a_time_and_a_lapsed_claim_frees_the_server(engine_server, tiny_model_dir):
    first = ServerRolloutEngine(engine_server.url, tiny_model_dir, MAX_MODEL_LEN, "run-a explorer 0")
    try:
        with pytest.raises(EngineBusyError, match="in use by run-a explorer 0"):
            ServerRolloutEngine(engine_server.url, tiny_model_dir, MAX_MODEL_LEN, "run-b explorer 0")
    finally:
        first.close()
    second = ServerRolloutEngine(engine_server.url, tiny_model_dir, MAX_MODEL_LEN, "run-b explorer 0")  # released: free
    second.close()
    # A holder that stops renewing (killed) frees the server when its claim lapses.
    [got] = httpx.post(
        f"{engine_server.url}/collective_rpc", json={"method": "rft_claim", "args": ["killed run", 1.0]}, timeout=30
    ).json()["results"]
    assert got["granted"] is True
    with pytest.raises(EngineBusyError, match="killed run"):
        ServerRolloutEngine(engine_server.url, tiny_model_dir, MAX_MODEL_LEN, "run-c explorer 0")
    time.sleep(1.2)
    ServerRolloutEngine(engine_server.url, tiny_model_dir, MAX_MODEL_LEN, "run-c explorer 0").close()


@pytest.mark.slow
def test_a_server_shorter_than_the_run_is_refused(engine_server, tiny_model_dir):
    with pytest.raises(UserError, match="max_model_len 128, below the run's model.max_model_len = 256"):
        ServerRolloutEngine(engine_server.url, tiny_model_dir, 256, "too-long")


def test_no_server_at_the_address_names_the_command(tiny_model_dir):
    with pytest.raises(UserError, match="no engine server answers at http://127.0.0.1:.*rft engine serve"):
        ServerRolloutEngine(f"http://127.0.0.1:{free_port()}", tiny_model_dir, MAX_MODEL_LEN, "nobody")


def test_servers_must_be_urls_one_per_explorer(tiny_model_dir):
    with pytest.raises(ValueError, match="'localhost:8100' is no http"):
        make_config(tiny_model_dir, explorer={"engine": {"servers": ["localhost:8100"]}})
    with pytest.raises(ValueError, match="lists 2 server.* for explorer.count = 1"):
        make_config(tiny_model_dir, explorer={"engine": {"servers": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}})
    assert make_config(
        tiny_model_dir, explorer={"engine": {"servers": ["http://127.0.0.1:8100"]}}
    ).explorer.engine.servers == ["http://127.0.0.1:8100"]
