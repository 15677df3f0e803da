"""IQL on Pendulum-v1 from the "medium" dataset pendulum/cql uses.

Build the dataset (as for pendulum/cql), then train:

    conveyor train pendulum/sac --exp-name pendulum_medium --max-env-step 3000
    conveyor collect pendulum/sac --ckpt runs/pendulum_medium/ckpt/final.pth.tar --episodes 100 \\
        --dataset-id pendulum/medium-v0
    conveyor train pendulum/iql [--seed N] [--exp-name NAME] [--max-train-iter N] [--resume]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import IQLPolicy
from conveyor.run import Run
from conveyor.zoo import offline
from conveyor.zoo.pendulum.cql import BUILD_DATASET

main_config = EasyDict(dict(
    exp_name="pendulum_iql",
    seed=0,
    env=dict(env_id="Pendulum-v1", evaluator_env_num=5, n_evaluator_episode=10, stop_value=-150.0),
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[128, 128]),
        learn=dict(batch_size=256, learning_rate=3e-4, expectile=0.7, beta=3.0, max_weight=100.0,
                   max_train_iter=5000),
        eval=dict(evaluator=dict(eval_freq=1000)),
        other=dict(dataset=dict(id="pendulum/medium-v0")),
    ),
))
"""The default config; every key is documented in IQLPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train IQL on the Pendulum dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s; offline,
    a run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, IQLPolicy, cfg, build_dataset=BUILD_DATASET, **options).train()
