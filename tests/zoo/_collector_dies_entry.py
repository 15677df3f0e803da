"""A zoo entry for fault tests: cartpole/dqn whose collector node 1 kills itself (SIGKILL) in its first life,
once it has collected ``DIE_AT_ENV_STEP`` env steps; restarted, it collects normally."""
import os
import signal

from conveyor.engine import task
from conveyor.middleware import StepCollector
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

DIE_AT_ENV_STEP = 64
_collect = StepCollector.__call__


def _dies_once(self, ctx) -> None:
    if task.router.node_id == 1 and task.router.restarts == 0 and ctx.env_step >= DIE_AT_ENV_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    return _collect(self, ctx)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    StepCollector.__call__ = _dies_once
