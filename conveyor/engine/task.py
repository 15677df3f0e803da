"""The task: the runtime that holds a pipeline's middleware and runs it over a context, loop after loop.

This module keeps the loop and the public face (DI-engine's names: ``use``, ``run``, ``forward``, ``backward``,
``renew``, ``wrap``, ``emit``, ``on``, ``once``, ``off``, ``wait_for``, ``finish`` ...). The rest lives beside
it: events and the router glue in :mod:`~conveyor.engine.task_events`, roles in :mod:`~conveyor.engine.roles`,
records and composition helpers in :mod:`~conveyor.engine.chain`, the async loop in
:mod:`~conveyor.engine.pipeline`, state in :mod:`~conveyor.engine.state`, tables in :mod:`~conveyor.engine.inspection`.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Tuple

from conveyor.engine.chain import Chain, LockArg, TaskHelpers
from conveyor.engine.compose import Middleware, check_middleware, note, onion
from conveyor.engine.context import Context, Kept
from conveyor.engine.declare import PipelineError
from conveyor.engine.inspection import Described, Inspection, TaskInspection, scalars
from conveyor.engine.pipeline import AsyncPipeline
from conveyor.engine.roles import Role, Roles, TaskRoles
from conveyor.engine.task_events import CLOSE_EVENT, FINISH_EVENT, PEER_LOST_EVENT, STOP_EVENT, Events, TaskEvents
from conveyor.engine.state import PipelineState

__all__ = ["CLOSE_EVENT", "FINISH_EVENT", "Inspection", "PEER_LOST_EVENT", "Role", "STOP_EVENT", "Task", "task"]

Wrapper = Callable[[Callable[[Any], Any]], Callable[[Any], Any]]


class Task(TaskRoles, TaskEvents, TaskHelpers, TaskInspection):
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
        self._inspection: Optional[Inspection] = None
        self._routing = Events(self._finish_heard)
        self._ahead = False  # spans the start of a `with task.start()` block: not reset with it
        self._reset()

    def _reset(self) -> None:
        self._middleware: List[Middleware] = []
        self._uses: List[Tuple[Any, Optional[Role], bool]] = []  # (record, or fn left out; role; whether it runs)
        self._wrappers: List[Wrapper] = []
        self._iteration: Optional[Generator[Context, None, None]] = None  # the run in progress, if any
        self._chain = Chain(self._shared_lock, self._local, lambda: self._async)
        self._routing.reset()
        self._started = False
        self._running = False
        self._async = False
        self._max_inflight = 2
        self._base_ctx: Optional[Context] = None
        self._kept = Kept()
        self._pipeline: Optional[AsyncPipeline] = None
        self._last_done = -1
        self._between: List[Callable[[], None]] = []
        self._state = PipelineState()
        self._roles = Roles()
        self._finish = False
        self._finish_tell = False  # tell the other nodes when the run ends: finish was set here, or heard first here

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
        self._kept = Kept.of(self._base_ctx)  # what keep carries over, shared by every context of the block
        try:
            yield self
        finally:
            try:
                if self._iteration is not None:  # an iterate() loop left open: end its run first
                    self._iteration.close()
                self._routing.bus.emit(CLOSE_EVENT)
            finally:
                self._chain.close()
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
    def run_ahead(self) -> bool:
        """True inside :meth:`ahead_of_run` until :meth:`run` starts: a run of this process is on its way."""
        return self._ahead

    @contextlib.contextmanager
    def ahead_of_run(self) -> Iterator[None]:
        """While inside, until :meth:`run` starts, a run of this process is on its way (its pipeline being built):
        ``finish`` set meanwhile ends that run as it starts, its FINISH_EVENT handlers run (a ``CkptSaver`` writes
        ``final``); a ``Parallel.runner`` worker's first SIGTERM then sets it instead of stopping the worker."""
        self._ahead = True
        try:
            yield
        finally:
            self._ahead = False

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

    # --- building the chain ------------------------------------------------------------------------
    def use(self, fn: Callable[[Any], Any], lock: LockArg = False, role: Optional[Role] = None) -> "Task":
        """Append a middleware (a callable taking ``ctx``) to the chain; returns the task for chaining.

        ``lock=True`` keeps it from running at the same time as other ``lock=True`` middleware; a lock
        object (e.g. ``threading.Lock()``) may be given instead to share it with chosen middleware.
        ``role``: the middleware belongs to that role and is left out of the chain (a no-op) in a process
        that lacks it (:meth:`has_role`), so one ``main()`` serves every node. The wrappers given to
        :meth:`use_wrapper` wrap it.
        """
        if not self._started:
            raise RuntimeError("task.use() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError(f"cannot add middleware {fn!r} while the task is running")
        if role is not None and not self._roles.bind(role):
            check_middleware(fn)
            self._uses.append((fn, role, False))
            return self
        check_middleware(fn)
        for wrapper in self._wrappers:
            fn = wrapper(fn)
        mw = self._chain.record(fn, lock)
        self._middleware.append(mw)
        self._uses.append((mw, role, True))
        return self

    def use_wrapper(self, wrapper: Wrapper) -> "Task":
        """Wrap every middleware of the chain, those already added and those added later: ``mw`` runs as
        ``wrapper(mw)`` (DI-engine's ``task.use_wrapper``). Later wrappers wrap earlier ones; cleared with the block.

        A wrapper made with ``functools.wraps`` keeps what the middleware declares and its state (``__wrapped__``)."""
        if not self._started:
            raise RuntimeError("task.use_wrapper() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError("task.use_wrapper() cannot be called while the task is running")
        if not callable(wrapper):
            raise TypeError(f"task.use_wrapper({wrapper!r}): needs a callable taking a middleware and returning one")
        for mw in self._middleware:
            wrapped = wrapper(mw.fn)
            check_middleware(wrapped)
            mw.fn = wrapped
        self._wrappers.append(wrapper)
        return self

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
                raise Described()
        if table.problems:
            raise PipelineError(f"the pipeline's order does not fit its declared fields: {'; '.join(table.problems)}")
        return max_step if inspection is None else min(max_step, inspection.iterations)

    def _loop(self, max_step: int) -> Generator[Context, None, None]:
        """The one run loop of :meth:`run` and :meth:`iterate`: yields each completed iteration's context (sync
        mode; async mode yields nothing). Closing it between iterations ends the run normally."""
        if self._running:
            raise RuntimeError("task: a run is already in progress")
        self._kept.commit()  # what was written before the run is final
        first = self._base_ctx.total_step
        self._last_done = first - 1
        self._running, self._ahead = True, False
        self._routing.hear_finish(True)
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
        if error is not None:
            self._kept.rollback()  # kept fields as the last completed iteration left them
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
        self._routing.hear_finish(False)
        if self._finish_tell:  # task.finish was set (or first heard) here: end the run on every node
            self._finish_tell = False
            self._routing.publish_finish()
        error = self._run_pending(error)
        try:
            self._routing.bus.emit(FINISH_EVENT, error)
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
            before = {id(mw): mw.timing.total for mw in self._chain.created}
            for ctx in loop:
                now = {id(mw): mw.timing.total for mw in self._chain.created}
                times = {name: now[id(mw)] - before.get(id(mw), 0.0) for name, mw in self._chain.named()}
                before = now
                yield {"total_step": ctx.total_step, **scalars(ctx), "time_s": times}
        finally:
            if self._iteration is loop:
                self._iteration = None
            loop.close()

    def _run_sync(self, max_step: int) -> Iterator[Context]:
        chain = self._middleware
        for _ in range(max_step):
            if self._finish:
                return
            ctx = self._base_ctx
            for _ in onion(chain, ctx):
                pass
            self._completed(self._last_done + 1, ctx)
            self._base_ctx = self._fresh(self._last_done + 1)
            if self._between:
                self._quiescent()
            yield ctx

    def _run_async(self, max_step: int) -> None:
        if self._finish or max_step == 0:
            return
        first_ctx = self._base_ctx
        first = first_ctx.total_step

        def new_ctx(i: int) -> Context:
            return first_ctx if i == first else self._fresh(i)

        self._pipeline = AsyncPipeline(self._middleware, self._max_inflight, self._local)
        self._pipeline.run(first, max_step, new_ctx, lambda: self._finish, self._completed, self._quiescent)

    def _fresh(self, step: int) -> Context:
        """A new context for iteration ``step``, sharing the pipeline's kept values."""
        new = self._kept.context(type(self._base_ctx))
        new.total_step = step
        return new

    def _completed(self, i: int, ctx: Context) -> None:
        """Iteration ``i`` completed (called in order): what it wrote to kept fields is final."""
        self._kept.commit(ctx)
        self._last_done = i

    def _quiescent(self) -> None:
        """No middleware is running: move ``task.ctx`` to the next iteration and run the pending callbacks."""
        self._base_ctx = self._fresh(self._last_done + 1)
        error = self._run_pending(None)
        self._kept.commit()
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

    def renew(self) -> "Task":
        """Finish pending backward parts and move to a fresh context (``total_step`` + 1), for hand-written loops."""
        if self._running:
            raise RuntimeError("task.renew() is for hand-written loops; task.run() renews contexts itself")
        self.backward()
        self._base_ctx = self._fresh(self._base_ctx.total_step + 1)
        return self

    # --- state -------------------------------------------------------------------------------------
    def register_state(self, name: str, obj: Any) -> None:
        """Include ``obj`` (with ``state_dict()`` / ``load_state_dict()``) in :meth:`state_dict` under ``name``."""
        if not self._started:
            raise RuntimeError("task.register_state() must be called inside `with task.start():`")
        self._state.register(name, obj)

    def state_dict(self) -> Dict[str, Any]:
        """The whole pipeline's state: the context's kept fields and ``total_step``, every stateful middleware
        of the chain (members of compositions included), every object given to :meth:`register_state`.

        Keys of ``"middleware"`` are ``"<position>:<name>"`` (``"2.1:trainer"`` for the second member of
        the third middleware), stable across runs of the same pipeline script. Called inside a
        :meth:`between_iterations` callback or outside :meth:`run`, it is a consistent cut.
        """
        return self._state.gather(self.ctx, self._middleware)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into the current chain (after the ``use`` calls, before :meth:`run`)."""
        if not self._started:
            raise RuntimeError("task.load_state_dict() must be called inside `with task.start():`")
        if self._running:
            raise RuntimeError("task.load_state_dict() cannot be called while the task is running")
        self._state.restore(state, self._base_ctx, self._middleware)


def _first(error: Optional[BaseException], exc: BaseException, where: str) -> BaseException:
    """The error to raise: ``error`` if there is one (``exc`` noted on it), else ``exc``."""
    if error is None:
        return exc
    note(error, f"{where} also raised {type(exc).__name__}: {exc}")
    return error


task = Task()
