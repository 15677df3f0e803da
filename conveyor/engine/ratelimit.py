"""A log that says each kind of thing at most once a period: for refusals a peer can make us repeat at will (bad
messages, failed authentication), so that logging them costs bounded CPU and disk."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """``log(kind, message)`` writes at most one record per ``kind`` each ``period_s`` seconds."""

    def __init__(self, logger: logging.Logger, period_s: float = 60.0) -> None:
        self.logger, self.period_s = logger, period_s
        self._last: Dict[str, float] = {}
        self._skipped: Dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, kind: str, message: str, *args: Any, level: int = logging.WARNING) -> bool:
        """Log ``message % args`` unless ``kind`` was logged within the period; returns whether it was."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.period_s:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return False
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        suffix = f" ({skipped} more like it in the last {self.period_s:.0f}s not logged)" if skipped else ""
        self.logger.log(level, message + suffix, *args)
        return True
