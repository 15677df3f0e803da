"""DQN on CartPole-v1: double DQN with a dueling head and 3-step returns.

    conveyor train cartpole/dqn [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import (OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler,
                                 interaction_evaluator, nstep_reward_enhancer)
from conveyor.policy import DQNPolicy
from conveyor.zoo.run import Run

main_config = EasyDict(dict(
    exp_name="cartpole_dqn",
    seed=0,
    env=dict(
        env_id="CartPole-v1",
        collector_env_num=8,
        evaluator_env_num=10,  # the 10 evaluation episodes run in one lock-stepped pass
        n_evaluator_episode=10,
        stop_value=475.0,
    ),
    policy=dict(
        discount_factor=0.99,
        nstep=3,
        model=dict(hidden_sizes=[128, 128], dueling=True),
        # One gradient step per 2 env steps, a fast learning rate and a fast soft target: over 20 seeds
        # (0-19) this solved at a median of 8k env steps, none past 20k. The sweep, each over seeds 0-9:
        # lr 1e-3 with target_theta 0.01 took a median of 17k (max 26k); lr 2e-3, 11k; lr 2e-3 with
        # theta 0.02, 9k (max 14k); lr 4e-3 with theta 0.02, 11k; batch 128 with half the gradient
        # steps, 36k; a 64-64 network, 28k; 5-step returns, 18k; faster eps decay, 21k. Rerun a point with
        # python -m benchmarks.solve cartpole/dqn --seeds 10 --set policy.learn.learning_rate=2e-3
        learn=dict(batch_size=64, learning_rate=3e-3, update_per_collect=16, target_theta=0.02),
        collect=dict(n_sample=32),
        eval=dict(evaluator=dict(eval_freq=500)),
        other=dict(
            eps=dict(kind="exp", start=1.0, end=0.05, decay=5000),
            replay_buffer=dict(size=20000),
        ),
    ),
))
"""The default config; every key is documented in DQNPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, defaults: Optional[Mapping[str, Any]] = None,
         **options: Any) -> OnlineRLContext:
    """Train DQN on CartPole (atari/dqn trains this pipeline on its ``defaults``); returns the final context.
    ``options``: those of :class:`~conveyor.zoo.run.Run` (``seed``, ``exp_name``, ``max_env_step``, ``resume``,
    ``async_mode``...)."""
    defaults = main_config if defaults is None else defaults
    with Run(main, defaults, DQNPolicy, cfg, **options) as run:
        cfg, policy = run.cfg, run.policy
        buffer = run.buffer()
        task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
        task.use(eps_greedy_handler(cfg), role=task.role.COLLECTOR)
        task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
        if cfg.policy.nstep > 1:
            task.use(nstep_reward_enhancer(cfg), role=task.role.COLLECTOR)
        task.use(data_pusher(cfg, buffer), role=task.role.LEARNER)
        task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer), role=task.role.LEARNER)
        return run.train()
