"""SAC on Pendulum-v1: twin critics, learned temperature; a mean eval return above -200 after 6-8k env steps.

    conveyor train pendulum/sac [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Type

from easydict import EasyDict

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import (OffPolicyLearner, StepCollector, data_pusher, episode_recorder, interaction_evaluator,
                                 nstep_reward_enhancer)
from conveyor.policy import SACPolicy
from conveyor.schema import ConfigError
from conveyor.zoo.run import Run

main_config = EasyDict(dict(
    exp_name="pendulum_sac",
    seed=0,
    env=dict(env_id="Pendulum-v1", collector_env_num=4, evaluator_env_num=5, n_evaluator_episode=10, stop_value=-200.0),
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[128, 128]),
        learn=dict(batch_size=256, learning_rate=1e-3, update_per_collect=8, learning_starts=1000,
                   target_theta=0.005, auto_alpha=True, alpha=0.2),
        collect=dict(n_sample=8, random_collect_size=1000),
        eval=dict(evaluator=dict(eval_freq=2000)),
        other=dict(replay_buffer=dict(size=100_000)),
    ),
))
"""The default config; every key is documented in SACPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, defaults: Optional[Mapping[str, Any]] = None,
         policy: Type[Any] = SACPolicy, record: Optional[Any] = None, **options: Any) -> OnlineRLContext:
    """Train SAC on Pendulum; returns the final context. Other off-policy entries train this pipeline with their
    ``defaults`` and ``policy`` (lunarlander_continuous/sac, pendulum/td3). ``record``: a
    :class:`~conveyor.data.DatasetWriter` that receives every whole episode the run collects (a medium-replay
    dataset, ``conveyor collect --d4rl``; one process only). ``options``: :class:`~conveyor.zoo.run.Run`'s
    (``seed``, ``exp_name``, ``max_env_step``...)."""
    defaults = main_config if defaults is None else defaults
    if record is not None and options.get("async_mode"):
        raise ConfigError("record: the episode recorder runs in one process; leave async_mode (--async) out")
    again = functools.partial(main, defaults=defaults, policy=policy)  # what an async run's collector process runs
    with Run(again, defaults, policy, cfg, ckpt_freq=5000, **options) as run:
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
        return run.train()
