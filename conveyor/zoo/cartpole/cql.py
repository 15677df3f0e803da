"""Discrete CQL (DQN plus the conservative penalty) on CartPole-v1 from an expert dataset.

Build the dataset from the zoo's DQN expert (the one cartpole/bc uses), then train:

    conveyor train cartpole/dqn --exp-name cartpole_expert
    conveyor collect cartpole/dqn --ckpt runs/cartpole_expert/ckpt/eval_best.pth.tar --episodes 100 \\
        --dataset-id cartpole/expert-v0
    conveyor train cartpole/cql [--seed N] [--exp-name NAME] [--max-train-iter N] [--resume]

For the "mixed" data of benchmarks/offline.py (half the episodes with random actions at probability 0.5), record
``--noise 0.5`` episodes as well and train on both (benchmarks/offline.py shows how it joins them).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import DiscreteCQLPolicy
from conveyor.run import Run
from conveyor.zoo import offline
from conveyor.zoo.cartpole import bc

main_config = EasyDict(dict(
    exp_name="cartpole_cql",
    seed=0,
    env=copy.deepcopy(bc.main_config.env),  # cartpole/bc's: CartPole-v1, 10 evaluation episodes, stop at 500
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[128, 128], dueling=True),
        learn=dict(batch_size=256, learning_rate=1e-3, target_theta=0.01, cql_alpha=1.0, max_train_iter=5000),
        # cartpole/bc's evaluation (every 500 train iterations) and dataset (cartpole/expert-v0)
        **copy.deepcopy({key: bc.main_config.policy[key] for key in ("eval", "other")}),
    ),
))
"""The default config; every key is documented in DiscreteCQLPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train discrete CQL on the CartPole dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s;
    offline, a run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, DiscreteCQLPolicy, cfg, build_dataset=bc.BUILD_DATASET, **options).train()
