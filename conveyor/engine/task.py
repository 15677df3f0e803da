"""The task: the runtime that holds a pipeline's middleware and runs it over a context, loop after loop."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import fnmatch
import inspect
import sys
import threading
import typing
from concurrent.futures import ThreadPoolExecutor
from typing import (Any, Callable, ContextManager, Dict, FrozenSet, Generator, Iterable, Iterator, List, Optional, Set,
                    Tuple, Union)

from conveyor.engine.compose import (Middleware, Suspended, check_middleware, compose, enter, hand_over,
                                     middleware_name, note, onion, unwind)
from conveyor.engine.context import Context
from conveyor.engine.declare import PipelineError, PipelineTable, Row, fields_of, order_problems
from conveyor.engine.events import EventBus
from conveyor.engine.pipeline import AsyncPipeline, adopt_thread_settings

__all__ = ["CLOSE_EVENT", "FINISH_EVENT", "Inspection", "PEER_LOST_EVENT", "Role", "STOP_EVENT", "Task", "task"]

FINISH_EVENT = "finish"
"""Emitted locally when :meth:`Task.run` ends, with one argument: the exception that ended it, or None."""

CLOSE_EVENT = "close"
"""Emitted locally, no args, when the ``with task.start():`` block exits: close files and bars here."""

STOP_EVENT = "stop"
"""Emitted locally, no args, when this process is asked to stop (SIGTERM to a ``Parallel`` worker inside
:meth:`Task.run`): ``task.finish`` is already set; a middleware that waits for a message stops waiting."""

PEER_LOST_EVENT = "peer_lost"
"""Emitted locally, with the node id, when a peer leaves: the attached router lost it (dead, disconnected
or closed) or, in a ``Parallel`` worker, its ``main`` returned (then again when it closes)."""

_LOCAL_EVENTS = (FINISH_EVENT, CLOSE_EVENT, STOP_EVENT, PEER_LOST_EVENT)

LockArg = Union[bool, ContextManager]


class Role(str, enum.Enum):
    """What a process does in a multi-process run (``task.role.LEARNER`` ...); see :meth:`Task.add_role`."""

    LEARNER = "learner"
    COLLECTOR = "collector"
    EVALUATOR = "evaluator"


def void(ctx: Any) -> None:
    """The no-op middleware (:meth:`Task.void`)."""


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
        self._between_lock = threading.Lock()
        self._router: Any = None
        self._routed: Dict[str, Callable[[Any], Any]] = {}
        self._route_lock = threading.RLock()
        self._inspection: Optional[Inspection] = None
        self._reset()

    def _reset(self) -> None:
        self._middleware: List[Middleware] = []
        self._uses: List[Tuple[Any, Optional[Role], bool]] = []  # (record, or fn left out; role; whether it runs)
        self._iteration: Optional[Generator[Context, None, None]] = None  # the run in progress, if any
        self._created: List[Middleware] = []
        self._by_fn: Dict[int, Middleware] = {}
        self._events = EventBus()
        self._started = False
        self._running = False
        self._async = False
        self._max_inflight = 2
        self._executor: Optional[ThreadPoolExecutor] = None
        self._base_ctx: Optional[Context] = None
        self._pipeline: Optional[AsyncPipeline] = None
        self._last_done = -1
        self._between: List[Callable[[], None]] = []
        self._objects: Dict[str, Any] = {}
        self._roles: Set[Role] = set()
        self._role_bound = False
        self.finish = False

    # --- lifecycle ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def start(self, async_mode: bool = False, ctx: Optional[Context] = None, max_inflight: int = 2) -> Iterator["Task"]:
        """Open a pipeline; leaving the block emits :data:`CLOSE_EVENT`, then resets middleware, event
        handlers, registered state, flags and stats.

        ``ctx`` is the first iteration's context; every later one shares its kept values. ``async_mode=True``
        overlaps iterations (at most ``max_inflight`` in flight at once).
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
            try:
                if self._iteration is not None:  # an iterate() loop left open: end its run first
                    self._iteration.close()
                self._events.emit(CLOSE_EVENT)
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                self._unroute(list(self._routed))
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
        """Inside a middleware, the calling iteration's context (also on a ``parallel`` member's pool thread);
        elsewhere the next iteration's: ``total_step`` = iterations completed, kept values as they left them."""
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

    # --- roles and labels ---------------------------------------------------------------------------
    role = Role
    """The roles: ``task.role.LEARNER``, ``task.role.COLLECTOR``, ``task.role.EVALUATOR``."""

    def add_role(self, role: Role) -> "Task":
        """Give this process ``role`` (a :class:`Role`); it then has only the roles added. Roles are cleared when
        the ``with task.start():`` block exits. Add them before any ``task.use(..., role=...)``."""
        if not isinstance(role, Role):
            raise TypeError(f"task.add_role({role!r}): needs one of {', '.join('task.role.' + r.name for r in Role)}")
        if self._role_bound and role not in self._roles:
            raise RuntimeError(f"task.add_role({role}): middleware were already added with task.use(..., role=...), "
                               f"and which of them run was decided then; add roles first")
        self._roles.add(role)
        return self

    def has_role(self, role: Role) -> bool:
        """Whether this process has ``role``: True for every role when none was added (one process runs everything)."""
        if not isinstance(role, Role):
            raise TypeError(f"task.has_role({role!r}): needs one of {', '.join('task.role.' + r.name for r in Role)}")
        return not self._roles or role in self._roles

    @property
    def roles(self) -> FrozenSet[Role]:
        """The roles added (empty: this process has every role)."""
        return frozenset(self._roles)

    @property
    def labels(self) -> Set[str]:
        """This worker's labels (``Parallel.runner(labels=...)``); empty without a router that has labels."""
        return set(getattr(self._router, "labels", None) or ())

    def match_labels(self, patterns: Union[str, Iterable[str]]) -> bool:
        """Whether any label matches any of ``patterns`` (fnmatch-style, case-sensitive: ``"gpu*"``, ``"node[12]"``)."""
        if isinstance(patterns, str):
            patterns = [patterns]
        patterns = list(patterns)
        for pattern in patterns:
            if not isinstance(pattern, str):
                raise TypeError(f"task.match_labels({patterns!r}): patterns must be strings, got {pattern!r}")
        return any(fnmatch.fnmatchcase(label, pattern) for label in self.labels for pattern in patterns)

    @staticmethod
    def void() -> Callable[[Any], None]:
        """A middleware that does nothing (for a slot that is empty on some nodes)."""
        return void

    # --- building the chain ------------------------------------------------------------------------
    def use(self, fn: Callable[[Any], Any], lock: LockArg = False, role: Optional[Role] = None) -> "Task":
        """Append a middleware (a callable taking ``ctx``) to the chain; returns the task for chaining.

        ``lock=True`` keeps it from running at the same time as other ``lock=True`` middleware; a lock
        object (e.g. ``threading.Lock()``) may be given instead to share it with chosen middleware.
        ``role``: the middleware belongs to that role and is left out of the chain (a no-op) in a process
        that lacks it (:meth:`has_role`), so one ``main()`` serves every node.
        """
        if not self._started:
            raise RuntimeError("task.use() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError(f"cannot add middleware {fn!r} while the task is running")
        if role is not None:
            if not isinstance(role, Role):
                raise TypeError(f"task.use(..., role={role!r}): needs one of "
                                f"{', '.join('task.role.' + r.name for r in Role)}")
            self._role_bound = True
            if not self.has_role(role):
                check_middleware(fn)
                self._uses.append((fn, role, False))
                return self
        mw = self._record(fn, lock)
        self._middleware.append(mw)
        self._uses.append((mw, role, True))
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

        First the declared fields are checked (:meth:`describe`): a :class:`PipelineError` names a middleware
        that reads a field before anything writes it. Each iteration gets a fresh context (kept fields carried
        over, ``total_step`` = its index). An exception in a middleware stops the run and propagates, with the
        middleware's name in its notes; kept fields then hold what the last completed iteration left. When the
        run ends, pending :meth:`between_iterations` callbacks run, then :data:`FINISH_EVENT` is emitted with
        the error or None.
        """
        max_step = self._prepare_run("run", max_step)
        loop = self._loop(max_step)
        try:
            for _ in loop:
                pass
        except BaseException as exc:
            if inspect.getgeneratorstate(loop) != inspect.GEN_SUSPENDED:
                raise
            loop.throw(exc)  # Ctrl-C between two iterations: the run ends as on one inside an iteration

    def iterate(self, max_step: int = sys.maxsize) -> Iterator[Dict[str, Any]]:
        """:meth:`run` as a generator (sync mode): after each iteration, yields what it left.

        Each item holds ``total_step`` (the iteration's index), the iteration context's scalar fields
        (``int``, ``float``, ``bool``, ``str`` or ``Optional`` of these: ``env_step``, ``train_iter``,
        ``eval_value`` ... in RL contexts) and ``time_s``, each middleware's seconds in it (names as in
        :meth:`stats`). Between items nothing runs; leaving the loop early (``break``, ``close()``, leaving
        ``task.start``) ends the run as if ``max_step`` had been reached there: callbacks, :data:`FINISH_EVENT`.
        In async mode iterations overlap, so there is no point between two of them to stop at: use :meth:`run`.
        """
        if self._async:
            raise RuntimeError("task.iterate() steps a sync pipeline; in async mode iterations overlap, so use "
                               "task.run(), or task.start(async_mode=False)")
        max_step = self._prepare_run("iterate", max_step)
        return self._logs(self._loop(max_step))

    def _prepare_run(self, what: str, max_step: int) -> int:
        """The checks before a run starts, done at the call (also for :meth:`iterate`, whose loop starts later);
        returns how many iterations to run (fewer under :meth:`inspecting`)."""
        if not self._started:
            raise RuntimeError(f"task.{what}() must be called inside `with task.start():`")
        if self._running or self._iteration is not None:
            raise RuntimeError(f"task.{what}(): a run is already in progress")
        if not isinstance(max_step, int) or max_step < 0:
            raise ValueError(f"task.{what}(max_step={max_step!r}): must be an int >= 0")
        if not self._middleware and max_step == sys.maxsize:
            raise RuntimeError(f"task.{what}() with no middleware and no max_step would loop forever: add middleware "
                               "with task.use(...) first")
        table = self.describe()
        inspection = self._inspection
        if inspection is not None:
            if inspection.table is None:
                inspection.table = table
            if inspection.iterations == 0:
                raise _Described()
        if table.problems:
            raise PipelineError(f"the pipeline's order does not fit its declared fields: {'; '.join(table.problems)}")
        return max_step if inspection is None else min(max_step, inspection.iterations)

    def _loop(self, max_step: int) -> Generator[Context, None, None]:
        """The one run loop of :meth:`run` and :meth:`iterate`: yields each completed iteration's context (sync
        mode; async mode yields nothing). Closing it between iterations ends the run normally."""
        if self._running:
            raise RuntimeError("task: a run is already in progress")
        store = self._base_ctx._store()
        store.begin(journal=self._async)
        first = self._base_ctx.total_step
        self._last_done = first - 1
        self._running = True
        error: Optional[BaseException] = None
        try:
            if self._async:
                self._run_async(max_step)
            else:
                yield from self._run_sync(max_step)
        except GeneratorExit:
            pass  # the caller stopped iterating between two iterations: the run ends after the last one
        except BaseException as exc:
            error = exc
        store.end(rollback=error is not None)
        if self._inspection is not None:
            self._inspection.completed += self._last_done + 1 - first
        if error is not None or self._base_ctx.total_step != self._last_done + 1:
            try:
                self._base_ctx = self._fresh(self._last_done + 1)
            except BaseException as exc:  # the context class cannot be renewed: keep the one we have
                error = _first(error, exc, "creating the next context")
                self._base_ctx.total_step = self._last_done + 1
        self._pipeline = None
        self._running = False
        error = self._run_pending(error)
        try:
            self._events.emit(FINISH_EVENT, error)
        except BaseException as exc:
            error = _first(error, exc, "a FINISH_EVENT handler")
        if error is not None:
            raise error

    def _logs(self, loop: Generator[Context, None, None]) -> Generator[Dict[str, Any], None, None]:
        """:meth:`iterate`'s items, one per context ``loop`` yields; closing this closes the loop."""
        if self._running or self._iteration is not None:
            raise RuntimeError("task.iterate(): a run is already in progress")
        self._iteration = loop
        try:
            before = {id(mw): mw.timing.total for mw in self._created}
            for ctx in loop:
                now = {id(mw): mw.timing.total for mw in self._created}
                times = {name: now[id(mw)] - before.get(id(mw), 0.0) for name, mw in self._named()}
                before = now
                yield {"total_step": ctx.total_step, **_scalars(ctx), "time_s": times}
        finally:
            if self._iteration is loop:
                self._iteration = None
            loop.close()

    def _run_sync(self, max_step: int) -> Iterator[Context]:
        chain = self._middleware
        for _ in range(max_step):
            if self.finish:
                return
            ctx = self._base_ctx
            for _ in onion(chain, ctx):
                pass
            self._completed(self._last_done + 1)
            self._base_ctx = self._fresh(self._last_done + 1)
            if self._between:
                self._quiescent()
            yield ctx

    def _run_async(self, max_step: int) -> None:
        if self.finish or max_step == 0:
            return
        first_ctx = self._base_ctx
        first = first_ctx.total_step

        def new_ctx(i: int) -> Context:
            return first_ctx if i == first else self._fresh(i)

        self._pipeline = AsyncPipeline(self._middleware, self._max_inflight, self._local)
        self._pipeline.run(first, max_step, new_ctx, lambda: self.finish, self._completed, self._quiescent)

    def _fresh(self, step: int) -> Context:
        """A new context for iteration ``step``, sharing the pipeline's kept values."""
        new = self._base_ctx._renew(self._base_ctx._store())
        new.total_step = step
        return new

    def _completed(self, i: int) -> None:
        """Iteration ``i`` completed (called in order): what it wrote to kept fields is final."""
        self._base_ctx._store().commit(i)
        self._last_done = i

    def _quiescent(self) -> None:
        """No middleware is running: move ``task.ctx`` to the next iteration and run the pending callbacks."""
        self._base_ctx = self._fresh(self._last_done + 1)
        error = self._run_pending(None)
        self._base_ctx._store().commit()
        if error is not None:
            raise error

    def _run_pending(self, error: Optional[BaseException]) -> Optional[BaseException]:
        """Run the pending :meth:`between_iterations` callbacks; return ``error`` or the first one they raised."""
        with self._between_lock:
            callbacks, self._between = self._between, []
        for fn in callbacks:
            try:
                fn()
            except BaseException as exc:
                error = _first(error, exc, "a between_iterations callback")
        return error

    def between_iterations(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once at the next quiescent point, when no middleware is running.

        Sync mode: right after the current iteration has finished (its context renewed). Async mode:
        no new iteration starts, those in flight finish, ``fn`` runs on the thread that called
        :meth:`run`, then the pipeline goes on. Inside ``fn``, :meth:`state_dict` is a consistent cut.
        Never blocks the caller; outside :meth:`run` it calls ``fn`` at once. Callbacks still pending
        when the run ends run then, before :data:`FINISH_EVENT`.
        """
        if not callable(fn):
            raise TypeError(f"task.between_iterations() needs a callable taking no arguments, got {fn!r}")
        if not self._started:
            raise RuntimeError("task.between_iterations() must be called inside `with task.start():`")
        with self._between_lock:
            self._between.append(fn)
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline.request_pause()
        elif not self._running:
            error = self._run_pending(None)
            if error is not None:
                raise error

    def end_iteration(self) -> None:
        """From a middleware's forward part: enter no further middleware in this iteration.

        Backward parts of the middleware already entered run as usual and the iteration counts as
        completed. With ``task.finish = True`` set as well, the run ends right there.
        """
        if not self._running:
            raise RuntimeError("task.end_iteration() is for middleware, while task.run() is running")
        self.ctx._ended = True

    # --- state -------------------------------------------------------------------------------------
    def register_state(self, name: str, obj: Any) -> None:
        """Include ``obj`` (with ``state_dict()`` / ``load_state_dict()``) in :meth:`state_dict` under ``name``."""
        if not self._started:
            raise RuntimeError("task.register_state() must be called inside `with task.start():`")
        if not isinstance(name, str) or not name:
            raise ValueError(f"task.register_state(name={name!r}): the name must be a non-empty string")
        if name in self._objects:
            raise ValueError(f"task.register_state('{name}'): already registered ({self._objects[name]!r}); "
                             f"use another name")
        if not _stateful(obj):
            raise TypeError(f"task.register_state('{name}', {obj!r}): the object needs state_dict() and "
                            f"load_state_dict() methods")
        self._objects[name] = obj

    def state_dict(self) -> Dict[str, Any]:
        """The whole pipeline's state: the context's kept fields and ``total_step``, every stateful middleware
        of the chain (members of compositions included), every object given to :meth:`register_state`.

        Keys of ``"middleware"`` are ``"<position>:<name>"`` (``"2.1:trainer"`` for the second member of
        the third middleware), stable across runs of the same pipeline script. Called inside a
        :meth:`between_iterations` callback or outside :meth:`run`, it is a consistent cut.
        """
        ctx = self.ctx
        return {"ctx": {**ctx.state_dict(), "total_step": ctx.total_step},
                "middleware": {key: fn.state_dict() for key, fn in self._stateful_middleware().items()},
                "objects": {name: obj.state_dict() for name, obj in self._objects.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into the current chain (after the ``use`` calls, before :meth:`run`)."""
        if not self._started:
            raise RuntimeError("task.load_state_dict() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError("task.load_state_dict() cannot be called while the task is running")
        middleware = self._stateful_middleware()
        saved_mw, saved_obj = state.get("middleware", {}), state.get("objects", {})
        for what, ours, saved in (("middleware", middleware, saved_mw), ("objects", self._objects, saved_obj)):
            if set(ours) != set(saved):
                raise ValueError(f"task.load_state_dict: {what} differ from the checkpoint's: missing "
                                 f"{sorted(set(ours) - set(saved))}, unexpected {sorted(set(saved) - set(ours))}; "
                                 f"was it saved by another pipeline?")
        kept = dict(state.get("ctx", {}))
        total_step = kept.pop("total_step", None)
        self._base_ctx.load_state_dict(kept)
        if total_step is not None:
            self._base_ctx.total_step = total_step
        for key, fn in middleware.items():
            fn.load_state_dict(saved_mw[key])
        for name, obj in self._objects.items():
            obj.load_state_dict(saved_obj[name])

    def _stateful_middleware(self) -> Dict[str, Any]:
        """``"<position>:<name>"`` -> the middleware object, for every stateful one, depth first."""
        found: Dict[str, Any] = {}

        def walk(chain: List[Middleware], prefix: str) -> None:
            for k, mw in enumerate(chain):
                if _stateful(mw.fn):
                    found[f"{prefix}{k}:{mw.name}"] = mw.fn
                walk(getattr(mw.fn, "_members", []), f"{prefix}{k}.")

        walk(self._middleware, "")
        return found

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
        if self._running:
            raise RuntimeError("task.renew() is for hand-written loops; task.run() renews contexts itself")
        self.backward()
        self._base_ctx = self._fresh(self._base_ctx.total_step + 1)
        return self

    def serial(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running ``fns`` in order: all forward parts, then backward parts in reverse."""
        chain = [self._as_record(fn) for fn in fns]
        return compose(*chain, name=f"serial({', '.join(mw.name for mw in chain)})")

    def parallel(self, *fns: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One middleware running the forward parts of ``fns`` concurrently (in async mode), then their
        backward parts in reverse order. Inside a member, ``task.ctx`` is the calling iteration's context."""
        chain = [self._as_record(fn) for fn in fns]

        def parallel(ctx: Context) -> Iterator[None]:
            if self._async and len(chain) > 1:
                futures = [self._pool().submit(self._member, mw, ctx) for mw in chain]
                results = [f.result() for f in futures]
            else:
                results = [_capture(enter, mw, ctx) for mw in chain]
            stack = [r for r in results if isinstance(r, Suspended)]
            errors = [r for r in results if isinstance(r, BaseException)]
            for other in errors[1:]:
                note(errors[0], f"another member also raised {type(other).__name__}: {other}")
            return hand_over(stack, errors[0] if errors else None)

        parallel.__qualname__ = parallel.__name__ = f"parallel({', '.join(mw.name for mw in chain)})"
        parallel._members = chain  # type: ignore[attr-defined]
        parallel._concurrent = True  # type: ignore[attr-defined]  # members' fields: see engine.declare.fields_of
        return parallel

    def _member(self, mw: Middleware, ctx: Context) -> Any:
        """Enter one parallel member on a pool thread, where ``task.ctx`` is the calling iteration's context."""
        self._local.ctx = ctx
        try:
            return _capture(enter, mw, ctx)
        finally:
            self._local.ctx = None

    def wrap(self, fn: Callable[[Any], Any], lock: LockArg = False) -> Callable[[Context], Callable[[], None]]:
        """Make a middleware callable from inside another: ``back = wrapped(ctx)`` runs its forward part and
        returns ``back()``, which runs its backward part."""
        mw = self._record(fn, lock)

        def wrapped(ctx: Context) -> Callable[[], None]:
            suspended = enter(mw, ctx)
            stack = [suspended] if suspended is not None else []
            return lambda: unwind(stack)

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
                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="conveyor-parallel",
                                                    initializer=adopt_thread_settings)
            return self._executor

    # --- events ------------------------------------------------------------------------------------
    @property
    def router(self) -> Any:
        """The router given to :meth:`attach_router`, or None in a single-process run."""
        return self._router

    def attach_router(self, router: Any) -> None:
        """Make events cross processes through ``router`` (a ``conveyor.engine.parallel.Router``).

        From then on :meth:`emit` also publishes to the nodes that listen to the event (``only_local``
        keeps it here, ``only_remote`` skips this node's handlers), and :meth:`on` / :meth:`once` /
        :meth:`wait_for` subscribe this node to it; remote events run the handlers on the router's
        receive thread. :data:`FINISH_EVENT`, :data:`CLOSE_EVENT`, :data:`STOP_EVENT` and
        :data:`PEER_LOST_EVENT` stay local; the router's lost peers are emitted as :data:`PEER_LOST_EVENT`.
        The router outlives ``task.start()`` blocks, its subscriptions do not: leaving a block, or removing
        an event's last handler with :meth:`off`, unsubscribes. :meth:`detach_router` undoes all this.
        """
        if not (callable(getattr(router, "publish", None)) and callable(getattr(router, "on", None))):
            raise TypeError(f"task.attach_router({router!r}): needs a router with publish() and on()")
        if self._router is not None and self._router is not router:
            raise RuntimeError("task.attach_router(): a router is already attached; detach_router() first")
        if self._router is router:
            return
        self._router = router
        if callable(getattr(router, "on_peer_lost", None)):
            router.on_peer_lost(self._peer_lost)
        for name in self._events.names():
            self._route(name)

    def detach_router(self) -> None:
        """Stop sending events to other nodes and delivering theirs (the router's subscriptions are removed)."""
        router = self._router
        if router is None:
            return
        self._unroute(list(self._routed))
        if callable(getattr(router, "off_peer_lost", None)):
            router.off_peer_lost(self._peer_lost)
        self._router = None

    def _peer_lost(self, node: Any) -> None:
        self._events.emit(PEER_LOST_EVENT, node)

    def _route(self, name: str) -> None:
        """Deliver ``name`` from other nodes to this node's handlers (subscribing once per name)."""
        with self._route_lock:
            router = self._router
            if router is None or name in self._routed or name in _LOCAL_EVENTS:
                return
            handler = self._routed[name] = lambda args: self._router is router and self._events.emit(name, *args)
            router.on(name, handler)

    def _unroute(self, names: List[str], only_unused: bool = False) -> None:
        """Remove the router's handlers of ``names`` (only of those with no local handler left, if ``only_unused``)."""
        with self._route_lock:
            for name in names:
                if name in self._routed and not (only_unused and self._events.handlers(name)):
                    handler = self._routed.pop(name)
                    off = getattr(self._router, "off", None)
                    if callable(off):
                        off(name, handler)

    def on(self, name: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(*args)`` whenever ``name`` is emitted (on any node, once a router is attached)."""
        with self._route_lock:
            self._events.on(name, fn)
            self._route(name)

    def once(self, name: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(*args)`` the next time ``name`` is emitted."""
        with self._route_lock:
            self._events.once(name, fn)
            self._route(name)

    def off(self, name: str, fn: Optional[Callable[..., Any]] = None) -> None:
        """Unsubscribe ``fn`` (or every handler) from ``name``; other nodes stop sending it once none is left."""
        with self._route_lock:
            self._events.off(name, fn)
            self._unroute([name], only_unused=True)

    def emit(self, name: str, *args: Any, only_local: bool = False, only_remote: bool = False) -> None:
        """Emit an event: to this node's handlers unless ``only_remote``, and, with a router attached, to
        the other nodes listening to ``name`` unless ``only_local`` (``args`` must then be encodable)."""
        if only_local and only_remote:
            raise ValueError("task.emit(): only_local and only_remote cannot both be True")
        if self._router is not None and not only_local and name not in _LOCAL_EVENTS:
            self._router.publish(name, args)
        if not only_remote:
            self._events.emit(name, *args)

    def wait_for(self, name: str, timeout: Optional[float] = None) -> tuple:
        """Block until ``name`` is emitted (here or, with a router, on another node) and return its args;
        ``TimeoutError`` after ``timeout`` seconds."""
        self._route(name)
        return self._events.wait_for(name, timeout)

    # --- profiling ---------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per middleware name: ``calls``, ``total_s``, ``mean_s``, ``p95_s`` (forward + backward time)."""
        return {name: mw.timing.summary() for name, mw in self._named()}

    def _named(self) -> List[Tuple[str, Middleware]]:
        """Every middleware record made, with a unique name (``name#2`` for a second one of the same name)."""
        out: List[Tuple[str, Middleware]] = []
        taken: Set[str] = set()
        for mw in self._created:
            name, n = mw.name, 2
            while name in taken:
                name, n = f"{mw.name}#{n}", n + 1
            taken.add(name)
            out.append((name, mw))
        return out

    # --- inspection --------------------------------------------------------------------------------
    def describe(self) -> PipelineTable:
        """The pipeline as a table: each middleware's name, the context fields it declares it reads and
        writes (:func:`~conveyor.engine.declares`), its role, and the ordering problems :meth:`run` rejects.
        Middleware left out for a role this process lacks are listed, marked inactive."""
        rows = []
        for k, (fn, role, active) in enumerate(self._uses, 1):
            name = fn.name if isinstance(fn, Middleware) else middleware_name(fn)
            rows.append(Row(k, name, fields_of(fn), None if role is None else role.value, active))
        ctx = self._base_ctx
        return PipelineTable(rows, order_problems(rows, () if ctx is None else ctx.kept_fields,
                                                  None if ctx is None else type(ctx)))

    @contextlib.contextmanager
    def inspecting(self, iterations: int = 0) -> Iterator["Inspection"]:
        """Run code that builds and runs a pipeline (an entry's ``main()``) for at most ``iterations``
        iterations per run; the yielded :class:`Inspection` gets the first run's :meth:`describe` table and the
        number of iterations completed.

        ``iterations=0``: the run call stops that code before the first iteration, as an error would (its
        ``with`` blocks close what they opened) and the ``with`` block ends quietly: how ``conveyor describe``
        reads an entry's pipeline without training. Otherwise runs end after ``iterations`` and the code goes
        on (``conveyor.testing.check_pipeline``).
        """
        if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 0:
            raise ValueError(f"task.inspecting(iterations={iterations!r}): must be an int >= 0")
        if self._inspection is not None:
            raise RuntimeError("task.inspecting() is already active")
        found = self._inspection = Inspection(iterations)
        try:
            yield found
        except _Described:
            pass
        finally:
            self._inspection = None


class Inspection:
    """What :meth:`Task.inspecting` found: the first run's pipeline table (None if nothing ran) and the number
    of iterations completed."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.table: Optional[PipelineTable] = None
        self.completed = 0


class _Described(BaseException):
    """Raised by run() under :meth:`Task.inspecting`, to leave the code that built the pipeline; a
    BaseException, so ``except Exception`` in that code lets it through."""


_SCALARS = (int, float, bool, str)
_scalar_fields: Dict[type, Tuple[str, ...]] = {}


def _scalars(ctx: Context) -> Dict[str, Any]:
    """The context's fields annotated as int, float, bool, str, or Optional of one of these, with their values."""
    cls = type(ctx)
    names = _scalar_fields.get(cls)
    if names is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # annotations that do not resolve: only the plainly scalar ones count
            hints = {f.name: f.type if isinstance(f.type, type) else object for f in dataclasses.fields(cls)}
        names = _scalar_fields[cls] = tuple(
            f.name for f in dataclasses.fields(cls) if f.name != "total_step" and
            all(t in _SCALARS or t is type(None) for t in (typing.get_args(hints[f.name]) or (hints[f.name],))))
    return {name: getattr(ctx, name) for name in names}


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _first(error: Optional[BaseException], exc: BaseException, where: str) -> BaseException:
    """The error to raise: ``error`` if there is one (``exc`` noted on it), else ``exc``."""
    if error is None:
        return exc
    note(error, f"{where} also raised {type(exc).__name__}: {exc}")
    return error


def _capture(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn``; return its exception instead of raising it (for gathering parallel results)."""
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


task = Task()
