"""User-facing errors.

A `CompressError` carries one line that names the problem and the fix. The CLI prints it without a
traceback and exits with status 2; anything else escaping the library is a bug.
"""


class CompressError(Exception):
    """A problem with the user's input: the message names it and says how to fix it."""
