"""Fixtures for deployment tests: a real Prefect server and process workers (tests/prefect_live.py).

They are registered once for the whole suite in tests/conftest.py (one server per session); this
registers them here only if that is not so, so these tests never depend on another file's import.
"""

import tests.conftest as _root

if not hasattr(_root, "prefect_live"):
    from tests.prefect_live import prefect_live, prefect_worker  # noqa: F401  (registers the session fixtures)
