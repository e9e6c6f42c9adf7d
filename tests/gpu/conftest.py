"""Fixtures of the GPU tests: the flow tests' own (a Prefect server per session, the task file)."""

from tests.flows.conftest import prefect_server  # noqa: F401  (the GPU runs share it with the CPU ones)
