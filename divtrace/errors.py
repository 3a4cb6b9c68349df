"""One error type for everything the user can get wrong; the CLI formats it in one place."""


class DivtraceError(Exception):
    """Bad input or an impossible request. The CLI prints it as one line and exits 2."""

    exit_code = 2
