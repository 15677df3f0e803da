"""Messages from peers checked before use: what a handler drops (:class:`BadMessage`), how drops are counted
and logged (:class:`Rejections`), and the checks the exchangers and the zoo's handlers share: a dict with the
expected fields (:func:`check_fields`) and the layout two values must share to be used alike (:func:`layout`)."""
from __future__ import annotations

import logging
import reprlib
import sys
import threading
from typing import Any, Callable, Dict, Optional, Set

from conveyor.engine.ratelimit import RateLimitedLog

__all__ = ["BadMessage", "Rejections", "check_fields", "layout"]

log = logging.getLogger("conveyor.middleware.exchanger")  # where these drops were always logged


class BadMessage(ValueError):
    """A peer's message that decoded but is not what its topic carries; its handler drops it."""


class Rejections:
    """The messages a node's handlers dropped as :class:`BadMessage`: counted, and logged at most once a
    minute per topic (a peer may send many), naming the sender where ``router`` says who it was
    (``router.sender``, the authenticated sender of the message being handled)."""

    def __init__(self, owner: str, router: Any = None) -> None:
        self.owner = owner
        self.count = 0
        self._router = router
        self._log = RateLimitedLog(log)
        self._lock = threading.Lock()

    def __call__(self, fn: Callable[[Any], None], topic: str) -> Callable[[Any], None]:
        """``fn`` as a handler of ``topic`` that drops, counts and logs the payloads it raises BadMessage for."""
        def handle(payload: Any) -> None:
            try:
                fn(payload)
            except BadMessage as e:
                self.reject(topic, str(e))
        return handle

    def reject(self, topic: str, why: str) -> None:
        """Count one dropped message on ``topic``; log it unless that topic was logged within the last minute."""
        with self._lock:
            self.count += 1
            count = self.count
        sender = getattr(self._router, "sender", None)
        self.log(topic, "%s: dropped a message on %r%s: %s (%d rejected so far)", self.owner, topic,
                 "" if sender is None else f" from node {sender}", why, count)

    def log(self, kind: str, message: str, *args: Any) -> None:
        """Log a refusal of ``kind`` (a topic, or what a handler refused of a message it kept), at most once a
        minute per kind."""
        self._log.log(kind, message, *args)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def check_fields(payload: Any, **checks: Callable[[Any], bool]) -> Dict[str, Any]:
    """``payload`` if it is a dict holding every key of ``checks`` with a value its check accepts; else
    :class:`BadMessage` naming the first that fails. ``int`` checks a count (an int in ``[0, 2**63)``)."""
    if not isinstance(payload, dict):
        raise BadMessage(f"a {type(payload).__name__}, not a dict")
    for key, check in checks.items():
        if key not in payload:
            raise BadMessage(f"no {key!r} key")
        if not (_count if check is int else check)(payload[key]):
            raise BadMessage(f"{key!r} cannot be {reprlib.repr(payload[key])}")
    return payload


def layout(value: Any, rows: Optional[Set[int]] = None) -> Any:
    """What two values must share to be used alike: their structure (keys, lengths, types) and each array's
    dtype and shape. With ``rows`` (a set), arrays are batches: their first dim is left out of the layout and
    added to ``rows`` (a batch whose arrays disagree on it gets 2 or more); a scalar array is a BadMessage.
    Objects with ``__slots__`` (the codec's registered types, such as FrozenNormaliser) by their slots."""
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")  # an array of theirs exists only once loaded
    if (np is not None and isinstance(value, np.ndarray)) or (torch is not None and isinstance(value, torch.Tensor)):
        shape = tuple(value.shape)
        if rows is not None:
            if not shape:
                raise BadMessage("a batch holds a scalar array")
            rows.add(shape[0])
            shape = shape[1:]
        return str(value.dtype), shape
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(layout(v, rows) for v in value)
    items = getattr(value, "items", None)
    if callable(items):  # a dict or a treetensor tree
        # Sorted by key alone (text, then type: 1 and "1" may both be keys), never by the layouts, which need not compare.
        keyed = sorted(((str(k), type(k).__name__), v) for k, v in items())
        return type(value).__name__, tuple((key, layout(v, rows)) for key, v in keyed)
    slots = getattr(type(value), "__slots__", None)
    if slots:  # a registered codec type (FrozenNormaliser)
        return type(value).__name__, tuple(layout(getattr(value, name, None), rows) for name in slots)
    return type(value).__name__
