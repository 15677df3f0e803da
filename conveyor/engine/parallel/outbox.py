"""A router's outbox: one bounded send queue per link, drained by a sender thread that sends batches.

:meth:`Outbox.put` queues a packed message for a link and returns at once while there is room; each link's
sender thread takes everything queued for it, up to ``batch_bytes`` and
:data:`~conveyor.engine.parallel.frame.MAX_BATCH_MESSAGES` messages, and hands it to ``send`` in one call
(the router seals it as one batch: one header, one counter, one tag, one socket send). A lone message goes
out at once, as soon as its thread wakes; batches form only while the publisher runs ahead of the socket,
so batching adds no delay of its own.

Back-pressure is the socket's, moved one step back: a link's queue holds at most ``max_bytes`` (one message
at least, whatever its size), a put waits at most ``timeout_s`` for room and returns False when it ran out
(the caller counts and drops that message, as a send that timed out), and the sender thread's own send
waits for a slow peer as a direct send did. A slow peer fills only its own queue: other links keep
sending. A sender thread with nothing to send for ``idle_s`` ends (a link that is gone leaves nothing
behind); the next put starts another.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, List

from conveyor.engine.parallel.frame import MAX_BATCH_MESSAGES
from conveyor.engine.ratelimit import RateLimitedLog

__all__ = ["Outbox"]


class _Queue:
    """What is queued for one link, and whether its thread is sending a batch taken from it."""

    def __init__(self) -> None:
        self.items: Deque[bytearray] = collections.deque()
        self.bytes = 0
        self.sending = False
        self.thread: Any = None


class Outbox:
    """Per-link send queues for ``send(link, messages)``; see the module docstring for the bounds."""

    def __init__(self, send: Callable[[Any, List[bytearray]], Any], *, max_bytes: int, batch_bytes: int,
                 timeout_s: float, log: RateLimitedLog, name: str, idle_s: float = 1.0) -> None:
        if not 0 < batch_bytes <= max_bytes:
            raise ValueError(f"Outbox(batch_bytes={batch_bytes}, max_bytes={max_bytes}): need 0 < batch <= max")
        self._send, self._log, self._name = send, log, name
        self.max_bytes, self.batch_bytes, self.timeout_s, self.idle_s = max_bytes, batch_bytes, timeout_s, idle_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queues: Dict[Any, _Queue] = {}
        self._closing = False

    def put(self, link: Any, message: bytearray) -> bool:
        """Queue ``message`` for ``link``; waits up to ``timeout_s`` for room. False: no room came (or the outbox
        is closed), and the message was not queued. ``message`` is only read, so one may be queued on several links."""
        size, deadline = len(message), None
        with self._changed:
            queue = self._queues.get(link)
            if queue is None:
                queue = self._queues[link] = _Queue()
            while queue.items and (queue.bytes + size > self.max_bytes
                                   or len(queue.items) >= 2 * MAX_BATCH_MESSAGES) and not self._closing:
                deadline = deadline or time.monotonic() + self.timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            if self._closing:
                return False
            idle = not queue.items and not queue.sending  # its thread may be waiting for something to send
            queue.items.append(message)
            queue.bytes += size
            if queue.thread is None:
                queue.thread = threading.Thread(target=self._run, args=(link, queue), daemon=True,
                                                name=f"conveyor-router-send-{self._name}")
                queue.thread.start()
            elif idle:
                self._changed.notify_all()
        return True

    def queued(self) -> int:
        """Messages queued or being sent, over all links."""
        with self._lock:
            return sum(len(q.items) + q.sending for q in self._queues.values())

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything queued has been handed to ``send``; whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while any(q.items or q.sending for q in self._queues.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Drop what is still queued and stop the sender threads (waiting up to ``timeout_s`` for each)."""
        with self._changed:
            self._closing = True
            threads = [q.thread for q in self._queues.values() if q.thread is not None]
            for q in self._queues.values():
                q.items.clear()
                q.bytes = 0
            self._changed.notify_all()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)

    def _take(self, queue: _Queue) -> List[bytearray]:
        """The oldest queued messages that fit one batch (at least one). Call with the lock held."""
        batch = [queue.items.popleft()]
        size = len(batch[0])
        while (queue.items and len(batch) < MAX_BATCH_MESSAGES
               and size + len(queue.items[0]) <= self.batch_bytes):
            size += len(queue.items[0])
            batch.append(queue.items.popleft())
        queue.bytes -= size
        return batch

    def _run(self, link: Any, queue: _Queue) -> None:
        """A link's sender thread: send what is queued, batch by batch; end when idle or closing."""
        while True:
            with self._changed:
                idle_until = time.monotonic() + self.idle_s
                while not queue.items and not self._closing:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                if not queue.items or self._closing:
                    queue.thread = None
                    if self._queues.get(link) is queue and not queue.items:
                        del self._queues[link]
                    self._changed.notify_all()
                    return
                batch = self._take(queue)
                queue.sending = True
                self._changed.notify_all()
            try:
                self._send(link, batch)
            except Exception as e:  # a bug must not end the link's sending, nor lose the queue's accounting
                self._log.log(f"send {type(e).__name__}", "router %s: sending a batch of %d failed: %s: %s",
                              self._name, len(batch), type(e).__name__, e)
            finally:
                with self._changed:
                    queue.sending = False
                    self._changed.notify_all()
