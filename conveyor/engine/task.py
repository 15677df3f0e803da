"""The task: the runtime that holds a pipeline's middleware and runs it over a context, loop after loop."""
from __future__ import annotations

import contextlib
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Union

from conveyor.engine.compose import (Middleware, Suspended, check_middleware, compose, enter, hand_over, leave,
                                     run_forward, unwind)
from conveyor.engine.context import Context
from conveyor.engine.events import EventBus
from conveyor.engine.pipeline import AsyncPipeline

__all__ = ["FINISH_EVENT", "Task", "task"]

FINISH_EVENT = "finish"
"""Emitted (locally, no args) when :meth:`Task.run` returns or raises."""

LockArg = Union[bool, ContextManager]


class Task:
    """Runs an ordered chain of middleware over a context, one iteration after another.

    Use the global instance: ``from conveyor import task``::

        with task.start(ctx=OnlineRLContext()):
            task.use(collector)
            task.use(learner)
            task.run(max_step=1000)
    """

    def __init__(self) -> None:
        self._shared_lock = threading.RLock()
        self._local = threading.local()
        self._reset()

    def _reset(self) -> None:
        self._middleware: List[Middleware] = []
        self._created: List[Middleware] = []
        self._by_fn: Dict[int, Middleware] = {}
        self._events = EventBus()
        self._started = False
        self._running = False
        self._async = False
        self._max_inflight = 2
        self._executor: Optional[ThreadPoolExecutor] = None
        self._base_ctx: Optional[Context] = None
        self._states: Dict[str, Any] = {}
        self._between: List[Callable[[], None]] = []
        self.finish = False

    # --- lifecycle ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def start(self, async_mode: bool = False, ctx: Optional[Context] = None, max_inflight: int = 2) -> Iterator["Task"]:
        """Open a pipeline; leaving the block resets middleware, event handlers, flags and stats.

        ``async_mode=True`` overlaps iterations (at most ``max_inflight`` in flight at once).
        """
        if self._started:
            raise RuntimeError("task.start() is already active: leave the current `with task.start():` block first")
        if ctx is not None and not isinstance(ctx, Context):
            raise TypeError(f"task.start(ctx=...) needs a conveyor Context instance, got {type(ctx).__name__}")
        if not isinstance(max_inflight, int) or isinstance(max_inflight, bool) or max_inflight < 1:
            raise ValueError(f"task.start(max_inflight={max_inflight!r}): must be an int >= 1")
        self._started = True
        self._async = bool(async_mode)
        self._max_inflight = max_inflight
        self._base_ctx = ctx if ctx is not None else Context()
        try:
            yield self
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._reset()

    @property
    def async_mode(self) -> bool:
        """Whether iterations overlap (set by :meth:`start`)."""
        return self._async

    @property
    def running(self) -> bool:
        """True while :meth:`run` is executing."""
        return self._running

    @property
    def ctx(self) -> Context:
        """The current context; inside an async pipeline, the context of the calling iteration."""
        current = getattr(self._local, "ctx", None)
        if current is not None:
            return current
        if self._base_ctx is None:
            raise RuntimeError("task.ctx exists only inside `with task.start():`")
        return self._base_ctx

    @property
    def middleware(self) -> List[Middleware]:
        """The chain, in order (a copy)."""
        return list(self._middleware)

    def __repr__(self) -> str:
        chain = " -> ".join(mw.name for mw in self._middleware) or "no middleware"
        mode = "async" if self._async else "sync"
        return f"<Task {mode}{' running' if self._running else ''}: {chain}>"

    # --- building the chain ------------------------------------------------------------------------
    def use(self, fn: Callable[[Any], Any], lock: LockArg = False) -> "Task":
        """Append a middleware (a callable taking ``ctx``) to the chain; returns the task for chaining.

        ``lock=True`` keeps it from running at the same time as other ``lock=True`` middleware; a lock
        object (e.g. ``threading.Lock()``) may be given instead to share it with chosen middleware.
        """
        if not self._started:
            raise RuntimeError("task.use() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError(f"cannot add middleware {fn!r} while the task is running")
        self._middleware.append(self._record(fn, lock))
        return self

    def _record(self, fn: Any, lock: LockArg = False) -> Middleware:
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
        self._created.append(mw)
        return mw

    # --- running -----------------------------------------------------------------------------------
    def run(self, max_step: int = sys.maxsize) -> None:
        """Run the chain ``max_step`` times, or until a middleware sets ``task.finish = True``.

        After each iteration the context is replaced by ``ctx.renew()``. An exception in a middleware
        stops the run and propagates, with the middleware's name in its notes. When the run ends, for
        whatever reason, the task emits :data:`FINISH_EVENT` locally so middleware can release files.
        """
        if not self._started:
            raise RuntimeError("task.run() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError("task.run() is already running")
        if not isinstance(max_step, int) or max_step < 0:
            raise ValueError(f"task.run(max_step={max_step!r}): must be an int >= 0")
        if not self._middleware and max_step == sys.maxsize:
            raise RuntimeError("task.run() with no middleware and no max_step would loop forever: add middleware "
                               "with task.use(...) first")
        self._running = True
        try:
            if self._async:
                self._run_async(max_step)
            else:
                self._run_sync(max_step)
        except BaseException as exc:
            self._running = False
            self._between.clear()
            self._events.emit(FINISH_EVENT, exc)
            raise
        self._running = False
        self._run_between()
        self._events.emit(FINISH_EVENT, None)

    def _run_sync(self, max_step: int) -> None:
        for _ in range(max_step):
            if self.finish:
                return
            stack: List[Suspended] = []
            self._local.end = False
            for mw in self._middleware:
                try:
                    suspended = enter(mw, self._base_ctx)
                except BaseException as exc:
                    unwind(stack, exc)
                    break
                if suspended is not None:
                    stack.append(suspended)
                if self._local.end:
                    break
            unwind(stack)
            self._base_ctx = self._next_ctx(self._base_ctx)
            self._run_between()

    # --- state (shim of engine hooks 1, 2 and 5 until the engine branch lands) ---------------------
    def end_iteration(self) -> None:
        """The middleware after the calling one are not entered in this iteration."""
        self._local.end = True

    def between_iterations(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once at the next point where no middleware runs."""
        self._between.append(fn)

    def _run_between(self) -> None:
        while self._between:
            self._between.pop(0)()

    def register_state(self, name: str, obj: Any) -> None:
        """Include ``obj`` (``state_dict``/``load_state_dict``) in :meth:`state_dict` under ``name``."""
        if name in self._states:
            raise ValueError(f"task.register_state: {name!r} is already registered")
        self._states[name] = obj

    def _stateful(self) -> Dict[str, Any]:
        return {f"{i}:{mw.name}": mw.fn for i, mw in enumerate(self._middleware)
                if hasattr(mw.fn, "state_dict") and hasattr(mw.fn, "load_state_dict")}

    def state_dict(self) -> Dict[str, Any]:
        """The whole pipeline's state: kept context fields, stateful middleware, registered objects."""
        ctx = self.ctx
        return {"ctx": {**ctx.state_dict(), "total_step": ctx.total_step},
                "middleware": {key: fn.state_dict() for key, fn in self._stateful().items()},
                "objects": {name: obj.state_dict() for name, obj in self._states.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into the current chain."""
        stateful = self._stateful()
        if set(stateful) != set(state["middleware"]):
            raise KeyError(f"task.load_state_dict: middleware {sorted(state['middleware'])} saved, "
                           f"{sorted(stateful)} in the chain")
        for key, fn in stateful.items():
            fn.load_state_dict(state["middleware"][key])
        for name, obj in self._states.items():
            obj.load_state_dict(state["objects"][name])
        kept = dict(state["ctx"])
        total_step = kept.pop("total_step")
        self._base_ctx.load_state_dict(kept)
        self._base_ctx.total_step = total_step

    def _run_async(self, max_step: int) -> None:
        if self.finish or max_step == 0:
            return
        template = self._base_ctx
        first = template.total_step

        def new_ctx(i: int) -> Context:
            if i == first:
                return template
            ctx = template._renew(template._store())  # kept fields shared by every iteration in flight
            ctx.total_step = i
            return ctx

        pipeline = AsyncPipeline(self._middleware, self._max_inflight, self._local)
        try:
            pipeline.run(first, max_step, new_ctx, lambda: self.finish)
        finally:
            self._base_ctx = self._next_ctx(pipeline.newest_done or template)

    def _next_ctx(self, ctx: Context) -> Context:
        new = ctx.renew()
        new.total_step = ctx.total_step + 1
        return new

    # --- composition helpers -----------------------------------------------------------------------
    def forward(self, fn: Callable[[Any], Any], ctx: Optional[Context] = None) -> None:
        """Run the forward part of ``fn`` now; its backward part waits for :meth:`backward`."""
        suspended = enter(self._as_record(fn), ctx if ctx is not None else self.ctx)
        if suspended is not None:
            self._pending().append(suspended)

    def backward(self) -> None:
        """Run the backward parts left by :meth:`forward`, most recent first."""
        unwind(self._pending())

    def renew(self) -> "Task":
        """Finish pending backward parts and move to a fresh context (``total_step`` + 1), for hand-written loops."""
        if self._running and self._async:
            raise RuntimeError("task.renew() is for hand-written loops; the async pipeline renews contexts itself")
        self.backward()
        self._base_ctx = self._next_ctx(self.ctx)
        return self

    def serial(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running ``fns`` in order: all forward parts, then backward parts in reverse."""
        chain = [self._as_record(fn) for fn in fns]
        return compose(*chain, name=f"serial({', '.join(mw.name for mw in chain)})")

    def parallel(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running the forward parts of ``fns`` concurrently (in async mode), then their
        backward parts in reverse order."""
        chain = [self._as_record(fn) for fn in fns]

        def parallel(ctx: Context) -> Iterator[None]:
            results: List[Any] = [None] * len(chain)
            if self._async and len(chain) > 1:
                futures = [self._pool().submit(_capture, enter, mw, ctx) for mw in chain]
                results = [f.result() for f in futures]
            else:
                results = [_capture(enter, mw, ctx) for mw in chain]
            stack = [r for r in results if isinstance(r, Suspended)]
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                unwind(stack, errors[0])  # raises unless a member's generator handles it
            yield from hand_over(stack)

        parallel.__qualname__ = parallel.__name__ = f"parallel({', '.join(mw.name for mw in chain)})"
        return parallel

    def wrap(self, fn: Callable[[Any], Any], lock: LockArg = False) -> Callable[[Context], Callable[[], None]]:
        """Make a middleware callable from inside another: ``back = wrapped(ctx)`` runs its forward part and
        returns ``back()``, which runs its backward part."""
        mw = self._record(fn, lock)

        def wrapped(ctx: Context) -> Callable[[], None]:
            suspended = enter(mw, ctx)

            def backward() -> None:
                if suspended is not None:
                    error = leave(suspended)
                    if error is not None:
                        raise error
            return backward

        wrapped.__qualname__ = wrapped.__name__ = f"wrap({mw.name})"
        return wrapped

    def _as_record(self, fn: Any) -> Middleware:
        """The record of ``fn``, made once per callable so repeated ``forward(fn)`` calls share timing."""
        if isinstance(fn, Middleware):
            return fn
        mw = self._by_fn.get(id(fn))
        if mw is None or mw.fn is not fn:
            mw = self._by_fn[id(fn)] = self._record(fn)
        return mw

    def _pending(self) -> List[Suspended]:
        stack = getattr(self._local, "pending", None)
        if stack is None:
            stack = self._local.pending = []
        return stack

    def _pool(self) -> ThreadPoolExecutor:
        with self._shared_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="conveyor-parallel")
            return self._executor

    # --- events ------------------------------------------------------------------------------------
    def on(self, name: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(*args)`` whenever ``name`` is emitted."""
        self._events.on(name, fn)

    def once(self, name: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(*args)`` the next time ``name`` is emitted."""
        self._events.once(name, fn)

    def off(self, name: str, fn: Optional[Callable[..., Any]] = None) -> None:
        """Unsubscribe ``fn`` (or every handler) from ``name``."""
        self._events.off(name, fn)

    def emit(self, name: str, *args: Any, only_local: bool = False, only_remote: bool = False) -> None:
        """Emit an event. ``only_remote`` skips local handlers (remote delivery comes with the multi-node
        mode); ``only_local`` will keep it from being sent to other nodes."""
        if only_local and only_remote:
            raise ValueError("task.emit(): only_local and only_remote cannot both be True")
        if not only_remote:
            self._events.emit(name, *args)

    def wait_for(self, name: str, timeout: Optional[float] = None) -> tuple:
        """Block until ``name`` is emitted and return its args; ``TimeoutError`` after ``timeout`` seconds."""
        return self._events.wait_for(name, timeout)

    # --- profiling ---------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per middleware name: ``calls``, ``total_s``, ``mean_s``, ``p95_s`` (forward + backward time)."""
        out: Dict[str, Dict[str, float]] = {}
        for mw in self._created:
            name, n = mw.name, 2
            while name in out:
                name, n = f"{mw.name}#{n}", n + 1
            out[name] = mw.timing.summary()
        return out


def _capture(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn``; return its exception instead of raising it (for gathering parallel results)."""
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


task = Task()
