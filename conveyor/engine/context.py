"""Contexts: the dataclass a pipeline's middleware read and write, recreated every iteration.

Only fields named with :meth:`Context.keep` survive :meth:`Context.renew`; everything else returns to
its default, so per-iteration data (trajectories, train outputs) never leaks into the next loop.
Within a task, kept values live in one store shared by every iteration's context (in both modes), so
a kept counter read anywhere is the newest value written to it. While a run is active the store
journals assignments per iteration, so a failed run can return kept values to what the last
completed iteration left (see ``docs/engine.md``).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

__all__ = ["Context", "OnlineRLContext", "OfflineRLContext"]


class _KeptStore:
    """The values of kept fields, shared by every context of a task's iterations.

    While a run is active (:meth:`begin` .. :meth:`end`), :meth:`commit` marks what completed iterations
    wrote as final, and ``end(rollback=True)`` returns the values to it, dropping what a failed or
    cancelled iteration wrote. With iterations in flight at once (``begin(journal=True)``) each
    assignment is journaled with the iteration that made it, since newer iterations write before
    older ones complete; one at a time, a copy of the values at each completion does.
    """

    __slots__ = ("values", "journal", "committed", "lock")

    def __init__(self, values: Optional[Dict[str, Any]] = None) -> None:
        self.values: Dict[str, Any] = dict(values or {})
        self.journal: Optional[List[Tuple[int, str, Any]]] = None
        self.committed: Dict[str, Any] = {}
        self.lock: Optional[threading.Lock] = None

    def set(self, name: str, value: Any, step: int) -> None:
        if self.journal is None:
            self.values[name] = value
            return
        with self.lock:  # type: ignore[union-attr]
            self.values[name] = value
            if self.journal is not None:
                self.journal.append((step, name, value))

    def begin(self, journal: bool) -> None:
        """Start a run: the current values are committed."""
        self.lock = self.lock or threading.Lock()
        with self.lock:
            self.committed = dict(self.values)
            self.journal = [] if journal else None

    def commit(self, step: Optional[int] = None) -> None:
        """What iterations up to ``step`` (every one when None) wrote is final."""
        with self.lock:  # type: ignore[union-attr]
            if self.journal is None or step is None:
                self.committed = dict(self.values)
                if self.journal:
                    self.journal = []
                return
            pending = []
            for entry in self.journal:
                if entry[0] <= step:
                    self.committed[entry[1]] = entry[2]
                else:
                    pending.append(entry)
            self.journal = pending

    def end(self, rollback: bool) -> None:
        """End the run; with ``rollback``, values go back to the committed ones."""
        with self.lock:  # type: ignore[union-attr]
            if rollback:
                self.values.update(self.committed)
            self.journal = None
            self.committed = {}


class _hybridmethod:
    """A method callable on an instance, or on the class, where it acts on a fresh instance."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, cls: type) -> Callable:
        return functools.partial(self.fn, obj if obj is not None else cls())


class _Field:
    """Routes one field to the shared kept store when it is kept, else to the instance."""

    __slots__ = ("name", "default")

    def __init__(self, name: str, default: Any) -> None:
        self.name, self.default = name, default

    def __get__(self, obj: Any, cls: type) -> Any:
        if obj is None:
            return self.default
        d = obj.__dict__
        store = d.get("_kept")
        if store is not None and self.name in store.values:
            return store.values[self.name]
        try:
            return d[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        d = obj.__dict__
        store = d.get("_kept")
        if store is not None and self.name in store.values:
            store.set(self.name, value, d.get("total_step", 0))
        else:
            d[self.name] = value


@dataclass
class Context:
    """Base context: declare fields as a dataclass subclass, mark survivors with ``keep``.

    >>> @dataclasses.dataclass
    ... class MyContext(Context):
    ...     step_count: int = 0
    ...     batch: list = dataclasses.field(default_factory=list)
    ...     def __post_init__(self):
    ...         self.keep("step_count")

    Attributes:
        total_step: Index of this iteration: the number of iterations completed before it.
    """

    total_step: int = 0

    _ended: ClassVar[bool] = False  # set on an iteration's context by task.end_iteration()
    _field_names: ClassVar[frozenset] = frozenset()
    _defaults: ClassVar[tuple] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._field_names = frozenset()  # recomputed lazily once @dataclass has run on the subclass

    @classmethod
    def _fields(cls) -> frozenset:
        names = cls.__dict__.get("_field_names")
        if not names:  # first use of this class: route its fields through _Field
            fields = dataclasses.fields(cls)
            for f in fields:
                setattr(cls, f.name, _Field(f.name, f.default))
            cls._defaults = tuple((f.name, f.default, f.default_factory) for f in fields)
            names = cls._field_names = frozenset(f.name for f in fields)
        return names

    # --- kept fields ---------------------------------------------------------------------------
    def keep(self, *names: str) -> None:
        """Mark fields whose values survive :meth:`renew` (counters, last evaluation, ...)."""
        fields = self._fields()
        store = self._store()
        for name in names:
            if name not in fields:
                raise AttributeError(self._unknown(name, "keep"))
            if name not in store.values:
                store.values[name] = self.__dict__.pop(name)
            else:
                self.__dict__.pop(name, None)

    @property
    def kept_fields(self) -> List[str]:
        """Names of the fields that survive :meth:`renew`."""
        return list(self._store().values)

    def renew(self) -> "Context":
        """A fresh context of the same class: kept values carried over, every other field at its default.

        The new context is filled from the field defaults (``default`` / ``default_factory``);
        ``__post_init__`` is not run again.
        """
        return self._renew(_KeptStore(self._store().values))

    def _renew(self, store: _KeptStore) -> "Context":
        cls = type(self)
        cls._fields()
        new = cls.__new__(cls)
        d = new.__dict__
        d["_kept"] = store
        missing = dataclasses.MISSING
        for name, default, factory in cls._defaults:
            if name in store.values:
                continue
            if factory is not missing:
                d[name] = factory()
            elif default is not missing:
                d[name] = default
            else:
                raise TypeError(f"{cls.__name__} cannot be renewed: field '{name}' needs a default "
                                f"(dataclasses.field(default=...) or default_factory=...)")
        return new

    def state_dict(self) -> Dict[str, Any]:
        """The kept fields and their values, for checkpoints."""
        return dict(self._store().values)

    @_hybridmethod
    def load_state_dict(self, state: Dict[str, Any]) -> "Context":
        """Restore kept fields from :meth:`state_dict`; on the class, returns a new context."""
        store = self._store()
        for name, value in state.items():
            if name not in store.values:
                raise KeyError(f"{type(self).__name__}.load_state_dict: '{name}' is not a kept field "
                               f"(kept: {sorted(store.values)}); was the checkpoint made with another context class?")
            store.values[name] = value
        return self

    # --- attribute rules -----------------------------------------------------------------------
    def _store(self) -> _KeptStore:
        store = self.__dict__.get("_kept")
        if store is None:
            store = _KeptStore()
            object.__setattr__(self, "_kept", store)
        return store

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails, i.e. for undeclared names.
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(self._unknown(name, "read"))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in (type(self).__dict__.get("_field_names") or self._fields()) or name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(self._unknown(name, "set"))

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is a dataclass, not a dict: use ctx.{key} instead of ctx[{key!r}]")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is a dataclass, not a dict: use ctx.{key} = ... "
                        f"instead of ctx[{key!r}] = ...")

    def _unknown(self, name: str, action: str) -> str:
        cls = type(self).__name__
        hint = difflib.get_close_matches(name, sorted(self._fields()), n=1, cutoff=0.5)
        fix = f"did you mean '{hint[0]}'?" if hint else \
            f"declare it in a @dataclasses.dataclass subclass of {cls} to add it"
        return f"cannot {action} '{name}': {cls} has no field '{name}'; {fix}"


