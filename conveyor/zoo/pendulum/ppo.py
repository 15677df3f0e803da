"""PPO on Pendulum-v1: a state-independent Gaussian, observation normalisation, short horizon (gamma 0.9).

    conveyor train pendulum/ppo [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import PPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy

main_config = EasyDict(dict(
    exp_name="pendulum_ppo",
    seed=0,
    env=dict(env_id="Pendulum-v1", collector_env_num=4, evaluator_env_num=10, n_evaluator_episode=10,
             stop_value=-200.0),
    policy=dict(
        discount_factor=0.9,
        gae_lambda=0.95,
        model=dict(action_space="gaussian", hidden_sizes=[64, 64], obs_norm=True),
        learn=dict(epoch_per_collect=10, batch_size=64, learning_rate=1e-3, clip_ratio=0.2, entropy_coef=0.0,
                   value_coef=0.5, grad_clip=0.5),
        collect=dict(n_sample=4096),
        eval=dict(evaluator=dict(eval_freq=2000)),
    ),
))
"""The default config; every key is documented in PPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train PPO on Pendulum; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, PPOPolicy, cfg, **options).train()
