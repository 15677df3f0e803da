"""MAPPO on MPE's simple_spread_v3: 3 agents cover 3 landmarks, one shared actor and a critic on the global state.

    conveyor train mpe/mappo [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async] [--collectors N]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import MAPPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy

main_config = EasyDict(dict(
    exp_name="mpe_mappo",
    seed=0,
    env=dict(env_id="mpe/simple_spread_v3", env_kwargs=dict(N=3, max_cycles=25, continuous_actions=False),
             collector_env_num=8, evaluator_env_num=8, n_evaluator_episode=16),
    policy=dict(
        discount_factor=0.99,
        gae_lambda=0.95,
        model=dict(hidden_sizes=[64, 64]),
        learn=dict(epoch_per_collect=10, batch_size=400, learning_rate=5e-4, clip_ratio=0.2, entropy_coef=0.01),
        collect=dict(n_sample=800),
        eval=dict(evaluator=dict(eval_freq=50)),
    ),
))
"""The default config; every key is documented in MAPPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train MAPPO on simple_spread; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, MAPPOPolicy, cfg, **options).train()