@dataclass
class OnlineRLContext(Context):
    """Context of online RL pipelines: collection, training and evaluation on live envs.

    Attributes:
        env_step: Env steps collected so far over all collector envs (a resumed run counts those before it).
        env_episode: Training episodes finished so far.
        train_iter: Gradient steps taken so far.
        train_data: This iteration's training batch (e.g. from ``gae_estimator``), for the trainers.
        train_output: The learner's metrics of this iteration: a list of per-step metric dicts.
        collect_kwargs: Keyword arguments for ``collect_mode.forward`` (e.g. ``eps`` from ``eps_greedy_handler``).
        obs: The current observation, for pipelines that act one step at a time (the built-in collectors do not use it).
        action: The action chosen for ``obs``, for such pipelines.
        inference_output: The policy's full output for ``obs``, for such pipelines.
        trajectories: Transitions collected this iteration: a batch ``[T, N]`` (step, env) from ``StepCollector``,
            flat ``[B]`` after the n-step enhancer; ``None`` once ``data_pusher`` has pushed them.
        episodes: Whole episodes collected this iteration (``EpisodeCollector``): a list of batches, one per episode.
        trajectory_end_idx: Flat indices of the transitions of ``trajectories`` that end an episode.
        eval_value: Mean return of the evaluation made in this iteration (``None`` if none was).
        eval_output: That evaluation's details: ``returns``, ``lengths``, ``mean``, ``std``, ``env_step``,
            ``train_iter``, ``weight_version``, ``crashes``, ``dropped``, ...
        last_eval_iter: ``train_iter`` at the last evaluation (``None`` before the first).
        last_eval_value: Mean return of the last evaluation.
        last_save_iter: ``train_iter`` at the last periodic checkpoint of ``CkptSaver``.
    """

    env_step: int = 0
    env_episode: int = 0
    train_iter: int = 0
    train_data: Any = None
    train_output: Any = None
    collect_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    obs: Any = None
    action: Any = None
    inference_output: Any = None
    trajectories: Any = None
    episodes: Any = None
    trajectory_end_idx: Any = None
    eval_value: Optional[float] = None
    eval_output: Any = None
    last_eval_iter: Optional[int] = None
    last_eval_value: Optional[float] = None
    last_save_iter: Optional[int] = None

    def __post_init__(self) -> None:
        self.keep("env_step", "env_episode", "train_iter", "last_eval_iter", "last_eval_value", "last_save_iter")


@dataclass
class OfflineRLContext(Context):
    """Context of offline RL pipelines: training on a fixed dataset, evaluation on live envs.

    Attributes:
        train_epoch: Passes over the dataset completed so far.
        train_iter: Gradient steps taken so far.
        train_data: This iteration's training batch, drawn from the dataset.
        train_output: The learner's metrics of this iteration: a list of per-step metric dicts.
        eval_value: Mean return of the evaluation made in this iteration (``None`` if none was).
        eval_output: That evaluation's details (as in ``OnlineRLContext``).
        last_eval_iter: ``train_iter`` at the last evaluation (``None`` before the first).
        last_eval_value: Mean return of the last evaluation.
        last_save_iter: ``train_iter`` at the last periodic checkpoint of ``CkptSaver``.
    """

    train_epoch: int = 0
    train_iter: int = 0
    train_data: Any = None
    train_output: Any = None
    eval_value: Optional[float] = None
    eval_output: Any = None
    last_eval_iter: Optional[int] = None
    last_eval_value: Optional[float] = None
    last_save_iter: Optional[int] = None

    def __post_init__(self) -> None:
        self.keep("train_epoch", "train_iter", "last_eval_iter", "last_eval_value", "last_save_iter")

