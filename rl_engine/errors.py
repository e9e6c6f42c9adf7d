"""Errors a user can fix (bad config, missing file, malformed row).

The CLI prints a `UserError` as its message alone, one clear line (or a few), and exits 2;
anything else is a bug and keeps its traceback. A UserError raised inside a flow or task is
also logged by Prefect on its way out, traceback and all: `rft run`, and every process that
imports the mode flows (a worker's flow run), call `hide_user_error_tracebacks` on Prefect's run
and engine loggers so those records keep only their message, on one line.
"""

import logging


class UserError(Exception):
    """A mistake in the user's input; the message names the problem and the fix."""


class _NoUserErrorTraceback(logging.Filter):
    """A log record about a UserError (or one of `kinds`, e.g. Prefect's refusal of a flow's
    parameters) keeps its message alone, on one line, without the traceback: Prefect's
    "Encountered exception during execution: ConfigError('...\\n  ...')" reads
    `ConfigError: <the message, its lines joined>`. The records that only restate an exception
    already logged (Prefect's engine: "... exited with unexpected exception", with the traceback
    again) are dropped: on a worker's terminal a refused config is one line naming the field and
    the fix, not a 50-line traceback."""

    RESTATING = "exited with unexpected exception"

    def __init__(self, kinds: tuple[type[BaseException], ...] = ()):
        super().__init__()
        self.kinds: tuple[type[BaseException], ...] = (UserError, *kinds)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        error = record.exc_info[1] if record.exc_info else next((a for a in args if isinstance(a, BaseException)), None)
        if not isinstance(error, self.kinds):
            return True
        if self.RESTATING in record.getMessage():
            return False
        if error in args:
            record.msg = str(record.msg).replace("%r", "%s")
            record.args = tuple(one_line(error) if a is error else a for a in args)
        record.exc_info, record.exc_text = None, None
        return True


def one_line(error: BaseException) -> str:
    """`ConfigError: <message>`, the message's lines (a ConfigError has one per problem) joined:
    by a space after a line that ends in a colon, else by "; "."""
    text = ""
    for line in (ln.strip() for ln in str(error).splitlines()):
        if line:
            text += (" " if text.endswith(":") else "; " if text else "") + line
    return f"{type(error).__name__}: {text}"


def hide_user_error_tracebacks(*logger_names: str, also: tuple[type[BaseException], ...] = ()) -> None:
    """Log a UserError (and the exception types `also`) on these loggers (e.g. Prefect's
    `prefect.flow_runs`, `prefect.task_runs`, `prefect.engine`) on one line, without its
    traceback (`_NoUserErrorTraceback`); idempotent."""
    for name in logger_names:
        logger = logging.getLogger(name)
        found = [f for f in logger.filters if isinstance(f, _NoUserErrorTraceback)]
        if found:
            found[0].kinds = tuple(dict.fromkeys((*found[0].kinds, *also)))
        else:
            logger.addFilter(_NoUserErrorTraceback(also))


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
