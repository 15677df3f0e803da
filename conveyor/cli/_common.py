"""What every subcommand shares: one-line errors and their exit codes, and numbers printed rounded."""
from __future__ import annotations

import sys
from typing import Optional

__all__ = ["message", "os_message", "usage_error", "number"]


def message(exc: BaseException) -> str:
    """The exception's own sentence (``str()`` of a LookupError would wrap it in quotes)."""
    return exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)


def os_message(exc: OSError) -> str:
    """One line naming the path and the cause (``CheckpointError`` already says both)."""
    if type(exc).__str__ is not OSError.__str__:
        return str(exc)
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def usage_error(text: str) -> int:
    """Print ``conveyor: error: <text>`` to stderr and return exit code 2 (bad usage or bad input)."""
    print(f"conveyor: error: {text}", file=sys.stderr)
    return 2


def number(value: Optional[float]) -> str:
    """A return or a statistic as people read it: one decimal (``-882.1``), three significant digits below 1
    (``0.00123``), ``-`` for none."""
    if value is None:
        return "-"
    value = float(value)
    return f"{value:.1f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
