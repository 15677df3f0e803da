"""The zoo: ready configs, each with a ``main()`` that assembles and runs its pipeline.

An entry is a module ``conveyor.zoo.<env>.<algo>`` holding ``main_config`` and ``main(...)``; its
name is ``"<env>/<algo>"`` (e.g. ``"cartpole/dqn"``). Entries are found by walking this package.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import List

from conveyor.schema import closest

__all__ = ["entries", "load_entry", "UnknownEntryError"]


class UnknownEntryError(LookupError):
    """No zoo entry has that name."""


def entries() -> List[str]:
    """Names of every zoo entry, sorted (``"cartpole/dqn"``, ...)."""
    root = Path(__file__).parent
    found = []
    for env in pkgutil.iter_modules([str(root)]):
        if env.ispkg:
            for algo in pkgutil.iter_modules([str(root / env.name)]):
                if not algo.ispkg and not algo.name.startswith("_"):
                    found.append(f"{env.name}/{algo.name}")
    return sorted(found)


def load_entry(name: str) -> ModuleType:
    """The module of zoo entry ``name``; an unknown name is an error listing the closest one."""
    known = entries()
    if name not in known:
        hint = closest(name, known)
        fix = f"did you mean '{hint}'?" if hint else f"known entries: {', '.join(known)}"
        raise UnknownEntryError(f"no zoo entry '{name}': {fix}")
    env, algo = name.split("/")
    return importlib.import_module(f"conveyor.zoo.{env}.{algo}")
