"""Session engine for the rollout tests (shared with tests/rl_engine/sync through engines.py)."""

import pytest

from tests.rl_engine.rollout.engines import close_all, shared_engine


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    return shared_engine(tiny_model_dir, 0)


def pytest_sessionfinish(session, exitstatus):
    close_all()
