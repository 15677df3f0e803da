"""atari/impala whose learner appends the return of every training episode the collectors report (a full game)
to the file ``$IMPALA_LEARNING_EPISODES``, one per line: what ``benchmarks.impala_learning`` averages."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from conveyor.engine import OnlineRLContext, Role, task
from conveyor.middleware import EPISODE_EVENT
from conveyor.zoo.atari import impala
from conveyor.zoo.atari.impala import main_config  # noqa: F401  (what an entry file defines)


def _record(env_index: int, ret: float, length: int) -> None:
    with open(os.environ["IMPALA_LEARNING_EPISODES"], "a") as out:
        out.write(f"{ret}\n")


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """atari/impala's main(); the learner's process records training episodes."""
    if task.has_role(Role.LEARNER):
        task.on(EPISODE_EVENT, _record)
    return impala.main(cfg, **options)
