"""Fixtures of the GPU tests: the flow tests' own (a Prefect server per session, the task file)."""

from tests.flows.conftest import prefect_server, task_file  # noqa: F401  (the GPU runs share them with the CPU ones)
