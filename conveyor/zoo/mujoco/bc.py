"""Behaviour cloning on MuJoCo (HalfCheetah-v5 by default) from a D4RL-style dataset of the zoo's own SAC.

Build the dataset (one SAC run: docs/offline.md), then train:

    conveyor collect mujoco/sac --d4rl medium-replay --env HalfCheetah-v5
    conveyor train mujoco/bc [--seed N] [--max-train-iter N] [--resume]
    conveyor train mujoco/bc --set env.env_id=Hopper-v5 --set policy.other.dataset.id=conveyor/hopper/medium-replay-s0-v0

The dataset id is ``conveyor/<env>/<medium|medium-replay>-s<seed>-v0`` (``conveyor collect --d4rl`` prints
it). Hyperparameters: the BC baseline of the IQL paper's code (Kostrikov et al. 2021, arXiv:2110.06169):
256-256 networks, Adam 3e-4, batch 256; a deterministic tanh policy regressed on the dataset's actions
(BCPolicy's continuous head). The papers train 1M gradient steps; the default here is 100k.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import BCPolicy
from conveyor.run import Run
from conveyor.zoo import offline

BUILD_DATASET = "conveyor collect mujoco/sac --d4rl medium-replay --env HalfCheetah-v5"
"""The command that records the MuJoCo offline entries' default dataset (quoted when it is missing)."""

EVAL = dict(env_id="HalfCheetah-v5", evaluator_env_num=10, n_evaluator_episode=10, stop_value=None)
"""The offline MuJoCo entries' evaluation: 10 deterministic episodes, no stop value (the budget ends a run)."""

main_config = EasyDict(dict(
    exp_name="mujoco_bc",
    seed=0,
    env=dict(EVAL),
    policy=dict(
        model=dict(action_space="continuous", hidden_sizes=[256, 256]),
        learn=dict(batch_size=256, learning_rate=3e-4, max_train_iter=100_000),
        eval=dict(evaluator=dict(eval_freq=10_000)),
        other=dict(dataset=dict(id="conveyor/halfcheetah/medium-replay-s0-v0")),
    ),
))
"""The default config; every key is documented in BCPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train BC on the MuJoCo dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s; offline, a
    run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, BCPolicy, cfg, build_dataset=BUILD_DATASET, **options).train()
