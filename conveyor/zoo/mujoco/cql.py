"""CQL on MuJoCo (HalfCheetah-v5 by default), continuous, from a D4RL-style dataset of the zoo's own SAC.

Build the dataset (as for mujoco/bc), then train:

    conveyor collect mujoco/sac --d4rl medium-replay --env HalfCheetah-v5
    conveyor train mujoco/cql [--seed N] [--max-train-iter N] [--resume]

Hyperparameters: the CQL paper's for the D4RL Gym tasks (Kumar et al. 2020, arXiv:2006.04779, appendix F,
and its code's ``cql_mujoco_new.py``): SAC with 256-256-256 networks, critic Adam 3e-4, actor 1e-4, batch
256, tau 0.005, gamma 0.99, a learned temperature, CQL(H) with a fixed alpha of 5 and 10 actions per proposal,
and the first 40k gradient steps of behaviour-cloning the actor (``policy_eval_start``: ``learn.bc_warmup_steps``).
The paper trains 1M gradient steps; the default here is 100k.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import CQLPolicy
from conveyor.run import Run
from conveyor.zoo import offline
from conveyor.zoo.mujoco.bc import BUILD_DATASET, EVAL

main_config = EasyDict(dict(
    exp_name="mujoco_cql",
    seed=0,
    env=dict(EVAL),
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[256, 256, 256]),
        learn=dict(batch_size=256, learning_rate=3e-4, actor_learning_rate=1e-4, target_theta=0.005,
                   auto_alpha=True, cql_alpha=5.0, cql_n_actions=10, bc_warmup_steps=40_000, max_train_iter=100_000),
        eval=dict(evaluator=dict(eval_freq=10_000)),
        other=dict(dataset=dict(id="conveyor/halfcheetah/medium-replay-s0-v0")),
    ),
))
"""The default config; every key is documented in CQLPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train continuous CQL on the MuJoCo dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s;
    offline, a run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, CQLPolicy, cfg, build_dataset=BUILD_DATASET, **options).train()
