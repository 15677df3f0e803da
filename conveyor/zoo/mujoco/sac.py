"""SAC on MuJoCo (HalfCheetah-v5 by default): the SAC paper's and RL Zoo's hyperparameters.

    conveyor train mujoco/sac [--set env.env_id=Hopper-v5] --max-env-step 1000000 [--seed N] [--async]
    conveyor train mujoco/sac --collectors 2 --max-env-step 1000000

Trains the off-policy family's pipeline (conveyor/zoo/off_policy.py). Hyperparameters: Haarnoja et al. 2018
(arXiv:1812.05905, table 1) as
Stable-Baselines3's RL Zoo runs them (``hyperparams/sac.yml``): 256-256 networks, Adam 3e-4, batch 256,
tau 0.005, gamma 0.99, one gradient step per env step, a learned temperature aiming at -dim(A), a 1M replay
and 10,000 uniformly random env steps before learning starts.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import SACPolicy
from conveyor.run import Run
from conveyor.zoo import off_policy

main_config = EasyDict(dict(
    exp_name="mujoco_sac",
    seed=0,
    # One env, as the paper and SB3; the evaluation is 10 deterministic episodes stepped in lock step.
    env=dict(env_id="HalfCheetah-v5", collector_env_num=1, evaluator_env_num=10, n_evaluator_episode=10,
             stop_value=None),
    policy=dict(
        discount_factor=0.99,
        model=dict(hidden_sizes=[256, 256]),
        # update_per_collect == n_sample: one gradient step per env step, in rounds of 8 (less pipeline overhead).
        learn=dict(batch_size=256, learning_rate=3e-4, update_per_collect=8, learning_starts=10_000,
                   target_theta=0.005, auto_alpha=True, alpha=1.0),
        collect=dict(n_sample=8, random_collect_size=10_000),
        eval=dict(evaluator=dict(eval_freq=10_000)),
        # 1M transitions: ~180 MB of float32 on HalfCheetah (obs 17, action 6), ~2.8 GB on Humanoid (obs 348).
        other=dict(replay_buffer=dict(size=1_000_000)),
    ),
))
"""The default config; every key is documented in SACPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = off_policy.actor_critic
"""What this entry trains: the off-policy family's pipeline, ``conveyor/zoo/off_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, record: Optional[Any] = None, **options: Any) -> OnlineRLContext:
    """Train SAC on a MuJoCo env; ``record``: a :class:`~conveyor.data.DatasetWriter` that receives every whole episode
    the run collects (``conveyor collect --d4rl``; one process only); returns the final context. ``options``:
    :class:`~conveyor.run.Run`'s (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(off_policy.recording(pipeline, record, options.get("async_mode", False)), main_config, SACPolicy, cfg,
               ckpt_freq=5000, **options).train()
