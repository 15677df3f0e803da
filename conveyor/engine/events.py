"""A thread-safe event bus: ``on``, ``once``, ``off``, ``emit``, ``wait_for``.

Handlers run in the emitting thread, outside the bus's lock, so a handler may itself emit, subscribe
or unsubscribe. A ``once`` handler fires exactly once even when several threads emit at the same time.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["EventBus"]

Handler = Callable[..., Any]


class EventBus:
    """Named events with local delivery; remote delivery is added by the multi-node router."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: Dict[str, List[Tuple[Handler, bool]]] = {}

    def on(self, name: str, fn: Handler) -> None:
        """Call ``fn(*args)`` on every ``emit(name, *args)``."""
        self._add(name, fn, once=False)

    def once(self, name: str, fn: Handler) -> None:
        """Call ``fn(*args)`` on the next ``emit(name, *args)`` only."""
        self._add(name, fn, once=True)

    def off(self, name: str, fn: Optional[Handler] = None) -> None:
        """Remove ``fn`` from ``name`` (every handler of ``name`` if ``fn`` is None)."""
        with self._lock:
            if fn is None:
                self._handlers.pop(name, None)
            elif name in self._handlers:
                self._handlers[name] = [(h, o) for h, o in self._handlers[name] if h is not fn and h != fn]

    def emit(self, name: str, *args: Any) -> int:
        """Deliver ``args`` to the handlers of ``name``; returns how many handlers ran."""
        with self._lock:
            handlers = self._handlers.get(name)
            if not handlers:
                return 0
            if any(once for _, once in handlers):
                self._handlers[name] = [(h, o) for h, o in handlers if not o]
            handlers = list(handlers)
        for fn, _ in handlers:
            fn(*args)
        return len(handlers)

    def wait_for(self, name: str, timeout: Optional[float] = None) -> Tuple[Any, ...]:
        """Block until ``name`` is emitted and return its args; ``TimeoutError`` after ``timeout`` seconds."""
        arrived = threading.Event()
        box: List[Tuple[Any, ...]] = []

        def catch(*args: Any) -> None:
            box.append(args)
            arrived.set()

        self.once(name, catch)
        if not arrived.wait(timeout):
            self.off(name, catch)
            if not arrived.is_set():  # the event may have come between the wait and the off
                raise TimeoutError(f"event '{name}' was not emitted within {timeout} s")
        return box[0]

    def handlers(self, name: str) -> List[Handler]:
        """The handlers currently subscribed to ``name``."""
        with self._lock:
            return [fn for fn, _ in self._handlers.get(name, [])]

    def names(self) -> List[str]:
        """The event names that have handlers."""
        with self._lock:
            return [name for name, handlers in self._handlers.items() if handlers]

    def clear(self) -> None:
        """Remove every handler."""
        with self._lock:
            self._handlers.clear()

    def _add(self, name: str, fn: Handler, once: bool) -> None:
        if not callable(fn):
            raise TypeError(f"event handler for '{name}' must be callable, got {fn!r}")
        with self._lock:
            self._handlers.setdefault(name, []).append((fn, once))
