"""The command line's user errors."""

__all__ = ["CliError"]


class CliError(Exception):
    """A user error: the command prints the message as one line and exits with code 2."""
