"""IQL on Pendulum-v1 from the "medium" dataset pendulum/cql uses.

Build the dataset (as for pendulum/cql), then train:

    conveyor train pendulum/sac --exp-name pendulum_medium --max-env-step 3000
    conveyor collect pendulum/sac --ckpt runs/pendulum_medium/ckpt/final.pth.tar --episodes 100 \\
        --dataset-id pendulum/medium-v0
    conveyor train pendulum/iql [--seed N] [--exp-name NAME] [--max-train-iter N] [--resume]
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import IQLPolicy
from conveyor.run import Run
from conveyor.zoo import offline
from conveyor.zoo.pendulum import cql

main_config = EasyDict(dict(
    exp_name="pendulum_iql",
    seed=0,
    env=copy.deepcopy(cql.main_config.env),  # pendulum/cql's: Pendulum-v1, 10 evaluation episodes, stop at -150
    policy=dict(
        # pendulum/cql's discount (0.99), 128-128 network, evaluation (every 1000 train iterations) and dataset
        # (pendulum/medium-v0): the two train on the same data and are evaluated alike
        **copy.deepcopy({key: cql.main_config.policy[key] for key in ("discount_factor", "model", "eval", "other")}),
        learn=dict(batch_size=256, learning_rate=3e-4, expectile=0.7, beta=3.0, max_weight=100.0,
                   max_train_iter=5000),
    ),
))
"""The default config; every key is documented in IQLPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train IQL on the Pendulum dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s; offline,
    a run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, IQLPolicy, cfg, build_dataset=cql.BUILD_DATASET, **options).train()
