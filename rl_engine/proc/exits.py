"""How a child process ended, in the words error messages use (engine workers, user-code workers)."""

import signal


def describe_exit(code: int | None) -> str:
    """A child process's exit code as words: "exit code 3", "killed by SIGKILL" (a negative code
    is the signal, as multiprocessing and psutil report it), "exited" when it is not known."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
