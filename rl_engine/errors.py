"""Errors a user can fix (bad config, missing file, malformed row).

The CLI prints a `UserError` as its message alone, one clear line (or a few), and exits 2;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message names the problem and the fix."""


def run_main(main) -> None:
    """`if __name__ == "__main__": run_main(main)`: a UserError prints one line and exits 2."""
    import sys

    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
