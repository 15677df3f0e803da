"""PPO on CartPole-v1: short rollouts from 8 envs, up to 20 full-batch epochs each, stopped early by a KL target.

    conveyor train cartpole/ppo [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import StepCollector, gae_estimator, interaction_evaluator, multistep_trainer
from conveyor.policy import PPOPolicy
from conveyor.zoo.run import Run

main_config = EasyDict(dict(
    exp_name="cartpole_ppo",
    seed=0,
    env=dict(env_id="CartPole-v1", collector_env_num=8, evaluator_env_num=10, n_evaluator_episode=10, stop_value=475.0),
    policy=dict(
        discount_factor=0.98,
        gae_lambda=0.8,
        model=dict(hidden_sizes=[64, 64]),
        learn=dict(epoch_per_collect=20, batch_size=256, learning_rate=4e-3, lr_anneal_steps=102_400, target_kl=0.03,
                   clip_ratio=0.2, entropy_coef=0.0, value_coef=1.0, grad_clip=0.5),
        collect=dict(n_sample=256),
        eval=dict(evaluator=dict(eval_freq=200)),
    ),
))
"""The default config; every key is documented in PPOPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, defaults: Optional[Mapping[str, Any]] = None,
         **options: Any) -> OnlineRLContext:
    """Train PPO on CartPole (the other PPO entries train this pipeline on their ``defaults``); returns the final
    context. ``options``: :class:`~conveyor.zoo.run.Run`'s (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    defaults = main_config if defaults is None else defaults
    with Run(main, defaults, PPOPolicy, cfg, **options) as run:
        cfg, policy = run.cfg, run.policy
        task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
        task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
        task.use(gae_estimator(cfg, policy.collect_mode), role=task.role.COLLECTOR)  # by the version that acted
        task.use(multistep_trainer(cfg, policy.learn_mode), role=task.role.LEARNER)  # locks against checkpoints
        return run.train()
