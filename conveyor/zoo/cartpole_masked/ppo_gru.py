"""Recurrent PPO (GRU core) on CartPole without velocities: it infers them from the observation history.

    conveyor train cartpole_masked/ppo_gru [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]

Compare with ``cartpole_masked/ppo``, the same PPO with a feed-forward policy on the same env.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from conveyor.config import merge_config
from conveyor.engine import OnlineRLContext
from conveyor.policy import PPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy
from conveyor.zoo.cartpole_masked import ppo

main_config = merge_config(ppo.main_config, dict(
    exp_name="cartpole_masked_ppo_gru",
    policy=dict(model=dict(hidden_sizes=[64], rnn="gru", rnn_hidden_size=64), learn=dict(sequence_length=32)),
))
"""cartpole_masked/ppo's config with a GRU core trained on sequences of 32 steps; every key is documented in
PPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train recurrent PPO on masked CartPole; returns the final context. ``options``: :class:`~conveyor.run.Run`'s
    (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, PPOPolicy, cfg, **options).train()
