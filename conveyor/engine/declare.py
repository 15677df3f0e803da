"""What a middleware says about itself: the context fields it reads and writes.

``task.describe()`` shows these declarations and ``task.run`` checks them before the first iteration (a
field read before any middleware writes it and that is not kept is an error naming both).
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

__all__ = ["declares"]

M = TypeVar("M")


def declares(*, reads: Iterable[str] = (), writes: Iterable[str] = ()) -> Callable[[M], M]:
    """Mark a middleware (function, or class whose instances are middleware) with the fields it reads and writes.

    >>> @declares(reads=("env_step",), writes=("train_data",))
    ... def fetch(ctx): ...
    """
    reads, writes = tuple(reads), tuple(writes)

    def mark(middleware: M) -> M:
        middleware.reads = reads  # type: ignore[attr-defined]
        middleware.writes = writes  # type: ignore[attr-defined]
        return middleware

    return mark
