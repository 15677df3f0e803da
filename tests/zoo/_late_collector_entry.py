"""A zoo entry for race tests: cartpole/dqn whose collector node 2 holds its first batch until the learner has
trained its budget on node 1's batches and unsubscribed from the data, as a collector slow to start on a busy
machine would; from then on it collects normally."""
import threading
import time

from conveyor.engine import task
from conveyor.middleware import StepCollector
from conveyor.middleware.exchanger import DATA_TOPIC
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

HOLD_S = 120
_collect = StepCollector.__call__
_held, _never = threading.Event(), threading.Event()


def _learner_gone() -> bool:
    return task.finish and not task.router.subscribers(DATA_TOPIC)


def _late_first_batch(self, ctx):
    if task.router.node_id == 2 and not _held.is_set():
        _held.set()
        deadline = time.monotonic() + HOLD_S
        while not _learner_gone() and time.monotonic() < deadline:  # the learner's stop, then its unsubscription
            _never.wait(0.05)
    return _collect(self, ctx)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    StepCollector.__call__ = _late_first_batch
