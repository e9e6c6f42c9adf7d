"""Errors a user can fix (bad config, missing file, malformed row).

The CLI prints a `UserError` as its message alone, one clear line (or a few), and exits 2;
anything else is a bug and keeps its traceback. A UserError raised inside a flow or task is
also logged by Prefect on its way out, traceback and all: `rft run` calls
`hide_user_error_tracebacks` on Prefect's run loggers so those records keep only their message.
"""

import logging


class UserError(Exception):
    """A mistake in the user's input; the message names the problem and the fix."""


class _NoUserErrorTraceback(logging.Filter):
    """Drops the traceback of a log record whose exception is a UserError (the message stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


def hide_user_error_tracebacks(*logger_names: str) -> None:
    """Log a UserError on these loggers (e.g. Prefect's `prefect.flow_runs`, `prefect.task_runs`)
    without its traceback; idempotent."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoUserErrorTraceback) for f in logger.filters):
            logger.addFilter(_NoUserErrorTraceback())


class _NoParameterValues(logging.Filter):
    """Prefect logs a flow's refused parameters whole, values and all ("Parameter validation failed
    for flow 'x': [each error with its input]\nParameters: {...}"), on the terminal of the process
    (a worker's): a deployment's `cfg` may hold a credential there (a refused one above all). The
    record keeps its first line's head; the problems themselves are the flow run's state message
    (Prefect's ParameterTypeError: each field and rule, no value)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Parameter validation failed"):
            record.msg = (
                message.split(":", 1)[0] + ": the problems are in the flow run's state message "
                "(the parameters' values are not logged: they may hold credentials)"
            )
            record.args = ()
        return True


def hide_parameter_values(*logger_names: str) -> None:
    """Log a flow's refused parameters on these loggers (Prefect's `prefect.flows`) without their values; idempotent."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoParameterValues) for f in logger.filters):
            logger.addFilter(_NoParameterValues())


def run_main(main) -> None:
    """`if __name__ == "__main__": run_main(main)`: a UserError prints one line and exits 2."""
    import sys

    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
