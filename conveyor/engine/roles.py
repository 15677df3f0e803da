"""Roles and labels: which middleware of one ``main()`` run in this process.

A process with no role added has every role (one process runs everything); once roles are added it has
only those, and ``task.use(mw, role=...)`` leaves out the middleware of the roles it lacks.
"""
from __future__ import annotations

import enum
import fnmatch
from typing import Any, Callable, FrozenSet, Iterable, Set, Union

__all__ = ["Role", "Roles", "TaskRoles", "match_labels", "void"]


class Role(str, enum.Enum):
    """What a process does in a multi-process run (``task.role.LEARNER`` ...); see :meth:`Task.add_role`."""

    LEARNER = "learner"
    COLLECTOR = "collector"
    EVALUATOR = "evaluator"


def _check(role: object, what: str) -> None:
    if not isinstance(role, Role):
        raise TypeError(f"{what}({role!r}): needs one of {', '.join('task.role.' + r.name for r in Role)}")


class Roles:
    """The roles of this process, and whether middleware were already filtered by them (then no role may be added)."""

    def __init__(self) -> None:
        self.added: Set[Role] = set()
        self.bound = False

    def add(self, role: Role) -> None:
        """Give this process ``role``; refused once role-bound middleware were added without it."""
        _check(role, "task.add_role")
        if self.bound and role not in self.added:
            raise RuntimeError(f"task.add_role({role}): middleware were already added with task.use(..., role=...), "
                               f"and which of them run was decided then; add roles first")
        self.added.add(role)

    def has(self, role: Role) -> bool:
        """Whether this process has ``role`` (every role when none was added)."""
        _check(role, "task.has_role")
        return not self.added or role in self.added

    def bind(self, role: Role) -> bool:
        """A middleware of ``role`` is being added: roles are fixed from now on; returns whether it runs here."""
        _check(role, "task.use(..., role=...): role=")
        self.bound = True
        return self.has(role)

    @property
    def frozen(self) -> FrozenSet[Role]:
        """The roles added."""
        return frozenset(self.added)


def match_labels(labels: Iterable[str], patterns: Union[str, Iterable[str]]) -> bool:
    """Whether any of ``labels`` matches any of ``patterns`` (fnmatch-style, case-sensitive)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"task.match_labels({patterns!r}): patterns must be strings, got {pattern!r}")
    return any(fnmatch.fnmatchcase(label, pattern) for label in labels for pattern in patterns)


def void(ctx: Any) -> None:
    """The no-op middleware (:meth:`Task.void`)."""


class TaskRoles:
    """The role and label methods of :class:`~conveyor.engine.task.Task` (its ``_roles`` is a :class:`Roles`)."""

    _roles: Roles
    router: Any

    role = Role
    """The roles: ``task.role.LEARNER``, ``task.role.COLLECTOR``, ``task.role.EVALUATOR``."""

    def add_role(self, role: Role) -> Any:
        """Give this process ``role`` (a :class:`Role`); it then has only the roles added. Roles are cleared when
        the ``with task.start():`` block exits. Add them before any ``task.use(..., role=...)``."""
        self._roles.add(role)
        return self

    def has_role(self, role: Role) -> bool:
        """Whether this process has ``role``: True for every role when none was added (one process runs everything)."""
        return self._roles.has(role)

    @property
    def roles(self) -> FrozenSet[Role]:
        """The roles added (empty: this process has every role)."""
        return self._roles.frozen

    @property
    def labels(self) -> Set[str]:
        """This worker's labels (``Parallel.runner(labels=...)``); empty without a router that has labels."""
        return set(getattr(self.router, "labels", None) or ())

    def match_labels(self, patterns: Union[str, Iterable[str]]) -> bool:
        """Whether any label matches any of ``patterns`` (fnmatch-style, case-sensitive: ``"gpu*"``, ``"node[12]"``)."""
        return match_labels(self.labels, patterns)

    @staticmethod
    def void() -> Callable[[Any], None]:
        """A middleware that does nothing (for a slot that is empty on some nodes)."""
        return void

