"""The off-policy family's pipelines: a replay buffer between the collectors and the learner.

- :func:`q_learning`: epsilon-greedy DQN (cartpole/dqn, atari/dqn).
- :func:`q_mixing`: QMIX and VDN for a team (mpe/qmix): sequences ``[L, B]`` from episode starts in a
  :class:`~conveyor.data.SequenceBuffer`, ``L`` the collector's chunk length ``n_sample / collector_env_num``.
- :func:`actor_critic`: SAC and TD3 (pendulum/sac, pendulum/td3, lunarlander_continuous/sac, mujoco/sac,
  mujoco/td3), with random actions for the first ``collect.random_collect_size`` steps; :func:`recording`
  adds a recorder of every whole episode collected (``conveyor collect --d4rl``).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional

from conveyor.data import SequenceBuffer
from conveyor.engine import task
from conveyor.middleware import (OffPolicyLearner, StepCollector, data_pusher, episode_recorder, eps_greedy_handler,
                                 interaction_evaluator, nstep_reward_enhancer)
from conveyor.run import Run
from conveyor.run.core import Pipeline
from conveyor.schema import ConfigError

__all__ = ["actor_critic", "q_learning", "q_mixing", "recording"]


def q_learning(run: Run) -> None:
    """Evaluate, act epsilon-greedily, collect, n-step returns, push to the replay buffer, learn from it."""
    cfg, policy = run.cfg, run.policy
    buffer = run.buffer()
    task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
    task.use(eps_greedy_handler(cfg), role=task.role.COLLECTOR)
    task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
    if cfg.policy.nstep > 1:
        task.use(nstep_reward_enhancer(cfg), role=task.role.COLLECTOR)
    task.use(data_pusher(cfg, buffer), role=task.role.LEARNER)
    task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer), role=task.role.LEARNER)


def q_mixing(run: Run) -> None:
    """Evaluate the team greedily, act epsilon-greedily, collect chunks of whole episodes, cut them into sequences in
    a replay buffer, learn from batches of sequences."""
    cfg, policy = run.cfg, run.policy
    length = math.ceil(cfg.policy.collect.n_sample / cfg.env.collector_env_num)  # the collector's chunk: [L, N]
    buffer = run.save_state("buffer", SequenceBuffer(cfg.policy.other.replay_buffer.size, length, seed=cfg.seed))
    task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
    task.use(eps_greedy_handler(cfg), role=task.role.COLLECTOR)
    task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
    task.use(data_pusher(cfg, buffer), role=task.role.LEARNER)
    task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer), role=task.role.LEARNER)


def actor_critic(run: Run, record: Optional[Any] = None) -> None:
    """Evaluate, collect (random actions first), record whole episodes to ``record`` (a
    :class:`~conveyor.data.DatasetWriter`) when given, n-step returns, push to the replay buffer, learn from it."""
    cfg, policy = run.cfg, run.policy
    buffer = run.buffer()
    task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
    task.use(StepCollector(cfg, policy.collect_mode, run.env("collector"),
                           random_collect_size=cfg.policy.collect.random_collect_size), role=task.role.COLLECTOR)
    if record is not None:
        task.use(episode_recorder(record), role=task.role.COLLECTOR)
    if cfg.policy.nstep > 1:
        task.use(nstep_reward_enhancer(cfg), role=task.role.COLLECTOR)
    task.use(data_pusher(cfg, buffer), role=task.role.LEARNER)
    task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer), role=task.role.LEARNER)


def recording(pipeline: Pipeline, record: Optional[Any], async_mode: bool = False) -> Pipeline:
    """``pipeline`` (:func:`actor_critic`), writing every whole episode it collects to ``record`` when one is given
    (one process only: the recorder is not sent to an async run's collector process)."""
    if record is None:
        return pipeline
    if async_mode:
        raise ConfigError("record: the episode recorder runs in one process; leave async_mode (--async) out")
    return functools.partial(pipeline, record=record)
