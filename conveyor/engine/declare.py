"""What a middleware says about itself: the context fields it reads and writes.

``task.describe()`` shows these declarations and ``task.run`` checks them before the first iteration. The
rule it checks (docs/engine.md, "Inspecting a pipeline"): a field a middleware's forward part reads must be
kept, or written by a middleware before it; a field its backward part (after ``yield``) reads must be
kept, or written by some middleware's forward part, or by the backward part of one after it. Fields whose
default is a meaningful "nothing" (``collect_kwargs = {}``, ``episodes = None``) are declared ``optional``
and never checked. A read that an undeclared middleware before it could satisfy is not checked either.
A declared field that the pipeline's context class lacks is a problem too.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

from conveyor.engine.compose import Middleware

__all__ = ["Fields", "PipelineError", "PipelineTable", "Row", "declares", "fields_of", "order_problems"]

M = TypeVar("M")


class PipelineError(ValueError):
    """A pipeline's declared fields do not add up: a middleware reads a field before anything writes it."""


@dataclass(frozen=True)
class Fields:
    """The context fields of one middleware: read and written by its forward part, by its backward part
    (after ``yield``), and which reads may find the field at its default (``optional``)."""

    reads: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    optional: Tuple[str, ...] = ()
    backward_reads: Tuple[str, ...] = ()
    backward_writes: Tuple[str, ...] = ()

    @property
    def all_reads(self) -> Tuple[str, ...]:
        """Every field read, forward then backward (each once)."""
        return _unique(self.reads + self.backward_reads)

    @property
    def all_writes(self) -> Tuple[str, ...]:
        """Every field written, forward then backward (each once)."""
        return _unique(self.writes + self.backward_writes)

    @staticmethod
    def serial(members: Iterable["Fields"]) -> "Fields":
        """The fields of members run one after another: reads that an earlier member's write satisfies are
        internal; the rest, and every write, are the group's."""
        members = list(members)
        reads: List[str] = []
        written: List[str] = []
        for f in members:
            reads += [name for name in f.reads if name not in written]
            written += f.writes
        back_reads = [name for f in members for name in f.backward_reads if name not in written]
        return Fields(_unique(reads), _unique(written), _optional(members),
                      _unique(back_reads), _unique(n for f in members for n in f.backward_writes))

    @staticmethod
    def concurrent(members: Iterable["Fields"]) -> "Fields":
        """The fields of members whose forward parts may run at once: none satisfies another's read."""
        members = list(members)
        return Fields(*(_unique(name for f in members for name in getattr(f, part))
                        for part in ("reads", "writes")), _optional(members),
                      *(_unique(name for f in members for name in getattr(f, part))
                        for part in ("backward_reads", "backward_writes")))


def _optional(members: List[Fields]) -> Tuple[str, ...]:
    """The reads optional for the group: optional in a member, and read by no member that needs them."""
    needed = {name for f in members for name in f.all_reads if name not in f.optional}
    return _unique(name for f in members for name in f.optional if name not in needed)


@dataclass(frozen=True)
class Row:
    """One middleware of a pipeline: its position (from 1), name, declared fields (None: undeclared), the role
    given to ``task.use(..., role=...)`` and whether it runs in this process (False: this process lacks the role)."""

    position: int
    name: str
    fields: Optional[Fields]
    role: Optional[str] = None
    active: bool = True

    @property
    def reads(self) -> Optional[Tuple[str, ...]]:
        """Every field it reads (None: undeclared)."""
        return None if self.fields is None else self.fields.all_reads

    @property
    def writes(self) -> Optional[Tuple[str, ...]]:
        """Every field it writes (None: undeclared)."""
        return None if self.fields is None else self.fields.all_writes


class PipelineTable(Sequence[Row]):
    """What ``task.describe()`` returns: the rows in order and the ordering problems found; ``str()`` is the
    table (reads marked ``?`` are optional, ``after:`` lists what the part after ``yield`` reads or writes)."""

    def __init__(self, rows: Sequence[Row], problems: Sequence[str],
                 layouts: Optional[Sequence[Tuple[int, str, str]]] = None) -> None:
        self.rows: List[Row] = list(rows)
        self.problems: List[str] = list(problems)
        self.layouts: List[Tuple[int, str, str]] = list(layouts or [])
        """``(position, field, shape)``: the shapes of fields that middleware say they write (``field_layouts()``)."""

    def __getitem__(self, index: Any) -> Any:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"<PipelineTable {len(self.rows)} middleware, {len(self.problems)} problem(s)>"

    def __str__(self) -> str:
        header = ("#", "middleware", "reads", "writes", "role")
        lines = [header] + [(str(r.position), r.name, *_cells(r)) for r in self.rows]
        widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
        if not self.rows:
            text.append("(no middleware)")
        text += [f"#{position} {field}: {shape}" for position, field, shape in self.layouts]
        text += [f"problem: {p}" for p in self.problems]
        return "\n".join(text)


