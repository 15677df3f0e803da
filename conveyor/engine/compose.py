"""The onion: run middleware forward in order, then their backward parts in reverse.

A middleware is a callable taking ``ctx``. If calling it returns a generator, the code before its
``yield`` is its forward part and the code after is its backward part. :func:`onion` is the one
implementation of a pass over a chain (enter in order, hand over, unwind innermost first); the
task's sync loop, the async pipeline's iterations, :func:`compose` / ``task.serial`` all run it, and
``task.parallel``, ``task.wrap``, ``task.forward`` / ``backward`` use its parts (:func:`enter`,
:func:`hand_over`, :func:`unwind`). When a middleware raises, the exception is thrown into every
suspended generator above it, innermost first, so ``try/finally`` and ``try/except`` around a
``yield`` behave as in plain Python.
"""
from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from contextlib import nullcontext
from types import GeneratorType
from typing import Any, Callable, ContextManager, Deque, Dict, Generator, List, Optional, Sequence, Union

__all__ = ["DIRECT", "Middleware", "MiddlewareError", "Suspended", "Timing", "as_middleware", "check_middleware",
           "compose", "enter", "hand_over", "leave", "middleware_name", "note", "onion", "unwind"]

_UNLOCKED = nullcontext()  # reusable: the "lock" of a middleware without one


class MiddlewareError(RuntimeError):
    """A middleware was misused: it yielded twice, never yielded, or is a factory passed unbuilt."""


class Timing:
    """Calls and durations of one middleware; thread-safe. Keeps the last 1024 durations for p95."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.total = 0.0
        self._recent: Deque[float] = deque(maxlen=1024)

    def add(self, seconds: float) -> None:
        with self._lock:
            self.calls += 1
            self.total += seconds
            self._recent.append(seconds)

    def summary(self) -> Dict[str, float]:
        with self._lock:
            recent = sorted(self._recent)
            p95 = recent[min(len(recent) - 1, int(0.95 * len(recent)))] if recent else 0.0
            return {"calls": self.calls, "total_s": self.total,
                    "mean_s": self.total / self.calls if self.calls else 0.0, "p95_s": p95}


class Middleware:
    """One step of a pipeline: the callable, a readable name, an optional lock and its timing."""

    __slots__ = ("fn", "name", "lock", "timing")

    def __init__(self, fn: Callable[[Any], Any], name: Optional[str] = None,
                 lock: Optional[ContextManager] = None) -> None:
        self.fn = fn
        self.name = name or middleware_name(fn)
        self.lock = lock
        self.timing = Timing()

    def __repr__(self) -> str:
        return f"<Middleware {self.name}{' (locked)' if self.lock is not None else ''}>"


def middleware_name(fn: Callable) -> str:
    """A readable name for stats and tracebacks.

    A function's own name, except that a private closure made by a factory takes the factory's name
    (``data_pusher.<locals>._push`` -> ``data_pusher``); a callable object gives its class name.
    """
    if inspect.ismethod(fn):
        return fn.__qualname__
    if inspect.isfunction(fn):
        outer = fn.__qualname__.rsplit(".<locals>.", 1)
        if fn.__name__.startswith("_") and len(outer) == 2:
            return outer[0].rsplit(".", 1)[-1]
        return fn.__name__
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def _where(fn: Callable) -> str:
    """``file:line`` of a middleware's code, for misuse messages."""
    target = fn if (inspect.isfunction(fn) or inspect.ismethod(fn)) else getattr(type(fn), "__call__", fn)
    try:
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (OSError, TypeError):
        return "<unknown location>"


