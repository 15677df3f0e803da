"""A zoo entry for race tests: cartpole/dqn whose learner (node 0), its checkpoint saver made, holds its start for
``HOLD_S`` seconds once the evaluator node's first evaluation has reached it (``eval_best.pth.tar`` written), before
it enters ``task.run``: a learner slow to start on a busy machine while the others already run."""
import threading
import time
from pathlib import Path

import conveyor.run.core
from conveyor.engine import task
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

HOLD_S = 3  # well past the test's reaction to eval_best (it polls every 0.2 s), the race it pins
_log_evaluations = conveyor.run.core.log_evaluations


def _held_start() -> None:
    _log_evaluations()  # the last step of the learner's tail before task.run
    if task.router.node_id == 0:
        never, deadline = threading.Event(), time.monotonic() + 120
        while not any(Path("runs").glob("*/ckpt/eval_best.pth.tar")) and time.monotonic() < deadline:
            never.wait(0.05)
        never.wait(HOLD_S)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    conveyor.run.core.log_evaluations = _held_start
