"""Signals around child processes: who decides on SIGINT / SIGTERM, and how an exit is described."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

__all__ = ["Terminated", "describe_exit", "ignore_stop_signals", "raise_terminated", "sigterm_raises",
           "signal_name", "signals_held", "signals_ignored"]


class Terminated(SystemExit):
    """Raised by a SIGTERM handler (:func:`raise_terminated`): unwinds ``finally`` blocks, exits 128 + signal."""


def raise_terminated(signum: int, frame: Any) -> None:
    """A signal handler that raises :class:`Terminated`."""
    raise Terminated(128 + signum)


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: Optional[int]) -> str:
    """How a process ended, from its exit code as ``subprocess`` and ``multiprocessing`` give it (negative:
    killed by that signal; None: not ended)."""
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with code {code}"


def ignore_stop_signals() -> None:
    """In a child: Ctrl-C and a SIGTERM sent to the whole process group are for the parent, which stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (their handlers may raise) while a message on a connection is half sent or read,
    so the connection never loses its framing; they are delivered right after."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class sigterm_raises:
    """SIGTERM raises :class:`Terminated` (``SystemExit(143)``) inside this block (main thread only; elsewhere
    nothing changes): a parent supervising children unwinds and stops them."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, raise_terminated)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class signals_ignored:
    """SIGINT and SIGTERM wait inside this block (main thread only), so a second Ctrl-C while children are being
    stopped cannot orphan them."""

    def __enter__(self) -> None:
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
