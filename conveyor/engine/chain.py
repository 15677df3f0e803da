"""A task's middleware records, and the helpers that compose middleware by hand.

Every middleware a task is given becomes one :class:`~conveyor.engine.compose.Middleware` record (its lock
and its timing); ``task.stats()`` reads them. ``forward`` / ``backward``, ``serial``, ``parallel`` and
``wrap`` are DI-engine's composition helpers, each run through the same ``enter`` / ``unwind`` as the loop.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Set, Tuple, Union

from conveyor.engine.compose import Middleware, Suspended, check_middleware, compose, enter, hand_over, note, unwind
from conveyor.engine.pipeline import adopt_thread_settings

__all__ = ["Chain", "LockArg", "TaskHelpers", "capture"]

LockArg = Union[bool, ContextManager]


def capture(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn``; return its exception instead of raising it (for gathering parallel results)."""
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


class Chain:
    """The records made for one ``task.start()`` block, the helpers' pending backward parts and thread pool.

    ``local`` is the task's thread-local (``.ctx``: the calling iteration's context); ``concurrent()`` says
    whether ``parallel`` members may run on threads (async mode).
    """

    def __init__(self, shared_lock: ContextManager, local: threading.local,
                 concurrent: Callable[[], bool]) -> None:
        self._shared_lock = shared_lock
        self._local = local
        self._concurrent = concurrent
        self.created: List[Middleware] = []
        self._by_fn: Dict[int, Middleware] = {}
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()

    def close(self) -> None:
        """Wait for the ``parallel`` pool's threads to end."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def record(self, fn: Any, lock: LockArg = False) -> Middleware:
        """A new record of ``fn`` (checked at once), with its lock: ``True`` the task's shared one."""
        check_middleware(fn)
        if lock is True:
            lock_obj: Optional[ContextManager] = self._shared_lock
        elif lock is False or lock is None:
            lock_obj = None
        elif hasattr(lock, "__enter__") and hasattr(lock, "__exit__"):
            lock_obj = lock
        else:
            raise TypeError(f"lock must be True, False or a lock object such as threading.Lock(), got {lock!r}")
        if isinstance(fn, Middleware):
            mw = Middleware(fn.fn, fn.name, lock_obj or fn.lock)
        else:
            mw = Middleware(fn, lock=lock_obj)
        self.created.append(mw)
        return mw

    def as_record(self, fn: Any) -> Middleware:
        """The record of ``fn``, made once per callable so repeated ``forward(fn)`` calls share timing."""
        if isinstance(fn, Middleware):
            return fn
        mw = self._by_fn.get(id(fn))
        if mw is None or mw.fn is not fn:
            mw = self._by_fn[id(fn)] = self.record(fn)
        return mw

    def named(self) -> List[Tuple[str, Middleware]]:
        """Every record made, with a unique name (``name#2`` for a second one of the same name)."""
        out: List[Tuple[str, Middleware]] = []
        taken: Set[str] = set()
        for mw in self.created:
            name, n = mw.name, 2
            while name in taken:
                name, n = f"{mw.name}#{n}", n + 1
            taken.add(name)
            out.append((name, mw))
        return out

    # --- the helpers -------------------------------------------------------------------------------
    def forward(self, fn: Callable[[Any], Any], ctx: Any) -> None:
        """Run ``fn``'s forward part; keep its backward part for :meth:`backward` (per thread)."""
        suspended = enter(self.as_record(fn), ctx)
        if suspended is not None:
            self._pending().append(suspended)

    def backward(self) -> None:
        """Run the backward parts kept by :meth:`forward`, most recent first."""
        unwind(self._pending())

    def serial(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running ``fns`` in order."""
        chain = [self.as_record(fn) for fn in fns]
        return compose(*chain, name=f"serial({', '.join(mw.name for mw in chain)})")

    def parallel(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running the forward parts of ``fns`` at once (in async mode), then their backward parts."""
        chain = [self.as_record(fn) for fn in fns]

        def parallel(ctx: Any) -> Iterator[None]:
            if self._concurrent() and len(chain) > 1:
                futures = [self._pool().submit(self._member, mw, ctx) for mw in chain]
                results = [f.result() for f in futures]
            else:
                results = [capture(enter, mw, ctx) for mw in chain]
            stack = [r for r in results if isinstance(r, Suspended)]
            errors = [r for r in results if isinstance(r, BaseException)]
            for other in errors[1:]:
                note(errors[0], f"another member also raised {type(other).__name__}: {other}")
            return hand_over(stack, errors[0] if errors else None)

        parallel.__qualname__ = parallel.__name__ = f"parallel({', '.join(mw.name for mw in chain)})"
        parallel._members = chain  # type: ignore[attr-defined]
        parallel._concurrent = True  # type: ignore[attr-defined]  # members' fields: see engine.declare.fields_of
        return parallel

    def wrap(self, fn: Callable[[Any], Any], lock: LockArg = False) -> Callable[[Any], Callable[[], None]]:
        """``wrapped(ctx)`` runs ``fn``'s forward part and returns a function running its backward part."""
        mw = self.record(fn, lock)

        def wrapped(ctx: Any) -> Callable[[], None]:
            suspended = enter(mw, ctx)
            stack = [suspended] if suspended is not None else []
            return lambda: unwind(stack)

        wrapped.__qualname__ = wrapped.__name__ = f"wrap({mw.name})"
        return wrapped

    def _member(self, mw: Middleware, ctx: Any) -> Any:
        """Enter one parallel member on a pool thread, where ``task.ctx`` is the calling iteration's context."""
        self._local.ctx = ctx
        try:
            return capture(enter, mw, ctx)
        finally:
            self._local.ctx = None

    def _pending(self) -> List[Suspended]:
        stack = getattr(self._local, "pending", None)
        if stack is None:
            stack = self._local.pending = []
        return stack

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="conveyor-parallel",
                                                    initializer=adopt_thread_settings)
            return self._executor


class TaskHelpers:
    """The composition helpers of :class:`~conveyor.engine.task.Task` (its ``_chain`` is a :class:`Chain`)."""

    _chain: Chain
    ctx: Any

    def forward(self, fn: Callable[[Any], Any], ctx: Optional[Any] = None) -> None:
        """Run the forward part of ``fn`` now; its backward part waits for :meth:`backward`."""
        self._chain.forward(fn, ctx if ctx is not None else self.ctx)

    def backward(self) -> None:
        """Run the backward parts left by :meth:`forward`, most recent first."""
        self._chain.backward()

    def serial(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running ``fns`` in order: all forward parts, then backward parts in reverse."""
        return self._chain.serial(*fns)

    def parallel(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running the forward parts of ``fns`` concurrently (in async mode), then their
        backward parts in reverse order. Inside a member, ``task.ctx`` is the calling iteration's context."""
        return self._chain.parallel(*fns)

    def wrap(self, fn: Callable[[Any], Any], lock: LockArg = False) -> Callable[[Any], Callable[[], None]]:
        """Make a middleware callable from inside another: ``back = wrapped(ctx)`` runs its forward part and
        returns ``back()``, which runs its backward part."""
        return self._chain.wrap(fn, lock)

