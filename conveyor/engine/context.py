"""Contexts: the dataclass a pipeline's middleware read and write, recreated every iteration.

A context is a plain dataclass. Only fields named with :meth:`Context.keep` survive :meth:`Context.renew`;
everything else returns to its default, so per-iteration data (trajectories, train outputs) never leaks
into the next loop. What ``keep`` carries over is a :class:`Kept`: the kept names and their values. The
contexts of one task share one ``Kept``, so a kept counter written in one iteration is seen in every
context of the task, also by iterations in flight at once (async mode); the task commits what each
completed iteration wrote, and after a failed run returns the kept values to that (``docs/engine.md``).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, FrozenSet, List, Optional, Tuple

__all__ = ["Context", "Kept", "OfflineRLContext", "OnlineRLContext", "RLContext"]


MISSING = dataclasses.MISSING


@functools.lru_cache(maxsize=None)
def _defaults(cls: type) -> Tuple[Tuple[str, Any, Any], ...]:
    """``(name, default, default_factory)`` of each field of a context class."""
    return tuple((f.name, f.default, f.default_factory) for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> FrozenSet[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


class Kept:
    """What ``keep`` carries over: the kept fields' names and newest values, shared by contexts that share it.

    Writing a kept field in one of these contexts writes it in all of them. Each write is remembered by the
    context it was made in, so :meth:`commit` can make final exactly what one completed iteration wrote, and
    :meth:`rollback` return every context to the final values, dropping what failed iterations wrote.
    """

    def __init__(self, values: Optional[Dict[str, Any]] = None) -> None:
        self.values: Dict[str, Any] = dict(values or {})
        self._final: Dict[str, Tuple[int, Any]] = {}  # name -> (when written, value), for rollback()
        self._contexts: List[weakref.ref] = []
        self._lock = threading.RLock()
        self._clock = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def __reduce__(self) -> Tuple[Any, ...]:  # a copied or unpickled context keeps the values, shares nothing
        return Kept, (self.values,)

    @staticmethod
    def of(ctx: "Context") -> "Kept":
        """The ``Kept`` of ``ctx`` (a new empty one for a context that keeps nothing yet)."""
        kept = ctx.__dict__.get("_kept")
        if kept is None:
            kept = Kept()
            kept._join(ctx)
        return kept

    def context(self, cls: type, carry: bool = False) -> "Context":
        """A new ``cls`` context: kept values from here, every other field at its default, ``__post_init__`` not
        run again. It shares this ``Kept``, or with ``carry`` gets a copy of it (an independent context)."""
        new = cls.__new__(cls)
        d = new.__dict__
        values = self.values
        for name, default, factory in _defaults(cls):
            if name in values:
                continue
            if factory is not MISSING:
                d[name] = factory()
            elif default is not MISSING:
                d[name] = default
            else:
                raise TypeError(f"{cls.__name__} cannot be renewed: field '{name}' needs a default "
                                f"(dataclasses.field(default=...) or default_factory=...)")
        (Kept(self.values) if carry else self)._join(new)
        return new

    def add(self, ctx: "Context", name: str) -> None:
        """Keep ``name`` from now on, with ``ctx``'s value (every context sharing this ``Kept`` gets it)."""
        with self._lock:
            if name not in self.values:
                self._write(name, ctx.__dict__[name])

    def set(self, ctx: "Context", name: str, value: Any) -> None:
        """``ctx.name = value`` for a kept ``name``: written in every context sharing this ``Kept``."""
        with self._lock:
            ctx.__dict__["_wrote"][name] = (next(self._clock), value)
            ctx.__dict__[name] = value
            self._write(name, value)

    def commit(self, ctx: Optional["Context"] = None) -> None:
        """Make final what ``ctx``'s iteration wrote (newest write of each field wins), or, without ``ctx``, the
        values as they are now."""
        with self._lock:
            if ctx is None:
                now = next(self._clock)
                self._final = {name: (now, value) for name, value in self.values.items()}
                return
            for name, (when, value) in ctx.__dict__["_wrote"].items():
                if when > self._final.get(name, (0, None))[0]:
                    self._final[name] = (when, value)

    def rollback(self) -> None:
        """Return every kept field to its final value."""
        with self._lock:
            for name, (_, value) in self._final.items():
                self._write(name, value)

    def _write(self, name: str, value: Any) -> None:
        self.values[name] = value
        for ref in self._contexts:
            ctx = ref()
            if ctx is not None:
                ctx.__dict__[name] = value

    def _join(self, ctx: "Context") -> None:
        with self._lock:
            self._contexts = [ref for ref in self._contexts if ref() is not None]
            self._contexts.append(weakref.ref(ctx))
            ctx.__dict__.update(self.values, _kept=self, _wrote={})


