"""A zoo entry for fault tests: cartpole/dqn whose learner rank 1 (node 1, with ``--learners 2``) kills itself
(SIGKILL) once its run has ``DIE_AT_ENV_STEP`` env steps and it has trained, first writing when (``time.monotonic()``,
one clock for every process of the machine) into ``DIED_AT`` in the working directory."""
import os
import signal
import time
from pathlib import Path

from conveyor.engine import task
from conveyor.middleware import OffPolicyLearner
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

DIE_AT_ENV_STEP = 400
DIED_AT = "rank1_died_at"
_learn = OffPolicyLearner.__call__


def _dies(self, ctx) -> None:
    if task.router.node_id == 1 and ctx.env_step >= DIE_AT_ENV_STEP and ctx.train_iter > 0:
        Path(DIED_AT).write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    return _learn(self, ctx)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    OffPolicyLearner.__call__ = _dies
