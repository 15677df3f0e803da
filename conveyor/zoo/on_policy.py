"""The on-policy family's pipeline: PPO (cartpole/ppo, cartpole_masked/ppo, cartpole_masked/ppo_gru,
pendulum/ppo, atari/ppo, mujoco/ppo)."""
from __future__ import annotations

from conveyor.engine import task
from conveyor.middleware import StepCollector, gae_estimator, interaction_evaluator, multistep_trainer
from conveyor.run import Run

__all__ = ["pipeline"]


def pipeline(run: Run) -> None:
    """Evaluate, collect a rollout, estimate advantages with the version that acted, train epochs on it."""
    cfg, policy = run.cfg, run.policy
    task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
    task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
    task.use(gae_estimator(cfg, policy.collect_mode), role=task.role.COLLECTOR)  # by the version that acted
    task.use(multistep_trainer(cfg, policy.learn_mode), role=task.role.LEARNER)  # locks against checkpoints
