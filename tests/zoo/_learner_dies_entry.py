"""A zoo entry for fault tests: cartpole/dqn whose learner (node 0) kills itself (SIGKILL) once it has
``DIE_AT_ENV_STEP`` env steps."""
import os
import signal

from conveyor.engine import task
from conveyor.middleware import OffPolicyLearner
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

DIE_AT_ENV_STEP = 128
_learn = OffPolicyLearner.__call__


def _dies(self, ctx) -> None:
    if task.router.node_id == 0 and ctx.env_step >= DIE_AT_ENV_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    return _learn(self, ctx)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    OffPolicyLearner.__call__ = _dies
