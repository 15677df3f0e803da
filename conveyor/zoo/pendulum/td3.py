"""TD3 on Pendulum-v1: clipped double Q, delayed actor updates, target smoothing; trains the pipeline of
pendulum/sac with TD3Policy.

    conveyor train pendulum/td3 [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import TD3Policy
from conveyor.run import Run
from conveyor.zoo import off_policy
from conveyor.zoo.pendulum import sac

main_config = EasyDict(dict(
    exp_name="pendulum_td3",
    seed=0,
    env=copy.deepcopy(sac.main_config.env),  # pendulum/sac's envs, evaluation and stop value
    policy=dict(
        **copy.deepcopy({key: sac.main_config.policy[key] for key in ("discount_factor", "model", "eval", "other")}),
        learn=dict(batch_size=256, learning_rate=1e-3, update_per_collect=8, learning_starts=1000,
                   target_theta=0.005, policy_delay=2, target_noise=0.2, noise_clip=0.5),
        collect=dict(n_sample=8, random_collect_size=1000, exploration_noise=0.1),
    ),
))
"""The default config; every key is documented in TD3Policy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = off_policy.actor_critic
"""What this entry trains: the off-policy family's pipeline, ``conveyor/zoo/off_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, record: Optional[Any] = None, **options: Any) -> OnlineRLContext:
    """Train TD3 on Pendulum; ``record``: a :class:`~conveyor.data.DatasetWriter` that receives every whole episode the
    run collects (``conveyor collect --d4rl``; one process only); returns the final context. ``options``:
    :class:`~conveyor.run.Run`'s (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(off_policy.recording(pipeline, record, options.get("async_mode", False)), main_config, TD3Policy, cfg,
               ckpt_freq=5000, **options).train()
