"""Behaviour cloning on CartPole-v1 from an expert dataset (50k transitions of a DQN scoring >= 475).

Build the dataset from the zoo's DQN expert, then train (from one folder: runs/ lives there):

    conveyor train cartpole/dqn --exp-name cartpole_expert
    conveyor collect cartpole/dqn --ckpt runs/cartpole_expert/ckpt/eval_best.pth.tar --episodes 100 \\
        --dataset-id cartpole/expert-v0
    conveyor train cartpole/bc [--seed N] [--exp-name NAME] [--max-train-iter N] [--resume]

The dataset goes to the local Minari folder (``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``), where
this entry looks for it; point ``policy.other.dataset.id`` at another id or at a file to train on other data.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OfflineRLContext
from conveyor.policy import BCPolicy
from conveyor.run import Run
from conveyor.zoo import offline

BUILD_DATASET = ("conveyor train cartpole/dqn --exp-name cartpole_expert && conveyor collect cartpole/dqn --ckpt "
                 "runs/cartpole_expert/ckpt/eval_best.pth.tar --episodes 100 --dataset-id cartpole/expert-v0")
"""The commands that record the CartPole offline entries' dataset (cartpole/cql's too; quoted when it is missing)."""

main_config = EasyDict(dict(
    exp_name="cartpole_bc",
    seed=0,
    env=dict(env_id="CartPole-v1", evaluator_env_num=10, n_evaluator_episode=10, stop_value=500.0),
    policy=dict(
        model=dict(action_space="discrete", hidden_sizes=[128, 128]),
        learn=dict(batch_size=256, learning_rate=1e-3, max_train_iter=5000),
        eval=dict(evaluator=dict(eval_freq=500)),
        other=dict(dataset=dict(id="cartpole/expert-v0")),
    ),
))
"""The default config; every key is documented in BCPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = offline.pipeline
"""What this entry trains: the offline family's pipeline, ``conveyor/zoo/offline.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OfflineRLContext:
    """Train BC on the CartPole dataset; returns the final context. ``options``: :class:`~conveyor.run.Run`'s; offline,
    a run is bounded by ``max_train_iter``."""
    return Run(pipeline, main_config, BCPolicy, cfg, build_dataset=BUILD_DATASET, **options).train()
