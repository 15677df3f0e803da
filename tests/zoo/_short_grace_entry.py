"""A zoo entry for fault tests about what follows the learner's wait for a collector, not about its length:
cartpole/dqn whose learner, once its last collector is lost, waits ``GRACE_S`` for one to (re)join instead of
``ContextExchanger``'s default ``grace_s`` (10 s)."""
from conveyor.engine import task
from conveyor.middleware import ContextExchanger
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

GRACE_S = 2.0
_init = ContextExchanger.__init__


def _short_grace(self, *args, **kwargs) -> None:
    _init(self, *args, **{"grace_s": GRACE_S, **kwargs})


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    ContextExchanger.__init__ = _short_grace
