"""Session engines for the sync tests (the same objects as tests/rl_engine/rollout's, via engines.py)."""

import faulthandler

import pytest

from tests.rl_engine.rollout.engines import close_all, shared_engine


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    return shared_engine(tiny_model_dir, 0)


@pytest.fixture(scope="session")
def engine2(tiny_model_dir):
    """A second explorer's engine (started only by the two-receiver collective test)."""
    return shared_engine(tiny_model_dir, 1)


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
