"""The offline family's pipeline: BC, CQL and IQL from a dataset (cartpole/bc, cartpole/cql, pendulum/cql,
pendulum/iql, mujoco/bc, mujoco/cql, mujoco/iql), in one process."""
from __future__ import annotations

from conveyor.engine import task
from conveyor.middleware import interaction_evaluator, offline_data_fetcher, trainer
from conveyor.run import Run

__all__ = ["pipeline"]


def pipeline(run: Run) -> None:
    """Evaluate, fetch a batch of the dataset (``run.dataset``), train on it."""
    cfg, policy, env = run.cfg, run.policy, run.env("evaluator")
    task.use(interaction_evaluator(cfg, policy.eval_mode, env))
    task.use(offline_data_fetcher(cfg, run.dataset, observation_space=env.observation_space,
                                  action_space=env.action_space))
    task.use(trainer(cfg, policy.learn_mode))
