"""TD3 on MuJoCo (HalfCheetah-v5 by default): the TD3 paper's and CleanRL's hyperparameters.

    conveyor train mujoco/td3 [--set env.env_id=Hopper-v5] --max-env-step 1000000 [--seed N] [--async]
    conveyor train mujoco/td3 --collectors 2 --max-env-step 1000000

Trains the off-policy family's pipeline (conveyor/zoo/off_policy.py) with TD3Policy. Hyperparameters: Fujimoto et
al. 2018 (arXiv:1802.09477) as CleanRL's ``td3_continuous_action.py`` runs them: 256-256 networks, Adam 3e-4, batch
256, tau 0.005, gamma 0.99, actor and targets updated every 2nd critic step, target noise 0.2 clipped at 0.5,
exploration noise 0.1, a 1M replay and 25,000 uniformly random env steps before learning starts.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import TD3Policy
from conveyor.run import Run
from conveyor.zoo import off_policy
from conveyor.zoo.mujoco import sac as mujoco_sac

main_config = EasyDict(dict(
    exp_name="mujoco_td3",
    seed=0,
    env=copy.deepcopy(mujoco_sac.main_config.env),  # mujoco/sac's env, evaluation and no stop value
    policy=dict(
        **copy.deepcopy({key: mujoco_sac.main_config.policy[key]
                         for key in ("discount_factor", "model", "eval", "other")}),
        learn=dict(batch_size=256, learning_rate=3e-4, update_per_collect=8, learning_starts=25_000,
                   target_theta=0.005, policy_delay=2, target_noise=0.2, noise_clip=0.5),
        collect=dict(n_sample=8, random_collect_size=25_000, exploration_noise=0.1),
    ),
))
"""The default config; every key is documented in TD3Policy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = off_policy.actor_critic
"""What this entry trains: the off-policy family's pipeline, ``conveyor/zoo/off_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, record: Optional[Any] = None, **options: Any) -> OnlineRLContext:
    """Train TD3 on a MuJoCo env; ``record``: a :class:`~conveyor.data.DatasetWriter` that receives every whole episode
    the run collects (``conveyor collect --d4rl``; one process only); returns the final context. ``options``:
    :class:`~conveyor.run.Run`'s (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(off_policy.recording(pipeline, record, options.get("async_mode", False)), main_config, TD3Policy, cfg,
               ckpt_freq=5000, **options).train()
