"""IPPO on MPE's simple_spread_v3: mpe/mappo's setting with a critic that reads each agent's own observation.

    conveyor train mpe/ippo [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async] [--collectors N]

Compare with ``mpe/mappo``, the same PPO whose critic reads the env's global state.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from conveyor.config import merge_config
from conveyor.engine import OnlineRLContext
from conveyor.policy import IPPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy
from conveyor.zoo.mpe import mappo

main_config = merge_config(mappo.main_config, dict(exp_name="mpe_ippo"))
"""mpe/mappo's config; IPPOPolicy's critic is decentralized by default. Every key is documented in
IPPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train IPPO on simple_spread; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, IPPOPolicy, cfg, **options).train()
