"""DQN on Atari (ALE/Breakout-v5 by default): double, dueling, 3-step returns, prioritized replay, Nature CNN.

    conveyor train atari/dqn [--set env.env_id=ALE/Pong-v5] --max-env-step 10000000 [--seed N] [--async]
    conveyor train atari/dqn --collectors 2 --max-env-step 10000000

Trains the off-policy family's q_learning pipeline (conveyor/zoo/off_policy.py). Hyperparameters: CleanRL's
``dqn_atari.py`` (Mnih et al. 2015's Nature
DQN with Adam): Adam 1e-4, batch 32, a gradient step every 4 agent steps, the target network copied every
1000 agent steps, a 1M replay, 80,000 agent steps before learning, epsilon from 1.0 to 0.01 over the first
1M agent steps (10% of 10M), evaluation with epsilon 0.05; with the Rainbow components of Hessel et al. 2018 that the issue asks for:
double Q-learning, a dueling head, 3-step returns and prioritized replay (alpha 0.5, beta 0.4 to 1).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import DQNPolicy
from conveyor.run import Run
from conveyor.zoo import off_policy
from conveyor.zoo.atari import ppo

main_config = EasyDict(dict(
    exp_name="atari_dqn",
    seed=0,
    env=copy.deepcopy(ppo.main_config.env),  # atari/ppo's: Breakout, 8 envs, life loss ends training episodes
    policy=dict(
        discount_factor=0.99,
        nstep=3,
        model=dict(encoder="nature", dueling=True),
        # update_per_collect = n_sample / 4: one gradient step per 4 agent steps; 250 of them are 1000 agent steps.
        learn=dict(batch_size=32, learning_rate=1e-4, update_per_collect=8, learning_starts=80_000, double=True,
                   target_update_freq=250, grad_clip=10.0),
        collect=dict(n_sample=32),
        eval=dict(eps=0.05, evaluator=dict(eval_freq=25_000)),  # every 100,000 agent steps, eps-greedy as in Nature
        other=dict(
            eps=dict(kind="linear", start=1.0, end=0.01, decay=1_000_000),
            # 1M transitions: ~7 GB with each frame stored once (frame_stack "auto"), ~28 GB without.
            replay_buffer=dict(size=1_000_000, prioritized=True, alpha=0.5, beta=0.4, beta_end=1.0,
                               beta_anneal_steps=10_000_000, frame_stack="auto"),
        ),
    ),
))
"""The default config; every key is documented in DQNPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = off_policy.q_learning
"""What this entry trains: the off-policy family's pipeline, ``conveyor/zoo/off_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train DQN on an Atari game; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, DQNPolicy, cfg, **options).train()