def check_middleware(fn: Any) -> None:
    """Reject, at ``use()`` time, things that cannot be middleware, explaining the likely fix."""
    if isinstance(fn, Middleware):
        return
    if inspect.isclass(fn):
        raise TypeError(f"middleware must be called with ctx, but {fn.__name__} is a class: "
                        f"pass an instance, e.g. task.use({fn.__name__}(cfg, ...))")
    if not callable(fn):
        raise TypeError(f"middleware must be a callable taking ctx, got {fn!r} ({type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(object())
    except TypeError:
        name = middleware_name(fn)
        raise TypeError(f"middleware {name}{sig} cannot be called with ctx alone ({_where(fn)}); if it is a "
                        f"factory, pass what it builds: task.use({name}(...))") from None


def as_middleware(fn: Any, lock: Optional[ContextManager] = None) -> Middleware:
    """Wrap a callable as a :class:`Middleware` after checking it."""
    if isinstance(fn, Middleware):
        return fn
    check_middleware(fn)
    return Middleware(fn, lock=lock)


def note(exc: BaseException, text: str) -> None:
    """Attach ``text`` to ``exc`` once (``add_note``), so tracebacks say where an error came from."""
    if hasattr(exc, "add_note") and text not in getattr(exc, "__notes__", ()):
        exc.add_note(text)


class Suspended:
    """A generator middleware paused at its ``yield``, waiting for its backward part."""

    __slots__ = ("mw", "gen", "forward_s")

    def __init__(self, mw: Middleware, gen: Generator, forward_s: float) -> None:
        self.mw, self.gen, self.forward_s = mw, gen, forward_s


def enter(mw: Middleware, ctx: Any) -> Optional[Suspended]:
    """Run the forward part of ``mw``; return it suspended at its ``yield``, or None for a plain function."""
    start = time.perf_counter()
    try:
        with mw.lock or _UNLOCKED:
            out = mw.fn(ctx)
            if isinstance(out, GeneratorType):
                try:
                    next(out)
                except StopIteration:
                    raise MiddlewareError(f"generator middleware '{mw.name}' ({_where(mw.fn)}) returned without "
                                          f"yielding: yield exactly once on every path, or make it a plain "
                                          f"function") from None
                return Suspended(mw, out, time.perf_counter() - start)
            if callable(out):
                raise MiddlewareError(f"middleware '{mw.name}' ({_where(mw.fn)}) returned a callable: it looks "
                                      f"like a factory; pass what it returns to task.use()")
    except BaseException as exc:
        note(exc, f"in middleware '{mw.name}'")
        raise
    mw.timing.add(time.perf_counter() - start)
    return None


def leave(suspended: Suspended, exc: Optional[BaseException] = None, cancel: bool = False) -> Optional[BaseException]:
    """Run the backward part of a suspended middleware, throwing ``exc`` into it if given.

    Returns the exception that should keep propagating upwards: None if the backward part finished
    normally (a generator that catches ``exc`` and returns has handled it), else what it raised.
    ``cancel=True`` closes the generator instead (its ``finally`` runs; ``exc`` passes through).
    """
    mw, gen = suspended.mw, suspended.gen
    start = time.perf_counter()
    result = exc if cancel else None
    try:
        with mw.lock or _UNLOCKED:
            if cancel:
                gen.close()
            else:
                if exc is None:
                    gen.send(None)
                else:
                    gen.throw(exc)
                gen.close()  # it yielded again
                result = MiddlewareError(f"generator middleware '{mw.name}' ({_where(mw.fn)}) yielded more than "
                                         f"once: a middleware yields exactly once, to hand over to the rest of "
                                         f"the chain")
                result.__context__ = exc
    except StopIteration:
        pass  # the backward part finished, having handled exc if there was one
    except BaseException as raised:
        note(raised, f"in middleware '{mw.name}'")
        result = raised
    mw.timing.add(suspended.forward_s + time.perf_counter() - start)
    return result


class Direct:
    """How an onion enters and leaves a middleware outside the async pipeline: directly."""

    enter = staticmethod(enter)
    leave = staticmethod(leave)


DIRECT = Direct()


def unwind(stack: List[Suspended], error: Optional[BaseException] = None, gate: Any = DIRECT) -> None:
    """Backward parts of ``stack``, innermost first, each receiving what the one inside it raised; raise what is left."""
    while stack:
        error = gate.leave(stack.pop(), error)
    if error is not None:
        raise error


def hand_over(stack: List[Suspended], error: Optional[BaseException] = None, gate: Any = DIRECT) -> Generator:
    """Settle a forward error, ``yield`` to what runs inside, then unwind ``stack`` with what comes back.

    A forward error is thrown into ``stack`` at once: if a generator handles it, the hand-over still
    happens, with nothing left to unwind; otherwise it propagates from here.
    """
    if error is not None:
        unwind(stack, error, gate)
    try:
        yield
    except BaseException as exc:
        unwind(stack, exc, gate)
        return
    unwind(stack, None, gate)


def onion(chain: Sequence[Middleware], ctx: Any, gate: Any = DIRECT) -> Generator:
    """The onion, the one loop every composition form runs: enter in order, hand over, unwind innermost first.

    Forward parts run in order until one raises or the iteration is ended (``task.end_iteration()``
    marks ``ctx``). ``gate`` runs each enter and leave: :data:`DIRECT`, or the async pipeline's turnstiles.
    Drive it with ``for _ in onion(chain, ctx): pass``, or ``yield from`` it inside a middleware.
    """
    stack: List[Suspended] = []
    error: Optional[BaseException] = None
    for mw in chain:
        if getattr(ctx, "_ended", False):
            break
        try:
            suspended = gate.enter(mw, ctx)
        except BaseException as exc:
            error = exc
            break
        if suspended is not None:
            stack.append(suspended)
    yield from hand_over(stack, error, gate)


def compose(*middleware: Union[Callable, Middleware], name: Optional[str] = None) -> Callable[[Any], Generator]:
    """Compose middleware into one generator middleware: all forward parts, ``yield``, backward parts reversed."""
    chain = [as_middleware(fn) for fn in middleware]

    def composed(ctx: Any) -> Generator:
        return onion(chain, ctx)

    composed.__qualname__ = composed.__name__ = name or f"compose({', '.join(mw.name for mw in chain)})"
    composed._members = chain  # type: ignore[attr-defined]  # Task.state_dict walks into compositions
    return composed
