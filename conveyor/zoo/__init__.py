"""The zoo: entries only, each a ready config and the pipeline it trains.

An entry is a module ``conveyor.zoo.<env>.<algo>`` holding ``main_config``, ``pipeline`` (its family's, from
:mod:`~conveyor.zoo.off_policy`, :mod:`~conveyor.zoo.on_policy`, :mod:`~conveyor.zoo.actor_learner` or
:mod:`~conveyor.zoo.offline`, where each shows its whole chain of ``task.use(..., role=...)``) and
``main(cfg=None, **options)``, which hands the pipeline to a :class:`conveyor.run.Run`; its name is
``"<env>/<algo>"`` (e.g. ``"cartpole/dqn"``). Entries are the modules of this package's subpackages. A user's
own ``.py`` file with a ``main_config`` and a ``main()`` is an entry too (:func:`load_entry`).
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import List

from conveyor.run.entries import UnknownEntryError, load_file
from conveyor.schema import closest

__all__ = ["entries", "load_entry", "load_file", "UnknownEntryError"]


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
