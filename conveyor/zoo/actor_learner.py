"""The actor-learner family's pipeline: IMPALA (cartpole/impala, atari/impala), unrolls acted by the weights
a collector last received, corrected for their staleness by V-trace on the learner (docs/impala.md)."""
from __future__ import annotations

from conveyor.engine import task
from conveyor.middleware import StepCollector, interaction_evaluator, unroll_cutter, unroll_learner
from conveyor.run import Run

__all__ = ["pipeline"]


def pipeline(run: Run) -> None:
    """Evaluate, collect, cut the rollout into unrolls sent as they are, learn from them with V-trace."""
    cfg, policy = run.cfg, run.policy
    task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
    task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
    task.use(unroll_cutter(), role=task.role.COLLECTOR)  # [T, N] -> N unrolls of T steps, sent as they are
    task.use(unroll_learner(cfg, policy.learn_mode), role=task.role.LEARNER)  # publishes every publish_every
