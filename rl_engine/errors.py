"""Errors a user can fix (bad config, missing file, malformed row).

The CLI prints a `UserError` as its message alone, one clear line (or a few), and exits 2;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message names the problem and the fix."""
