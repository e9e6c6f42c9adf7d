"""Session engine for the rollout tests (shared with tests/rl_engine/sync through engines.py)."""

import faulthandler

import pytest

from tests.rl_engine.rollout.engines import close_all, shared_engine


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    return shared_engine(tiny_model_dir, 0)


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
    """Dump every thread's stack if a test runs past 5 minutes: a hung engine or group shows where."""
    if float(request.config.getini("faulthandler_timeout") or 0) > 0:
        yield  # pytest's own watchdog is on
        return
    faulthandler.dump_traceback_later(300)
    yield
    faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session, exitstatus):
    close_all()
