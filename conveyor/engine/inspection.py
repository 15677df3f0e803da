"""Looking at a pipeline without (fully) running it: its table, and what one iteration left.

``task.describe()`` builds the table from the ``task.use`` calls (and the shapes of the fields that middleware with
a ``field_layouts()`` method write); ``task.inspecting()`` stops runs early
(``conveyor describe``, ``conveyor.testing.check_pipeline``); ``task.iterate()`` yields :func:`scalars`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import typing
from typing import Any, Dict, Iterator, List, Optional, Tuple

from conveyor.engine.compose import Middleware, middleware_name
from conveyor.engine.declare import PipelineTable, Row, fields_of, order_problems

__all__ = ["Described", "Inspection", "TaskInspection", "describe", "scalars"]


class Inspection:
    """What :meth:`Task.inspecting` found: the first run's pipeline table (None if nothing ran) and the number
    of iterations completed."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.table: Optional[PipelineTable] = None
        self.completed = 0


class Described(BaseException):
    """Raised by run() under :meth:`Task.inspecting`, to leave the code that built the pipeline; a
    BaseException, so ``except Exception`` in that code lets it through."""


def describe(uses: List[Tuple[Any, Any, bool]], ctx: Any) -> PipelineTable:
    """The table of ``(record or left-out fn, role, runs here)`` uses, checked against ``ctx`` (None: no context)."""
    rows, layouts = [], []
    for k, (fn, role, active) in enumerate(uses, 1):
        name = fn.name if isinstance(fn, Middleware) else middleware_name(fn)
        rows.append(Row(k, name, fields_of(fn), None if role is None else role.value, active))
        shapes = getattr(fn.fn if isinstance(fn, Middleware) else fn, "field_layouts", None)
        if active and callable(shapes):
            layouts += [(k, field, shape) for field, shape in shapes().items()]
    return PipelineTable(rows, order_problems(rows, () if ctx is None else ctx.kept_fields,
                                              None if ctx is None else type(ctx)), layouts)


_SCALARS = (int, float, bool, str)
_scalar_fields: Dict[type, Tuple[str, ...]] = {}


def scalars(ctx: Any) -> Dict[str, Any]:
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


class TaskInspection:
    """The profiling and inspection methods of :class:`~conveyor.engine.task.Task`."""

    _chain: Any  # conveyor.engine.chain.Chain
    _uses: List[Tuple[Any, Any, bool]]
    _base_ctx: Any
    _inspection: Optional[Inspection]

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per middleware name: ``calls``, ``total_s``, ``mean_s``, ``p95_s`` (forward + backward time)."""
        return {name: mw.timing.summary() for name, mw in self._chain.named()}

    def describe(self) -> PipelineTable:
        """The pipeline as a table: each middleware's name, the context fields it declares it reads and
        writes (:func:`~conveyor.engine.declares`), its role, and the ordering problems :meth:`run` rejects.
        Middleware left out for a role this process lacks are listed, marked inactive."""
        return describe(self._uses, self._base_ctx)

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
        except Described:
            pass
        finally:
            self._inspection = None
