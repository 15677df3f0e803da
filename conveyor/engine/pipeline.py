"""The async pipeline: iterations flow through the middleware like items on a conveyor belt.

``max_inflight`` worker threads each carry one iteration at a time through the chain, running the same
:func:`~conveyor.engine.compose.onion` as the sync loop, through a gate: each middleware has a forward
and a backward turnstile that let iteration ``i`` through only after ``i - 1``, and a mutex so that its
own parts never run at once. Every middleware sees iterations in order, while different middleware work
on different iterations at once.

The rules that keep it from hanging:

- older iterations never wait for newer ones, and every iteration passes every turnstile exactly once
  however it ends (error, cancellation, ``task.end_iteration()``), so no worker can wait forever;
- a forward part that raises keeps its turnstile (and those after it) shut until the error is settled:
  if no generator upstream handles it, newer iterations are cancelled first (not entered further, their
  suspended generators closed so ``finally`` runs), then the turnstiles open;
- an iteration is recorded as completed, in order, only if it ran to its end and was not cancelled;
- :meth:`AsyncPipeline.run` raises the oldest error (the others as notes) once every worker has stopped.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from conveyor.engine.compose import Middleware, Suspended, enter, leave, note, onion

__all__ = ["AsyncPipeline", "adopt_thread_settings"]


def adopt_thread_settings() -> None:
    """Give the calling thread the process's torch intra-op thread count (a no-op while torch is not imported).

    torch applies ``torch.set_num_threads`` to OpenMP and MKL per thread, lazily, at a thread's first large
    operator: until then a new thread runs small operators on every core, its OpenMP helpers spinning between
    them (a 5-row MLP forward cost 10-70x its CPU in a fresh thread; docs/engine.md, "When async pays").
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


