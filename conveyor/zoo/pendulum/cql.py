"""Continuous CQL (SAC plus the conservative penalty) on Pendulum-v1 from a "medium" dataset.

The medium behaviour policy is the zoo's SAC stopped early, scoring about -400 to -600. Build the dataset,
then train:

    conveyor train pendulum/sac --exp-name pendulum_medium --max-env-step 3000
    conveyor collect pendulum/sac --ckpt runs/pendulum_medium/ckpt/final.pth.tar --episodes 100 \\
        --dataset-id pendulum/medium-v0
    conveyor train pendulum/cql [--seed N] [--exp-name NAME] [--max-train-iter N] [--resume]

How many env steps give a medium policy varies with the seed (the collect command prints the recorded episodes'
mean return); benchmarks/offline.py trains in short rounds and stops in the -400 to -600 band.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import CQLPolicy
from conveyor.run import Run
from conveyor.zoo import offline

BUILD_DATASET = ("conveyor train pendulum/sac --exp-name pendulum_medium --max-env-step 3000 && conveyor collect "
                 "pendulum/sac --ckpt runs/pendulum_medium/ckpt/final.pth.tar --episodes 100 "
                 "--dataset-id pendulum/medium-v0")
"""The commands that record the Pendulum entries' dataset (quoted when it is missing)."""

main_config = EasyDict(dict(
    exp_name="pendulum_cql",
    seed=0,
    env=dict(env_id="Pendulum-v1", evaluator_env_num=5, n_evaluator_episode=10, stop_value=-150.0),
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[128, 128]),
        # cql_alpha 5 as in the CQL paper's MuJoCo runs: on seed 0's medium data (behaviour -805) the final policy
        # scored -556 over 20 episodes, against -770 with alpha 1 (benchmarks/offline.py, one seed only).
        learn=dict(batch_size=256, learning_rate=3e-4, cql_alpha=5.0, cql_n_actions=4, max_train_iter=5000),
        eval=dict(evaluator=dict(eval_freq=1000)),
        other=dict(dataset=dict(id="pendulum/medium-v0")),
    ),
))
"""The default config; every key is documented in CQLPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train continuous CQL on the Pendulum dataset; returns the final context. ``options``:
    :class:`~conveyor.run.Run`'s; offline, a run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, CQLPolicy, cfg, build_dataset=BUILD_DATASET, **options).train()
