"""The one error every converter raises for input it cannot convert (the command line prints it as one line)."""

from __future__ import annotations


class ConvertError(ValueError):
    """Input that cannot be converted; the message is one line naming the file, tensor or field."""
