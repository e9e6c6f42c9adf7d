"""Session vLLM engines for the rollout and sync tests (started on first use, shared, see engines.py)."""

import pytest

from tests.rl_engine.rollout.engines import close_all, shared_engine


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    return shared_engine(tiny_model_dir, 0)


@pytest.fixture(scope="session")
def engine2(tiny_model_dir):
    """A second explorer's engine (started only by the two-receiver collective test)."""
    return shared_engine(tiny_model_dir, 1)


def pytest_sessionfinish(session, exitstatus):
    close_all()
