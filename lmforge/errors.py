"""The one exception type lmforge raises for problems a user can fix.

The CLI prints these as a short message (no traceback) and exits with status 2.
Every message says what was wrong, where (file, line, key) and what to do.
"""


class LMForgeError(Exception):
    """A problem with the user's input, files or configuration."""
