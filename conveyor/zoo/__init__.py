"""The zoo: ready configs, each with a ``main()`` that assembles and runs its pipeline.

An entry is a module ``conveyor.zoo.<env>.<algo>`` holding ``main_config`` and ``main(cfg=None, **options)``;
its name is ``"<env>/<algo>"`` (e.g. ``"cartpole/dqn"``). Entries are found by walking this package.
``main()`` builds its pipeline inline with ``task.use(..., role=...)`` inside a :class:`conveyor.zoo.run.Run`,
the public module of what every run shares (``conveyor.zoo.run`` is not an entry). A user's own ``.py`` file
with a ``main_config`` and a ``main()`` is an entry too (:func:`load_entry`).
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import List, Tuple

from conveyor.schema import closest

__all__ = ["entries", "load_entry", "load_file", "UnknownEntryError"]


class UnknownEntryError(LookupError):
    """No zoo entry has that name."""


def entries() -> List[str]:
    """Names of every zoo entry, sorted (``"cartpole/dqn"``, ...)."""
    root = Path(__file__).parent
    found = []
    for env in pkgutil.iter_modules([str(root)]):
        if env.ispkg and env.name != "run":  # conveyor.zoo.run is what entries share, not an env
            for algo in pkgutil.iter_modules([str(root / env.name)]):
                if not algo.ispkg and not algo.name.startswith("_"):
                    found.append(f"{env.name}/{algo.name}")
    return sorted(found)


def load_entry(name: str) -> ModuleType:
    """The module of zoo entry ``name`` (any case: ``CartPole/DQN``), or of a user's entry file ``*.py``.

    An unknown name is an error naming the closest one; a file must exist and define ``main_config`` and
    ``main``. Errors its code raises while loading are the user's and propagate as they are.
    """
    if name.endswith(".py"):
        return load_file(Path(name))
    known = entries()
    wanted = name.strip().lower()
    if wanted not in known:
        hint = closest(wanted, known)
        fix = f"did you mean '{hint}'?" if hint else f"known entries: {', '.join(known)}"
        raise UnknownEntryError(f"no zoo entry '{name}': {fix} (`conveyor list` shows them all)")
    env, algo = wanted.split("/")
    return importlib.import_module(f"conveyor.zoo.{env}.{algo}")


def load_file(path: Path, required: Tuple[str, ...] = ("main_config", "main")) -> ModuleType:
    """A user's entry file as a module; it must define every name in ``required``."""
    if not path.is_file():
        raise UnknownEntryError(f"no entry file {path}: give a zoo entry name such as 'cartpole/dqn' or the path "
                                f"of a .py file with a main_config and a main()")
    module_name = f"conveyor_user_entry_{path.stem}"
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
