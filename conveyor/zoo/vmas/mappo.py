"""MAPPO on VMAS's navigation: 3 agents each reach their own goal without colliding, with continuous forces.

    conveyor train vmas/mappo [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async] [--collectors N]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import MAPPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy

main_config = EasyDict(dict(
    exp_name="vmas_mappo",
    seed=0,
    env=dict(env_id="vmas/navigation", env_kwargs=dict(n_agents=3, max_steps=100, continuous_actions=True),
             collector_env_num=8, evaluator_env_num=8, n_evaluator_episode=8),
    policy=dict(
        discount_factor=0.99,
        gae_lambda=0.9,
        model=dict(action_space="gaussian", action_low=-1.0, action_high=1.0, hidden_sizes=[64, 64],
                   activation="tanh"),
        learn=dict(epoch_per_collect=5, batch_size=800, learning_rate=5e-4, clip_ratio=0.2, entropy_coef=0.0),
        collect=dict(n_sample=1600),
        eval=dict(evaluator=dict(eval_freq=50)),
    ),
))
"""The default config; every key is documented in MAPPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train MAPPO on VMAS navigation; returns the final context. ``options``: :class:`~conveyor.run.Run`'s
    (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, MAPPOPolicy, cfg, **options).train()
