"""The vLLM rollout engine on the tiny model: samples, logprobs against transformers, errors.

.venv/bin/python -m pytest tests/rl_engine/rollout -q
"""

from __future__ import annotations

import pytest

from rl_engine.errors import UserError
from rl_engine.rollout.engine import (
    EngineDiedError,
    VLLMRolloutEngine,
    build_rollout_engine,
    finish_reason,
    request_fields,
    request_seeds,
)
from tests.rl_engine.rollout.engines import MAX_MODEL_LEN, load_hf, make_config, max_logprob_diff

# fp32 on both sides; measured max |diff| ~1e-6 on the tiny model.
LOGPROB_TOL = 1e-5


def _sampling(engine, **kw):
    from rl_engine.config import SamplingConfig

    return SamplingConfig(**{"max_tokens": 12, **kw})


# ---------------------------------------------------------------- fast (no engine)


def test_request_seeds_are_distinct_and_do_not_overlap():
    seeds = request_seeds(7, num_prompts=50, n=8)
    streams = {s + k for s in seeds for k in range(8)}  # vLLM seeds sample k with seed + k
    assert len(streams) == 50 * 8
    assert request_seeds(7, 50, 8) == seeds
    assert not set(request_seeds(8, 50, 8)) & set(seeds)


def test_request_fields_give_each_prompt_its_seed_and_budget():
    from rl_engine.config import SamplingConfig

    sampling = SamplingConfig(max_tokens=12)
    fields = request_fields(3, 4, sampling, seed=7, max_tokens=[5, 12, 1], repeat=(2, 3))
    assert [f["seed"] for f in fields] == request_seeds(7, 3, 4) and [f["max_tokens"] for f in fields] == [5, 12, 1]
    assert all(
        f["n"] == 4 and f["repetition_detection"] == {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 3}
        for f in fields
    )
    assert [f["max_tokens"] for f in request_fields(2, 1, sampling, seed=7)] == [12, 12]


def test_finish_reasons_map_and_an_aborted_generation_names_its_engine():
    assert [finish_reason(r, "vLLM") for r in ("stop", "length", "repetition")] == ["stop", "length", "repeat"]
    with pytest.raises(RuntimeError, match=r"engine server http://x finished a generation with reason 'abort'"):
        finish_reason("abort", "engine server http://x")


def test_missing_model_path_is_a_user_error(tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir)
    cfg.model.path = str(tmp_path / "no-such-model")
    with pytest.raises(UserError, match="no-such-model.*does not exist"):
        build_rollout_engine(cfg)


def test_closed_engine_raises_engine_died():
    eng = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # no vLLM: only the lifecycle state
    eng._closed, eng.explorer_id, eng.max_model_len = True, 3, 64
    import threading

    eng._lock = threading.RLock()
    with pytest.raises(EngineDiedError, match="explorer 3 was closed"):
        eng.generate([[1, 2]], 1, _sampling(eng), seed=0)


def test_dead_engine_core_maps_to_engine_died():
    from vllm.v1.engine.exceptions import EngineDeadError

    eng = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    eng.explorer_id = 1
    with pytest.raises(EngineDiedError, match="explorer 1 died"):
        eng._raise_if_dead(EngineDeadError())


def test_engine_threads_bind_cores_by_explorer_or_all_of_this_process():
    import os

    from rl_engine.rollout.engine import _cpu_thread_bind

    ncpu = os.cpu_count() or 1
    assert _cpu_thread_bind(None, 0) is None  # vLLM decides
    assert _cpu_thread_bind(1, 0) == "0" and _cpu_thread_bind(1, 1) == str(1 % ncpu)  # explorer x: cores [x*n, (x+1)*n)
    assert _cpu_thread_bind(ncpu + 5, 0) == ",".join(map(str, range(ncpu)))  # never more threads than cores
    assert _cpu_thread_bind("all", 3) == ",".join(
        map(str, sorted(os.sched_getaffinity(0)))
    )  # this process's cores, whatever the explorer


def test_all_engine_threads_fall_back_to_every_core_where_there_is_no_affinity(monkeypatch):
    import os

    from rl_engine.rollout.engine import _cpu_thread_bind

    monkeypatch.delattr(os, "sched_getaffinity")  # macOS has none
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert _cpu_thread_bind("all", 0) == "0,1,2"


def test_sampled_logprobs_from_flat_logprobs():
    from vllm.logprobs import Logprob, create_sample_logprobs

    from rl_engine.rollout.engine import _sampled_logprobs

    ids = [7, 3, 9]
    flat = create_sample_logprobs(True)  # what vLLM returns with flat_logprobs=True
    for t, lp in zip(ids, [-0.5, -1.25, -2.0]):
        flat.append({t: Logprob(logprob=lp, rank=1)})
    assert _sampled_logprobs(ids, flat) == [-0.5, -1.25, -2.0]
    with pytest.raises(RuntimeError, match="not those of the sampled tokens"):
        _sampled_logprobs([7, 3, 8], flat)
    with pytest.raises(RuntimeError, match="2 logprobs for 3 response tokens"):
        _sampled_logprobs(ids, flat[:2])


# ---------------------------------------------------------------- real engine


