"""IQL on MuJoCo (HalfCheetah-v5 by default) from a D4RL-style dataset of the zoo's own SAC.

Build the dataset (as for mujoco/bc), then train:

    conveyor collect mujoco/sac --d4rl medium-replay --env HalfCheetah-v5
    conveyor train mujoco/iql [--seed N] [--max-train-iter N] [--resume]

Hyperparameters: the IQL paper's for the MuJoCo locomotion tasks (Kostrikov et al. 2021, arXiv:2110.06169,
appendix B): 256-256 networks, Adam 3e-4 for every network, batch 256, tau 0.005, gamma 0.99, expectile 0.7,
inverse temperature 3, advantage weights clipped at 100, and rewards scaled by 1000 / (the dataset's best minus
worst episode return) (``policy.other.dataset.reward_scale='returns_range'``) and the actor's learning rate decayed
to 0 on a cosine over the run (``learn.actor_lr_decay='cosine'``). The paper trains 1M gradient steps; the default
here is 100k.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import IQLPolicy
from conveyor.run import Run
from conveyor.zoo import offline
from conveyor.zoo.mujoco.bc import BUILD_DATASET, EVAL

main_config = EasyDict(dict(
    exp_name="mujoco_iql",
    seed=0,
    env=dict(EVAL),
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[256, 256]),
        learn=dict(batch_size=256, learning_rate=3e-4, target_theta=0.005, expectile=0.7, beta=3.0,
                   max_weight=100.0, actor_lr_decay="cosine", max_train_iter=100_000),
        eval=dict(evaluator=dict(eval_freq=10_000)),
        other=dict(dataset=dict(id="conveyor/halfcheetah/medium-replay-s0-v0", reward_scale="returns_range")),
    ),
))
"""The default config; every key is documented in IQLPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train IQL on the MuJoCo dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s; offline, a
    run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, IQLPolicy, cfg, build_dataset=BUILD_DATASET, **options).train()
