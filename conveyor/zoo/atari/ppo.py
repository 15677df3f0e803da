"""PPO on Atari (ALE/Breakout-v5 by default): CleanRL's and RL Zoo's Atari hyperparameters, Nature CNN.

    conveyor train atari/ppo [--set env.env_id=ALE/Pong-v5] --max-env-step 10000000 [--seed N] [--async]
    conveyor train atari/ppo --collectors 2 --max-env-step 10000000

Trains the on-policy family's pipeline (conveyor/zoo/on_policy.py). Hyperparameters: CleanRL's ``ppo_atari.py`` and
RL Zoo's ``ppo.yml`` (atari), after Schulman et al. 2017 (arXiv:1707.06347, table 5): the Nature CNN shared by actor
and critic, 8 envs x 128 steps per rollout, 4 epochs of 4 minibatches (256 transitions), Adam 2.5e-4 annealed
linearly to 0 over 10M agent steps, gamma 0.99, GAE lambda 0.95, clip 0.1, entropy 0.01, value loss 0.5, gradient
norm 0.5. The envs (atari/dqn's too) end a training episode at each lost life, clip training rewards to their sign
and press FIRE at each game start and after each lost life (the references' FireResetEnv: a greedy policy that never
fires would stall an evaluation until the 108,000-frame limit).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import PPOPolicy
from conveyor.run import Run
from conveyor.zoo import on_policy

main_config = EasyDict(dict(
    exp_name="atari_ppo",
    seed=0,
    env=dict(env_id="ALE/Breakout-v5", collector_env_num=8, evaluator_env_num=8, n_evaluator_episode=8,
             stop_value=None, atari=dict(terminal_on_life_loss=True, clip_reward=True, fire_reset=True)),
    policy=dict(
        discount_factor=0.99,
        gae_lambda=0.95,
        model=dict(encoder="nature", share_encoder=True),
        learn=dict(epoch_per_collect=4, batch_size=256, learning_rate=2.5e-4, lr_anneal_steps=10_000_000,
                   clip_ratio=0.1, entropy_coef=0.01, value_coef=0.5, grad_clip=0.5),
        collect=dict(n_sample=1024),
        eval=dict(evaluator=dict(eval_freq=1600)),  # 16 gradient steps a rollout: every 100 rollouts (102,400 steps)
    ),
))
"""The default config; every key is documented in PPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = on_policy.pipeline
"""What this entry trains: the on-policy family's pipeline, ``conveyor/zoo/on_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train PPO on an Atari game; returns the final context. ``options``: :class:`~conveyor.run.Run`'s (``seed``,
    ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, PPOPolicy, cfg, **options).train()
