"""User-facing errors: one line that names the problem and the fix; the CLI exits with code 2."""


class AutoshardError(Exception):
    """Bad input or an impossible request. The message is shown to the user as is."""
