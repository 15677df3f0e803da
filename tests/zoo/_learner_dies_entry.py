"""A zoo entry for fault tests: cartpole/dqn whose learner (node 0) kills itself (SIGKILL) in its first life once
it has ``DIE_AT_ENV_STEP`` env steps. Each life of the learner appends ``restarts total_step env_step`` of its
first iteration (``total_step``: iterations the run had completed before it) to ``LIVES_FILE`` (in the
working directory), and before its SIGKILL writes when (``time.monotonic()``, one clock for every process of the
machine) into ``DIED_AT`` there."""
import os
import signal
import time
from pathlib import Path

from conveyor.engine import task
from conveyor.middleware import OffPolicyLearner
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

DIE_AT_ENV_STEP = 128
LIVES_FILE = "learner_lives.txt"
DIED_AT = "learner_died_at"
_learn = OffPolicyLearner.__call__
_first = []


def _dies(self, ctx) -> None:
    if task.router.node_id == 0:
        if not _first:
            _first.append(ctx.total_step)
            with open(LIVES_FILE, "a") as f:
                f.write(f"{task.router.restarts} {ctx.total_step} {ctx.env_step}\n")
        if task.router.restarts == 0 and ctx.env_step >= DIE_AT_ENV_STEP:
            Path(DIED_AT).write_text(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
    return _learn(self, ctx)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    OffPolicyLearner.__call__ = _dies