class _Turnstile:
    """Lets iteration ``i`` pass only after iteration ``i - 1`` has passed."""

    __slots__ = ("_cond", "_next")

    def __init__(self, first: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = first

    def wait(self, i: int) -> None:
        if self._next >= i:  # _next only grows, so a stale read can only send us to the slow path
            return
        with self._cond:
            while self._next < i:
                self._cond.wait()

    def done(self, i: int) -> None:
        with self._cond:
            self._next = i + 1
            self._cond.notify_all()

    def pass_(self, i: int) -> None:
        self.wait(i)
        self.done(i)


class _Stage:
    __slots__ = ("forward", "backward", "mutex")

    def __init__(self, first: int) -> None:
        self.forward = _Turnstile(first)
        self.backward = _Turnstile(first)
        self.mutex = threading.Lock()


class _Gate:
    """One iteration's way through the stages: the onion's enter and leave, in iteration order."""

    __slots__ = ("_pipe", "_i", "_forward", "_backward", "stopped")

    def __init__(self, pipe: "AsyncPipeline", i: int) -> None:
        self._pipe, self._i = pipe, i
        self._forward = 0  # stages [0, _forward) have had their forward turnstile passed
        self._backward = len(pipe._stages)  # stages [0, _backward) have not had their backward turnstile passed
        self.stopped = False  # enters nothing more: cancelled, or task.finish was set before stage 0

    def enter(self, mw: Middleware, ctx: Any) -> Optional[Suspended]:
        pipe, i, k = self._pipe, self._i, self._forward
        stage = pipe._stages[k]
        stage.forward.wait(i)
        self.stopped = self.stopped or pipe._cancelled(i) or (k == 0 and pipe._finished())
        suspended = None
        if not self.stopped:
            with stage.mutex:
                suspended = enter(mw, ctx)  # if it raises, this turnstile stays shut until release()
        stage.forward.done(i)
        self._forward = k + 1
        return suspended

    def leave(self, suspended: Suspended, error: Optional[BaseException]) -> Optional[BaseException]:
        pipe, i = self._pipe, self._i
        k = pipe._index[suspended.mw]
        self._pass_backward(k + 1)
        stage = pipe._stages[k]
        stage.backward.wait(i)
        with stage.mutex:
            error = leave(suspended, error, cancel=pipe._cancelled(i))
        if k:  # stage 0's turnstile stays shut until release(), when the iteration's fate is settled
            stage.backward.done(i)
            self._backward = k
        return error

    def _pass_backward(self, down_to: int) -> None:
        stages, i = self._pipe._stages, self._i
        for k in range(self._backward - 1, down_to - 1, -1):
            stages[k].backward.pass_(i)
        self._backward = min(self._backward, down_to)

    def release(self) -> None:
        """Pass every turnstile this iteration has not passed yet."""
        stages, i = self._pipe._stages, self._i
        for k in range(self._forward, len(stages)):
            stages[k].forward.pass_(i)
        self._forward = len(stages)
        self._pass_backward(0)


class AsyncPipeline:
    """Runs iterations ``first .. first + count - 1`` of a chain with at most ``max_inflight`` in flight."""

    def __init__(self, chain: Sequence[Middleware], max_inflight: int, current: threading.local) -> None:
        self._chain = list(chain)
        self._max_inflight = max_inflight
        self._current = current  # the task's thread-local: .ctx is the ctx of the running iteration
        self._cond = threading.Condition(threading.Lock())
        self._pauses = [0, 0]  # pauses requested, pauses handled

    def request_pause(self) -> None:
        """Start no new iteration; once those in flight are done, call ``quiescent`` on the runner thread."""
        with self._cond:
            self._pauses[0] += 1
            self._cond.notify_all()

    def run(self, first: int, count: int, new_ctx: Callable[[int], Any], finished: Callable[[], bool],
            completed: Callable[[int, Any], None], quiescent: Callable[[], None]) -> None:
        """Run the iterations; raise the oldest error (others as notes) after every worker has stopped.

        ``new_ctx(i)`` makes iteration ``i``'s context; ``finished()`` stops new iterations (checked before
        one enters its first middleware); ``completed(i, ctx)`` is called in order for each completed iteration;
        ``quiescent()`` runs on this thread when a pause was requested and nothing is in flight.
        """
        self._stages = [_Stage(first) for _ in self._chain]
        self._index: Dict[Middleware, int] = {mw: k for k, mw in enumerate(self._chain)}
        self._completion = _Turnstile(first)
        self._next, self._end = first, first + count
        self._new_ctx, self._finished, self._completed = new_ctx, finished, completed
        self._errors: List[Tuple[int, BaseException]] = []
        self._cancel_after: Optional[int] = None
        self._inflight, self._alive = 0, self._max_inflight
        workers = [threading.Thread(target=self._worker, daemon=True, name=f"conveyor-pipeline-{n}")
                   for n in range(self._max_inflight)]
        for w in workers:
            w.start()
        try:
            self._supervise(quiescent)
        except BaseException:  # KeyboardInterrupt in the runner thread: cancel everything, then wait
            self._cancel(first - 1)
            raise
        finally:
            for w in workers:
                w.join()
        if self._errors:
            self._errors.sort(key=lambda e: e[0])
            oldest = self._errors[0][1]
            for i, other in self._errors[1:]:
                note(oldest, f"iteration {i} also raised {type(other).__name__}: {other}")
            raise oldest

    def _supervise(self, quiescent: Callable[[], None]) -> None:
        """Wait for the workers to stop, running ``quiescent`` at each requested pause."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._alive == 0 or (self._pauses[0] > self._pauses[1] and
                                                                self._inflight == 0 and self._cancel_after is None))
                if self._alive == 0:
                    return
                requested = self._pauses[0]
            try:
                quiescent()
            except BaseException as exc:
                with self._cond:
                    self._errors.append((self._next, exc))
                    if self._cancel_after is None:
                        self._cancel_after = self._next - 1
            with self._cond:
                self._pauses[1] = requested
                self._cond.notify_all()

    def _stopping(self) -> bool:
        return self._cancel_after is not None or self._next >= self._end or self._finished()

    def _worker(self) -> None:
        try:
            adopt_thread_settings()
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pauses[0] == self._pauses[1] or self._stopping())
                    if self._stopping():
                        return
                    i = self._next
                    self._next += 1
                    self._inflight += 1
                try:
                    self._iteration(i)
                finally:
                    with self._cond:
                        self._inflight -= 1
                        if self._inflight == 0 and self._pauses[0] > self._pauses[1]:
                            self._cond.notify_all()
        finally:
            with self._cond:
                self._alive -= 1
                self._cond.notify_all()

    def _iteration(self, i: int) -> None:
        gate = _Gate(self, i)
        error: Optional[BaseException] = None
        ctx = None
        try:
            ctx = self._new_ctx(i)
            self._current.ctx = ctx
            for _ in onion(self._chain, ctx, gate):
                pass
        except BaseException as exc:
            error = exc
            self._cancel(i)  # before release(): newer iterations must not enter what this one kept shut
        finally:
            self._current.ctx = None
        gate.release()
        self._completion.wait(i)
        try:
            if error is None and not gate.stopped and not self._cancelled(i):
                self._completed(i, ctx)
        except BaseException as exc:
            error = exc
            self._cancel(i)
        finally:
            self._completion.done(i)
        if error is not None:
            with self._cond:
                self._errors.append((i, error))

    def _cancel(self, after: int) -> None:
        with self._cond:
            if self._cancel_after is None or after < self._cancel_after:
                self._cancel_after = after
            self._cond.notify_all()

    def _cancelled(self, i: int) -> bool:
        after = self._cancel_after
        return after is not None and i > after
