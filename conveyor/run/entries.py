"""An entry as a module: loaded from a user's ``.py`` file, and named so that another process loads it again.

The zoo (:mod:`conveyor.zoo`) maps names such as ``cartpole/dqn`` to its modules; a distributed run's nodes get
the module's :func:`entry_reference` and :func:`import_entry` it, so this layer knows no zoo name.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Tuple

__all__ = ["UnknownEntryError", "entry_reference", "import_entry", "load_file"]

_USER_PREFIX = "conveyor_user_entry_"


class UnknownEntryError(LookupError):
    """No entry has that name, or an entry file cannot be loaded."""


def load_file(path: Path, required: Tuple[str, ...] = ("main_config", "main")) -> ModuleType:
    """A user's entry file as a module; it must define every name in ``required``."""
    if not path.is_file():
        raise UnknownEntryError(f"no entry file {path}: give a zoo entry name such as 'cartpole/dqn' or the path "
                                f"of a .py file with a main_config and a main()")
    module_name = f"{_USER_PREFIX}{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so its classes and functions pickle for collector processes
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise UnknownEntryError(f"cannot load entry file {path}: {exc.msg} at line {exc.lineno}") from None
    except BaseException:
        del sys.modules[module_name]
        raise
    missing = [attr for attr in required if not hasattr(module, attr)]
    if missing:
        raise UnknownEntryError(f"entry file {path} defines no {' and no '.join(missing)}: an entry holds its config "
                                f"as main_config and trains with main(cfg=None, *, seed=None, ...)")
    return module


def entry_reference(entry: ModuleType) -> str:
    """What another process imports ``entry`` by: a user file's path, else the module's dotted name."""
    if entry.__name__.startswith(_USER_PREFIX) and getattr(entry, "__file__", None):
        return str(Path(entry.__file__).absolute())
    return entry.__name__


def import_entry(reference: str) -> ModuleType:
    """The entry module of an :func:`entry_reference`."""
    if reference.endswith(".py"):
        return load_file(Path(reference))
    return importlib.import_module(reference)
