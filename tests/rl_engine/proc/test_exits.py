"""How a child process ended, in the words error messages use (engine workers, user-code workers)."""

import pytest

from rl_engine.proc.exits import describe_exit


@pytest.mark.parametrize(
    "code, words",
    [
        (0, "exit code 0"),
        (3, "exit code 3"),
        (-9, "killed by SIGKILL"),
        (-11, "killed by SIGSEGV"),
        (-200, "killed by signal 200"),
        (None, "exited"),
    ],
)
def test_describe_exit_names_the_signal_or_the_code(code, words):
    assert describe_exit(code) == words
