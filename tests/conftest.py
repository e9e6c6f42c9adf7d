"""Session fixtures shared by the whole suite: the tiny model, an S3 server on loopback.

Engines and servers are expensive (vLLM ~20 s, moto ~2 s, Prefect ~10 s): each is started once
per session here and shared. Markers: `slow` (starts real engines/servers), `gpu` (needs CUDA).
"""

from __future__ import annotations

import os

import pytest

# Small CPU KV cache and quiet, deterministic libraries for every test process (and its children).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rl_engine.trainer.dist import free_port  # noqa: E402 - after the environment above


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
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
def s3_server():
    """moto's S3 server on loopback (real HTTP); yields (endpoint_url, storage options).

    Credentials are dummies set in the environment, the way users pass real ones.
    """
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint, {"client_kwargs": {"endpoint_url": endpoint}}
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket per test; yields (s3 URL of its root, storage options)."""
    import uuid

    import s3fs

    endpoint, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    name = f"t-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    fs.invalidate_cache()
    yield f"s3://{name}", options


# A real `prefect server start` and process workers, shared by every test directory (harness/prefect_live.py).
from harness.prefect_live import prefect_live, prefect_worker  # noqa: E402, F401