@pytest.mark.slow
def test_n_samples_per_prompt_with_logprobs(engine):
    tok = engine.tokenizer
    prompts = [tok.encode("1+2="), tok.encode("hello"), tok.encode("hello")]
    out = engine.generate(prompts, n=4, sampling=_sampling(engine), seed=3)
    assert [len(g) for g in out] == [4, 4, 4]
    for p, g in zip(prompts, out):
        for r in g:
            assert r.prompt_ids == p
            assert 1 <= len(r.response_ids) <= 12
            assert len(r.logprobs) == len(r.response_ids)
            assert all(lp <= 0.0 for lp in r.logprobs)
            assert r.version == engine.version == 0
            assert r.finish_reason in ("stop", "length")
            # No stop strings: vLLM does not detokenize, the text is decoded once from the ids.
            assert r.text == tok.decode(r.response_ids, skip_special_tokens=True)
            if r.finish_reason == "length":
                assert len(r.response_ids) == 12
        assert len({tuple(r.response_ids) for r in g}) == 4  # distinct samples
    # The same prompt twice in one call gets its own seeds: not the same samples.
    assert [r.response_ids for r in out[1]] != [r.response_ids for r in out[2]]


@pytest.mark.slow
def test_seed_reproduces_and_varies(engine):
    prompts = [engine.tokenizer.encode("abc")]
    a = engine.generate(prompts, 2, _sampling(engine), seed=11)
    b = engine.generate(prompts, 2, _sampling(engine), seed=11)
    c = engine.generate(prompts, 2, _sampling(engine), seed=12)
    ids = lambda o: [r.response_ids for r in o[0]]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


@pytest.mark.slow
def test_warm_up_changes_no_later_sample(engine):
    # The explorer warms a new engine up before step 1 (rl_engine.roles.explorer.warm_up): a run's
    # samples must be the same as without it.
    from rl_engine.roles.explorer import warm_up

    prompts = [engine.tokenizer.encode("12+7="), engine.tokenizer.encode("abc")]
    before = engine.generate(prompts, 3, _sampling(engine), seed=21)
    warm_up(engine, _sampling(engine, temperature=0.7, stop=["\n"]))
    after = engine.generate(prompts, 3, _sampling(engine), seed=21)
    got = lambda o: [(r.response_ids, r.logprobs) for g in o for r in g]  # noqa: E731
    assert got(after) == got(before)


@pytest.mark.slow
def test_finish_reasons_stop_and_length(engine):
    stops = list("abcdefghijklmnopqrstuvwxyz0123456789")  # ~14% of the byte vocabulary per token
    s = _sampling(engine, max_tokens=40, stop=stops)
    out = engine.generate([engine.tokenizer.encode("q:")], n=16, sampling=s, seed=5)
    reasons = [r.finish_reason for r in out[0]]
    assert "stop" in reasons
    eos = engine.tokenizer.eos_token_id
    for r in out[0]:
        full = engine.tokenizer.decode(r.response_ids)
        if r.finish_reason == "stop":
            assert r.response_ids[-1] == eos or full[-1:] in stops
            assert not any(ch in r.text for ch in stops)  # vLLM cuts the stop string from the text
        else:
            assert len(r.response_ids) == 40


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_transformers(engine, tiny_model_dir, temperature):
    assert engine.version == 0, "another test left synced weights in the shared engine"
    hf = load_hf(tiny_model_dir)
    tok = engine.tokenizer
    prompts = [tok.encode("12+30="), tok.encode("The quick brown fox"), tok.encode("x")]
    out = engine.generate(prompts, n=3, sampling=_sampling(engine, temperature=temperature, max_tokens=24), seed=1)
    worst = max_logprob_diff(hf, out, temperature)
    print(f"max |logprob diff| vLLM vs transformers at T={temperature}: {worst:.2e}")
    assert worst < LOGPROB_TOL


@pytest.mark.slow
def test_batch_over_the_token_budget(engine):
    """48 prompts x 4 samples x 30 tokens = 5760 prefill tokens > the 4096 per-step budget.

    With chunked prefill (vLLM's default) a seeded request cut mid-prefill killed the CPU
    worker; the engine prefills whole prompts instead and spreads them over steps.
    """
    prompts = [[3 + (i * 7 + j) % 250 for j in range(30)] for i in range(48)]
    out = engine.generate(prompts, n=4, sampling=_sampling(engine, max_tokens=4), seed=2)
    assert [len(g) for g in out] == [4] * 48
    assert all(len(r.logprobs) == len(r.response_ids) >= 1 for g in out for r in g)


@pytest.mark.slow
def test_prompt_longer_than_context_is_a_user_error(engine):
    with pytest.raises(
        UserError, match=rf"prompt 1 has {MAX_MODEL_LEN + 5} tokens.*model.max_model_len = {MAX_MODEL_LEN}"
    ):
        engine.generate([[5, 6], [7] * (MAX_MODEL_LEN + 5)], 2, _sampling(engine), seed=0)
    with pytest.raises(UserError, match="prompt 0 is empty"):
        engine.generate([[]], 1, _sampling(engine), seed=0)
    # The engine is still usable afterwards.
    assert len(engine.generate([[5, 6]], 1, _sampling(engine), seed=0)[0]) == 1


@pytest.mark.slow
def test_an_engine_start_hands_the_starting_process_its_environment_back(engine):
    """The engine's processes start with their own variables (TORCHDYNAMO_DISABLE=1 on CPU: vLLM's
    sampler would torch.compile its token-rank helper on the first call, 1.8-4 s per engine start;
    bench.engine_start's warm_up_s shows it); the process that started the engine, where a
    trainer may use torch.compile, gets its environment back, and sampled logprobs still come."""
    import os

    from rl_engine.proc.owner_watch import OWNER_PID_ENV

    assert "TORCHDYNAMO_DISABLE" not in os.environ and OWNER_PID_ENV not in os.environ
    out = engine.generate([engine.tokenizer.encode("12+7=")], 2, _sampling(engine), seed=3)
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in out[0])
