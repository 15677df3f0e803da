"""PPO on CartPole-v1: short rollouts from 8 envs, up to 20 full-batch epochs each, stopped early by a KL target.

    conveyor train cartpole/ppo [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import PPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy

main_config = EasyDict(dict(
    exp_name="cartpole_ppo",
    seed=0,
    env=dict(env_id="CartPole-v1", collector_env_num=8, evaluator_env_num=10, n_evaluator_episode=10, stop_value=475.0),
    policy=dict(
        discount_factor=0.98,
        gae_lambda=0.8,
        model=dict(hidden_sizes=[64, 64]),
        learn=dict(epoch_per_collect=20, batch_size=256, learning_rate=4e-3, lr_anneal_steps=102_400, target_kl=0.03,
                   clip_ratio=0.2, entropy_coef=0.0, value_coef=1.0, grad_clip=0.5),
        collect=dict(n_sample=256),
        eval=dict(evaluator=dict(eval_freq=200)),
    ),
))
"""The default config; every key is documented in PPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train PPO on CartPole; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, PPOPolicy, cfg, **options).train()