def _cells(row: Row) -> Tuple[str, str, str]:
    role = "" if row.role is None else row.role if row.active else f"{row.role} (not in this process)"
    f = row.fields
    if f is None:
        return "(undeclared)", "(undeclared)", role

    def cell(forward: Tuple[str, ...], backward: Tuple[str, ...], mark: Tuple[str, ...] = ()) -> str:
        def names(fields: Tuple[str, ...]) -> str:
            return ", ".join(n + ("?" if n in mark else "") for n in fields)

        parts = [names(forward)] if forward else []
        if backward:
            parts.append(f"after: {names(backward)}")
        return "; ".join(parts) or "-"

    return cell(f.reads, f.backward_reads, f.optional), cell(f.writes, f.backward_writes), role


def _sources(writer: Row, active: List[Row], reader: int, kept: set) -> str:
    """`` (from ctx.x of 'collector' (#2))``: what ``writer`` reads from middleware between the reader and it,
    so a learner placed before its collector is named with the collector."""
    found = []
    start = active.index(writer)
    for name in writer.fields.reads:  # type: ignore[union-attr]
        if name in kept:
            continue
        source = next((r for r in reversed(active[reader + 1:start])
                       if r.fields is not None and name in r.fields.writes), None)
        if source is not None:
            found.append(f"from ctx.{name} of '{source.name}' (#{source.position})")
    return f" ({', '.join(found)})" if found else ""


def order_problems(rows: Sequence[Row], kept: Iterable[str], context: Optional[type] = None) -> List[str]:
    """Each declared read that nothing provides in time, as a sentence naming the middleware, the field and
    the later middleware that writes it (the rule is in the module docstring); with the ``context`` class,
    also each read or write of a field it lacks."""
    kept = set(kept)
    active = [r for r in rows if r.active]
    everyone_declared = all(r.fields is not None for r in active)
    forward_writes = {name for r in active if r.fields is not None for name in r.fields.writes}
    problems: List[str] = []
    for k, row in enumerate(active):
        f = row.fields
        if f is None:
            continue
        missing: List[str] = []
        if context is not None:
            known = {field.name for field in dataclasses.fields(context)}
            missing = [n for n in _unique(f.all_reads + f.all_writes) if n not in known and n not in f.optional]
            problems += [f"'{row.name}' (#{row.position}) uses ctx.{name}, but {context.__name__} has no field "
                         f"'{name}': use a context class that declares it" for name in missing]
        earlier, later = active[:k], active[k + 1:]
        if all(r.fields is not None for r in earlier):
            written = {name for r in earlier for name in r.fields.writes}  # type: ignore[union-attr]
            for name in f.reads:
                if name in kept or name in f.optional or name in written or name in missing:
                    continue
                writer = next((r for r in later if r.fields is not None and name in r.fields.writes), None)
                if writer is not None:
                    problems.append(f"'{row.name}' (#{row.position}) reads ctx.{name}, which only the later "
                                    f"'{writer.name}' (#{writer.position}){_sources(writer, active, k, kept)} "
                                    f"writes: place '{row.name}' after '{writer.name}'")
                else:
                    problems.append(f"'{row.name}' (#{row.position}) reads ctx.{name}, which no middleware before "
                                    f"it writes and which is not kept: add one that writes it before "
                                    f"'{row.name}', or keep the field (ctx.keep)")
        if everyone_declared:
            back = forward_writes | {name for r in later for name in r.fields.backward_writes}  # type: ignore
            for name in f.backward_reads:
                if name not in kept and name not in f.optional and name not in back and name not in missing:
                    problems.append(f"'{row.name}' (#{row.position}) reads ctx.{name} after its yield, but no "
                                    f"middleware writes it and it is not kept")
    return problems


