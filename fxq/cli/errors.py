"""The command line's user errors."""

__all__ = ["CliError", "error_text"]


class CliError(Exception):
    """A user error: the command prints the message as one line and exits with code 2."""


def error_text(error: BaseException) -> str:
    """``error`` as one line: ``Type: message`` (the message alone for a ``CliError``),
    without the node trace torch.fx appends (the message before it says what failed)."""
    text = " ".join(str(error).split("\n\nWhile executing")[0].split())
    return text if isinstance(error, CliError) else f"{type(error).__name__}: {text}"
