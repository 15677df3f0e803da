"""Checks for your own test suite: an env against what Conveyor relies on, and a smoke run of a pipeline.

    from conveyor.testing import check_env, check_pipeline

    def test_my_env():
        check_env(MyEnv())                      # raises EnvCheckError listing every problem

    def test_my_pipeline():
        check_pipeline("my_entry.py", iterations=2)   # or "cartpole/dqn", a module, or main itself
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Optional, Tuple, Union

from conveyor.engine import Inspection, PipelineTable, task
from conveyor.envs import EnvCheckError, check_env

__all__ = ["EnvCheckError", "PipelineCheckError", "check_env", "check_pipeline", "inspect_main", "load_main"]

Target = Union[str, "os.PathLike[str]", ModuleType, Callable[..., Any]]


class PipelineCheckError(AssertionError):
    """:func:`check_pipeline` found a pipeline that does not build or run; the message says which and why."""


def load_main(target: Target) -> Tuple[str, Callable[..., Any]]:
    """``(label, main)`` of a zoo entry name (``"cartpole/dqn"``), a ``FILE.py`` defining ``main()``, a module
    with ``main``, or a callable ``main`` itself."""
    if isinstance(target, (str, os.PathLike)):
        from conveyor.zoo import load_entry, load_file
        label = os.fspath(target)
        target = load_file(Path(label), required=("main",)) if label.endswith(".py") else load_entry(label)
    else:
        label = getattr(target, "__name__", repr(target))
    main = getattr(target, "main", None) if isinstance(target, ModuleType) else target
    if not callable(main):
        raise TypeError(f"{label} has no main(): an entry defines main(cfg=None, *, seed=None, ...) that builds and "
                        f"runs its pipeline")
    return label, main


@contextlib.contextmanager
def _scratch_dir() -> Iterator[Path]:
    """Work in a fresh temporary folder (runs/, logs, checkpoints land there), then go back and remove it."""
    home = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="conveyor-check-") as scratch:
        os.chdir(scratch)
        try:
            yield Path(scratch)
        finally:
            os.chdir(home)


def inspect_main(target: Target, iterations: int = 0, seed: int = 0,
                 cfg: Optional[Mapping[str, Any]] = None) -> Tuple[str, Inspection]:
    """Call the ``main`` of ``target`` (see :func:`load_main`) in a temporary folder under
    ``task.inspecting(iterations)``: ``iterations=0`` builds its pipeline and stops before the first iteration.
    ``main`` gets ``cfg`` (if given: a config in place of its own), ``seed``, ``exp_name`` and ``progress=False``
    where its signature takes them."""
    label, main = load_main(target)
    accepted = inspect.signature(main).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {key: value for key, value in (("seed", seed), ("exp_name", "check"), ("progress", False))
              if takes_any or key in accepted}
    with _scratch_dir(), task.inspecting(iterations) as found:
        main(*(() if cfg is None else (cfg,)), **kwargs)
    return label, found


def check_pipeline(main_or_entry: Target, iterations: int = 2, *, seed: int = 0) -> PipelineTable:
    """Smoke-test a pipeline: build it and run ``iterations`` iterations in a temporary folder; returns its table.

    ``main_or_entry``: a zoo entry name, a ``FILE.py`` or module with ``main()``, or ``main`` itself.
    Raises :class:`PipelineCheckError` if ``main`` fails (the cause chained), never starts a run, or the
    declared fields do not fit the order of its middleware.
    """
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"check_pipeline(iterations={iterations!r}): must be an int >= 1")
    label = getattr(main_or_entry, "__name__", str(main_or_entry))
    try:
        label, found = inspect_main(main_or_entry, iterations, seed)
    except Exception as exc:
        raise PipelineCheckError(f"check_pipeline({label}): {type(exc).__name__}: {exc}") from exc
    if found.table is None:
        raise PipelineCheckError(f"check_pipeline({label}): main() returned without calling task.run(), so no "
                                 f"pipeline ran")
    if found.completed == 0:
        raise PipelineCheckError(f"check_pipeline({label}): the run ended before its first iteration completed")
    return found.table