def declares(*, reads: Iterable[str] = (), writes: Iterable[str] = (), optional: Iterable[str] = (),
             backward_reads: Iterable[str] = (), backward_writes: Iterable[str] = (),
             factory: bool = False) -> Callable[[M], M]:
    """Mark a middleware (a function, or a class whose instances are middleware) with the context fields it
    reads and writes; it gets ``.reads`` / ``.writes`` (every field, forward and backward) and
    ``.declared_fields`` (the :class:`Fields`).

    ``optional``: reads (forward or backward) whose default is a fine value, or that the context class may
    lack (the middleware then does without them). ``backward_*``: what the part
    after ``yield`` reads and writes. ``factory=True`` marks a function that builds middleware: it and what
    it returns carry the declaration (unless its product declares its own, more precise one).

    >>> @declares(reads=("env_step",), writes=("train_data",))
    ... def fetch(ctx): ...
    """
    fields = Fields(*(_names(value, what) for value, what in ((reads, "reads"), (writes, "writes"),
                                                              (optional, "optional"),
                                                              (backward_reads, "backward_reads"),
                                                              (backward_writes, "backward_writes"))))
    stray = [name for name in fields.optional if name not in fields.all_reads]
    if stray:
        raise ValueError(f"declares(optional={fields.optional!r}): {stray} are not among the reads; optional "
                         f"names reads whose default is fine")

    def mark(target: M) -> M:
        if factory:
            if not callable(target) or inspect.isclass(target):
                raise TypeError(f"declares(factory=True) marks a function that builds middleware, got {target!r}")
            built = target

            @functools.wraps(built)
            def build(*args: Any, **kwargs: Any) -> Any:
                product = built(*args, **kwargs)
                if fields_of(product) is None:
                    _attach(product, fields)
                return product

            target = build  # type: ignore[assignment]
        _attach(target, fields)
        return target

    return mark


def fields_of(middleware: Any) -> Optional[Fields]:
    """The declared :class:`Fields` of a middleware, or None if it declares nothing.

    Sees through ``task.use`` records, ``functools.partial``, ``functools.wraps`` wrappers, bound methods (the
    method's own declaration, else its object's), instances of declared classes, factories annotated to return a
    declared class (``def trainer(cfg, policy) -> Trainer``), and compositions (``compose`` / ``task.serial``:
    members in order; ``task.parallel``: members at once), which are undeclared if any member is. Plain
    ``.reads`` / ``.writes`` attributes (tuples of names) count as a declaration too.
    """
    seen = 0
    while seen < 32:  # unwrap layers; a cycle of wrappers ends here
        seen += 1
        if isinstance(middleware, Middleware):
            middleware = middleware.fn
        elif isinstance(middleware, functools.partial):
            middleware = middleware.func
        elif getattr(middleware, "__wrapped__", None) is not None and _own(middleware) is None:
            middleware = middleware.__wrapped__  # a functools.wraps wrapper (task.use_wrapper) declares what it wraps
        else:
            break
    members = getattr(middleware, "_members", None)
    if isinstance(members, list):
        found = [fields_of(m) for m in members]
        if any(f is None for f in found):
            return None
        return (Fields.concurrent if getattr(middleware, "_concurrent", False) else Fields.serial)(found)
    own = _own(middleware)
    if own is None and inspect.ismethod(middleware):
        own = _own(middleware.__self__)
    if own is None and inspect.isfunction(middleware):
        own = _built(middleware)
    return own


def _built(factory: Callable[..., Any]) -> Optional[Fields]:
    """The declaration of the class a factory is annotated to return (``def trainer(...) -> Trainer``)."""
    try:
        made = typing.get_type_hints(factory).get("return")
    except Exception:  # annotations that do not resolve say nothing
        return None
    return _own(made) if inspect.isclass(made) else None


def _own(obj: Any) -> Optional[Fields]:
    try:
        fields = getattr(obj, "declared_fields", None)
        if isinstance(fields, Fields):
            return fields
        reads, writes = getattr(obj, "reads", None), getattr(obj, "writes", None)
    except Exception:  # an object whose attributes cannot be read declares nothing
        return None
    if _is_names(reads) and _is_names(writes):
        return Fields(tuple(reads), tuple(writes))
    return None


def _attach(target: Any, fields: Fields) -> None:
    try:
        target.declared_fields = fields
        target.reads = fields.all_reads
        target.writes = fields.all_writes
    except AttributeError:
        raise TypeError(f"declares(): cannot mark {target!r}: it takes no attributes (__slots__?); declare its "
                        f"class instead") from None


def _names(value: Iterable[str], what: str) -> Tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"declares({what}={value!r}): give a tuple of field names, e.g. ({value!r},)")
    names = tuple(value)
    bad = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
    if bad:
        raise TypeError(f"declares({what}=...): {bad!r} are not field names")
    return names


def _is_names(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(n, str) for n in value)


def _unique(names: Iterable[str]) -> Tuple[str, ...]:
    return tuple(dict.fromkeys(names))
