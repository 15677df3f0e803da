"""The off-policy pipeline DQN and SAC zoo entries share: explore, collect, n-step, replay, learn, evaluate, save."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Type

from conveyor.data import DequeBuffer
from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import (CkptSaver, OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler,
                                 interaction_evaluator, nstep_reward_enhancer)
from conveyor.zoo._online import (env_managers, experiment_dir, prepare, resume_into, seed_everything,
                                  use_reporting)

__all__ = ["train_off_policy"]


def train_off_policy(main_config: Mapping[str, Any], policy_cls: Type[Any], cfg: Optional[Mapping[str, Any]] = None,
                     *, seed: Optional[int] = None, exp_name: Optional[str] = None, max_env_step: Optional[int] = None,
                     resume: bool = False, async_mode: bool = False, progress: bool = True,
                     ckpt_freq: int = 1000) -> OnlineRLContext:
    """Train an off-policy algorithm with ``cfg`` (default ``main_config``); returns the final context.

    Exploration is eps-greedy when the config has ``policy.other.eps`` (DQN), and uniformly random
    actions for the first ``policy.collect.random_collect_size`` env steps when it has that (SAC).
    ``latest.pth.tar`` (with the replay buffer) is written every ``ckpt_freq`` gradient steps.
    """
    cfg = prepare(main_config, policy_cls, cfg, seed=seed, exp_name=exp_name)
    seed_everything(cfg.seed)
    exp_dir = experiment_dir(cfg)
    policy = policy_cls(cfg.policy)
    replay = cfg.policy.other.replay_buffer
    buffer_ = DequeBuffer(replay.size, prioritized=replay.prioritized, alpha=replay.alpha, beta=replay.beta,
                          beta_end=replay.beta_end, beta_anneal_steps=replay.beta_anneal_steps, seed=cfg.seed)
    ctx = OnlineRLContext()
    if resume:
        resume_into(cfg, policy, ctx, buffer_)
    with env_managers(cfg) as (collector_env, evaluator_env):
        with task.start(async_mode=async_mode, ctx=ctx):
            task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
            if "eps" in cfg.policy.other:
                task.use(eps_greedy_handler(cfg))
            task.use(StepCollector(cfg, policy.collect_mode, collector_env,
                                   random_collect_size=cfg.policy.collect.get("random_collect_size", 0)))
            if cfg.policy.nstep > 1:
                task.use(nstep_reward_enhancer(cfg))
            task.use(data_pusher(cfg, buffer_))
            task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer_))  # policy and buffer lock internally
            task.use(CkptSaver(policy, exp_dir, train_freq=ckpt_freq, buffer=buffer_))
            use_reporting(cfg, max_env_step, progress)
            task.run()
            return task.ctx