class _hybridmethod:
    """A method callable on an instance, or on the class, where it acts on a fresh instance."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, cls: type) -> Callable:
        return functools.partial(self.fn, obj if obj is not None else cls())


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

    def keep(self, *names: str) -> None:
        """Mark fields whose values survive :meth:`renew` (counters, last evaluation, ...)."""
        kept = Kept.of(self)
        for name in names:
            if name not in _field_names(type(self)):
                raise AttributeError(self._unknown(name, "keep"))
            kept.add(self, name)

    @property
    def kept_fields(self) -> List[str]:
        """Names of the fields that survive :meth:`renew`."""
        return list(Kept.of(self).values)

    def renew(self) -> "Context":
        """A fresh context of the same class: kept values carried over, every other field at its default.

        The new context is filled from the field defaults (``default`` / ``default_factory``);
        ``__post_init__`` is not run again. It is independent of this one (a task's contexts share theirs).
        """
        return Kept.of(self).context(type(self), carry=True)

    def state_dict(self) -> Dict[str, Any]:
        """The kept fields and their values, for checkpoints."""
        return dict(Kept.of(self).values)

    @_hybridmethod
    def load_state_dict(self, state: Dict[str, Any]) -> "Context":
        """Restore kept fields from :meth:`state_dict`; on the class, returns a new context."""
        kept = Kept.of(self)
        for name, value in state.items():
            if name not in kept.values:
                raise KeyError(f"{type(self).__name__}.load_state_dict: '{name}' is not a kept field "
                               f"(kept: {sorted(kept.values)}); was the checkpoint made with another context class?")
            kept.set(self, name, value)
        return self

    # --- attribute rules -----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails, i.e. for undeclared names.
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(self._unknown(name, "read"))

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name not in _field_names(type(self)):
            raise AttributeError(self._unknown(name, "set"))
        elif name in self.__dict__.get("_kept", ()):
            self.__dict__["_kept"].set(self, name, value)
        else:
            self.__dict__[name] = value

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is a dataclass, not a dict: use ctx.{key} instead of ctx[{key!r}]")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is a dataclass, not a dict: use ctx.{key} = ... "
                        f"instead of ctx[{key!r}] = ...")

    def _unknown(self, name: str, action: str) -> str:
        cls = type(self).__name__
        hint = difflib.get_close_matches(name, sorted(_field_names(type(self))), n=1, cutoff=0.5)
        fix = f"did you mean '{hint[0]}'?" if hint else \
            f"declare it in a @dataclasses.dataclass subclass of {cls} to add it"
        return f"cannot {action} '{name}': {cls} has no field '{name}'; {fix}"


@dataclass
class RLContext(Context):
    """The fields every RL context has: training and evaluation (the base of the online and offline contexts).

    Attributes:
        train_iter: Gradient steps taken so far.
        train_data: This iteration's training batch, for the trainers.
        train_output: The learner's metrics of this iteration: a list of per-step metric dicts.
        eval_value: Mean return of the evaluation made in this iteration (``-inf`` if none was, as in DI-engine).
        eval_output: That evaluation's details: ``returns``, ``lengths``, ``mean``, ``std``, ``env_step``,
            ``train_iter``, ``weight_version``, ``crashes``, ``dropped``, ...
        last_eval_iter: ``train_iter`` at the last evaluation (``None`` before the first).
        last_eval_value: Mean return of the last evaluation.
        last_save_iter: ``train_iter`` at the last periodic checkpoint of ``CkptSaver``.
    """

    train_iter: int = 0
    train_data: Any = None
    train_output: Any = None
    eval_value: float = float("-inf")
    eval_output: Any = None
    last_eval_iter: Optional[int] = None
    last_eval_value: Optional[float] = None
    last_save_iter: Optional[int] = None

    def __post_init__(self) -> None:
        self.keep("train_iter", "last_eval_iter", "last_eval_value", "last_save_iter")


@dataclass
class OnlineRLContext(RLContext):
    """Context of online RL pipelines: collection, training and evaluation on live envs.

    Attributes:
        env_step: Env steps collected so far over all collector envs (a resumed run counts those before it).
        env_episode: Training episodes finished so far.
        train_data: This iteration's training batch (e.g. from ``gae_estimator``), for the trainers.
        collect_kwargs: Keyword arguments for ``collect_mode.forward`` (e.g. ``eps`` from ``eps_greedy_handler``).
        obs: The current observation, for pipelines that act one step at a time (the built-in collectors do not use it).
        action: The action chosen for ``obs``, for such pipelines.
        inference_output: The policy's full output for ``obs``, for such pipelines.
        trajectories: Transitions collected this iteration: a batch ``[T, N]`` (step, env) from ``StepCollector``,
            flat ``[B]`` after the n-step enhancer; ``None`` once ``data_pusher`` has pushed them.
        episodes: Whole episodes collected this iteration (``EpisodeCollector``): a list of batches, one per episode.
        trajectory_end_idx: Flat indices of the transitions of ``trajectories`` that end an episode.
    """

    env_step: int = 0
    env_episode: int = 0
    collect_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    obs: Any = None
    action: Any = None
    inference_output: Any = None
    trajectories: Any = None
    episodes: Any = None
    trajectory_end_idx: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.keep("env_step", "env_episode")


@dataclass
class OfflineRLContext(RLContext):
    """Context of offline RL pipelines: training on a fixed dataset, evaluation on live envs.

    Attributes:
        train_epoch: Passes over the dataset completed so far.
        train_data: This iteration's training batch, drawn from the dataset.
    """

    train_epoch: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.keep("train_epoch")
