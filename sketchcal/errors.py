"""The one exception type users see: a one-line message that says what to do."""

from __future__ import annotations


class SketchcalError(Exception):
    """A user-facing error. The CLI prints ``str(err)`` on one line and exits with status 2."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 160 characters), or its type's name."""
    text = str(err).strip().splitlines()
    return text[0][:160] if text else type(err).__name__
