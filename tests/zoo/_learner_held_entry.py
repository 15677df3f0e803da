"""A zoo entry for the SIGTERM race: cartpole/dqn whose learner (node 0), its run directory just made (config.json
written, its policy, pipeline and checkpoint saver not built yet), writes ``HELD`` there and holds its start until
it is asked to stop (``task.finish``; at most ``HOLD_S``): a learner still far from its ``task.run`` at SIGTERM."""
import threading
import time
from pathlib import Path

import conveyor.run.modes
from conveyor.engine import task
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

HELD = "held"
HOLD_S = 60
_seed_everything = conveyor.run.modes.seed_everything


def _held_seeding(seed: int) -> None:
    _seed_everything(seed)  # _configure's last step: the run directory and its config.json exist
    if task.router.node_id == 0:
        run_dir, = {path.parent for path in Path("runs").glob("*/config.json")}
        (run_dir / HELD).write_text("")
        wait, deadline = threading.Event(), time.monotonic() + HOLD_S
        while not task.finish and time.monotonic() < deadline:
            wait.wait(0.05)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    conveyor.run.modes.seed_everything = _held_seeding
