"""The one exception type symcost raises for bad input; the CLI prints it as one line."""


class SymcostError(Exception):
    """A user-facing error: its message says what was wrong and what is accepted."""
