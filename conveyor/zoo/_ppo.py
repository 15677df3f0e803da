"""The on-policy pipeline the PPO zoo entries share: collect a rollout, estimate GAE advantages, train
several epochs of minibatches on it, evaluate, checkpoint."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import CkptSaver, StepCollector, gae_estimator, interaction_evaluator, multistep_trainer
from conveyor.policy import PPOPolicy
from conveyor.zoo._online import (env_managers, experiment_dir, prepare, resume_into, seed_everything,
                                  use_reporting)

__all__ = ["train_ppo"]


def train_ppo(main_config: Mapping[str, Any], cfg: Optional[Mapping[str, Any]] = None, *, seed: Optional[int] = None,
              exp_name: Optional[str] = None, max_env_step: Optional[int] = None, resume: bool = False,
              async_mode: bool = False, progress: bool = True, ckpt_freq: int = 1000) -> OnlineRLContext:
    """Train PPO with ``cfg`` (default ``main_config``); returns the final context.

    Each round collects ``policy.collect.n_sample`` transitions, estimates their advantages and takes
    ``learn.epoch_per_collect`` passes of ``learn.batch_size`` minibatches over them. ``latest.pth.tar``
    is written every ``ckpt_freq`` gradient steps (it holds the observation normaliser too, so
    ``resume=True`` goes on with the same statistics).
    """
    cfg = prepare(main_config, PPOPolicy, cfg, seed=seed, exp_name=exp_name)
    seed_everything(cfg.seed)
    exp_dir = experiment_dir(cfg)
    policy = PPOPolicy(cfg.policy)
    ctx = OnlineRLContext()
    if resume:
        resume_into(cfg, policy, ctx)
    with env_managers(cfg) as (collector_env, evaluator_env):
        with task.start(async_mode=async_mode, ctx=ctx):
            task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
            task.use(StepCollector(cfg, policy.collect_mode, collector_env))
            task.use(gae_estimator(cfg, policy.collect_mode))
            task.use(multistep_trainer(cfg, policy.learn_mode))  # the policy locks its updates against checkpoints
            task.use(CkptSaver(policy, exp_dir, train_freq=ckpt_freq))
            use_reporting(cfg, max_env_step, progress)
            task.run()
            return task.ctx
