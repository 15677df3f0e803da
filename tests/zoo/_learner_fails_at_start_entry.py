"""A zoo entry for launch tests: cartpole/dqn whose learner (node 0) raises while it builds its pipeline,
after its run directory was made and before its first checkpoint, as a launch that fails would."""
from conveyor.engine import task
from conveyor.middleware import OffPolicyLearner
from conveyor.zoo.cartpole.dqn import main, main_config  # noqa: F401  (what an entry file defines)

_init = OffPolicyLearner.__init__


def _fails(self, *args, **kwargs) -> None:
    if task.router.node_id == 0:
        raise RuntimeError("the learner fails at its start")
    _init(self, *args, **kwargs)


if task.router is not None:  # only in the run's worker processes, never in the launcher (the test's process)
    OffPolicyLearner.__init__ = _fails
