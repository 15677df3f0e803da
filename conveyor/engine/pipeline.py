"""The async pipeline: iterations flow through the middleware like items on a conveyor belt.

``max_inflight`` worker threads each carry one iteration at a time through the whole chain. Each
middleware has two turnstiles, one for its forward part and one for its backward part, which let
iteration ``i`` through only after iteration ``i - 1``: every middleware sees iterations in order,
while different middleware work on different iterations at once. A middleware never runs two of its
parts at the same time (its own mutex); ``lock=True`` middleware also share the task's lock.

Older iterations never wait for newer ones, so the pipeline cannot deadlock on its own gates.
When an iteration raises, it holds its remaining forward gates shut until it knows whether an
upstream middleware handles the exception; if none does, newer iterations are cancelled (their
suspended generators closed) and the oldest error is raised from :meth:`AsyncPipeline.run`.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from conveyor.engine.compose import Middleware, Suspended, enter, leave

__all__ = ["AsyncPipeline"]


class _Turnstile:
    """Lets iteration ``i`` pass only after iteration ``i - 1`` has passed."""

    def __init__(self, first: int) -> None:
        self._cond = threading.Condition()
        self._next = first

    def wait(self, i: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._next >= i)

    def done(self, i: int) -> None:
        with self._cond:
            self._next = i + 1
            self._cond.notify_all()


class _Stage:
    __slots__ = ("mw", "forward", "backward", "mutex")

    def __init__(self, mw: Middleware, first: int) -> None:
        self.mw = mw
        self.forward = _Turnstile(first)
        self.backward = _Turnstile(first)
        self.mutex = threading.Lock()


class AsyncPipeline:
    """Runs iterations ``first .. first + count - 1`` of a chain with at most ``max_inflight`` in flight."""

    def __init__(self, chain: Sequence[Middleware], max_inflight: int, current: threading.local) -> None:
        self._chain = list(chain)
        self._max_inflight = max_inflight
        self._current = current  # the task's thread-local: .ctx is the ctx of the running iteration
        self._lock = threading.Lock()
        self._last: Tuple[int, Any] = (-1, None)

    @property
    def newest_done(self) -> Any:
        """The context of the newest iteration that completed without error (None before any did)."""
        return self._last[1]

    def run(self, first: int, count: int, new_ctx: Callable[[int], Any], finished: Callable[[], bool]) -> None:
        """Run the iterations; raise the oldest unhandled error, after every worker has stopped."""
        self._stages = [_Stage(mw, first) for mw in self._chain]
        self._next, self._end = first, first + count
        self._errors: List[Tuple[int, BaseException]] = []
        self._cancel_after: Optional[int] = None
        self._last: Tuple[int, Any] = (first - 1, None)
        workers = [threading.Thread(target=self._worker, args=(new_ctx, finished), daemon=True,
                                    name=f"conveyor-pipeline-{n}") for n in range(self._max_inflight)]
        for w in workers:
            w.start()
        try:
            for w in workers:
                w.join()
        except BaseException:  # KeyboardInterrupt in the main thread: cancel everything, then wait
            self._cancel(first - 1)
            for w in workers:
                w.join()
            raise
        if self._errors:
            raise min(self._errors, key=lambda e: e[0])[1]

    def _worker(self, new_ctx: Callable[[int], Any], finished: Callable[[], bool]) -> None:
        while True:
            with self._lock:
                if self._cancel_after is not None or self._next >= self._end or finished():
                    return
                i = self._next
                self._next += 1
            try:
                ctx = new_ctx(i)
                self._current.ctx = ctx
                error = self._iteration(i, ctx)
            except BaseException as exc:  # a bug in the runner itself: still stop cleanly
                error = exc
            finally:
                self._current.ctx = None
            with self._lock:
                if error is not None:
                    self._errors.append((i, error))
                elif i > self._last[0]:
                    self._last = (i, ctx)

    def _cancel(self, after: int) -> None:
        with self._lock:
            if self._cancel_after is None or after < self._cancel_after:
                self._cancel_after = after

    def _cancelled(self, i: int) -> bool:
        after = self._cancel_after
        return after is not None and i > after

    def _iteration(self, i: int, ctx: Any) -> Optional[BaseException]:
        stages = self._stages
        stack: List[Tuple[int, Suspended]] = []
        error: Optional[BaseException] = None
        failed_at = len(stages)
        for k, stage in enumerate(stages):
            stage.forward.wait(i)
            if not self._cancelled(i):
                try:
                    with stage.mutex:
                        suspended = enter(stage.mw, ctx)
                except BaseException as exc:
                    error, failed_at = exc, k
                    break  # hold this and later forward gates until we know whether it is handled
                if suspended is not None:
                    stack.append((k, suspended))
            stage.forward.done(i)
        for k in reversed(range(len(stages))):
            stage = stages[k]
            stage.backward.wait(i)
            if stack and stack[-1][0] == k:
                suspended = stack.pop()[1]
                with stage.mutex:
                    if self._cancelled(i):
                        suspended.gen.close()
                    else:
                        error = leave(suspended, error)
            stage.backward.done(i)
        if error is not None:
            self._cancel(i)
        for stage in stages[failed_at:]:
            stage.forward.wait(i)
            stage.forward.done(i)
        return error
