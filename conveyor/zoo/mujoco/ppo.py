"""PPO on MuJoCo (HalfCheetah-v5 by default): CleanRL's and RL Zoo's MuJoCo hyperparameters.

    conveyor train mujoco/ppo [--set env.env_id=Hopper-v5] --max-env-step 1000000 [--seed N] [--async]
    conveyor train mujoco/ppo --collectors 2 --max-env-step 1000000

Trains the on-policy family's pipeline (conveyor/zoo/on_policy.py). Hyperparameters: CleanRL's
``ppo_continuous_action.py`` (the "MuJoCo"
settings of Schulman et al. 2017, arXiv:1707.06347, and of RL Zoo's ``ppo.yml`` normalised envs): a 64-64 tanh
actor and critic, a state-independent Gaussian, 2048 steps of 1 env per rollout, 10 epochs of minibatches of
64, Adam 3e-4 annealed linearly to 0 over 1M env steps (``policy.learn.lr_anneal_steps``: set it to your
budget), gamma 0.99, GAE lambda 0.95, clip 0.2, no entropy bonus, value loss 0.5, gradient norm 0.5,
observations normalised by running statistics (clipped at 10) and rewards scaled by the running std of the
discounted return (clipped at 10), as CleanRL's NormalizeObservation / NormalizeReward and SB3's VecNormalize.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import PPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy
from conveyor.zoo.mujoco import sac

main_config = EasyDict(dict(
    exp_name="mujoco_ppo",
    seed=0,
    env=copy.deepcopy(sac.main_config.env),  # mujoco/sac's: HalfCheetah-v5, 1 env, 10 evaluation episodes
    policy=dict(
        discount_factor=0.99,
        gae_lambda=0.95,
        model=dict(action_space="gaussian", hidden_sizes=[64, 64], activation="tanh", obs_norm=True,
                   reward_norm=True),
        learn=dict(epoch_per_collect=10, batch_size=64, learning_rate=3e-4, lr_anneal_steps=1_000_000,
                   clip_ratio=0.2, entropy_coef=0.0, value_coef=0.5, grad_clip=0.5),
        collect=dict(n_sample=2048),
        eval=dict(evaluator=dict(eval_freq=3200)),  # 320 gradient steps a rollout: every 10 rollouts (20,480 steps)
    ),
))
"""The default config; every key is documented in PPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train PPO on a MuJoCo env; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, PPOPolicy, cfg, **options).train()
