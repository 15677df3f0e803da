"""The off-policy pipeline SAC zoo entries share: random warm-up, replay, SAC updates, evaluation, checkpoints."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from conveyor.data import DequeBuffer
from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import (CkptSaver, OffPolicyLearner, StepCollector, data_pusher, interaction_evaluator,
                                 nstep_reward_enhancer, online_logger, progress_bar, termination_checker)
from conveyor.policy.sac import SACPolicy
from conveyor.zoo._online import env_managers, experiment_dir, prepare, resume_into, seed_everything

__all__ = ["train_sac"]


def train_sac(main_config: Mapping[str, Any], cfg: Optional[Mapping[str, Any]] = None, *, seed: Optional[int] = None,
              exp_name: Optional[str] = None, max_env_step: Optional[int] = None, resume: bool = False,
              async_mode: bool = False, progress: bool = True, ckpt_freq: int = 5000) -> OnlineRLContext:
    """Train SAC with ``cfg`` (default ``main_config``); returns the final context.

    The collector acts uniformly at random for the first ``policy.collect.random_collect_size`` env
    steps, then samples from the policy; every round pushes ``collect.n_sample`` transitions and takes
    ``learn.update_per_collect`` gradient steps once the buffer holds ``learn.learning_starts``.
    """
    cfg = prepare(main_config, SACPolicy, cfg, seed=seed, exp_name=exp_name)
    seed_everything(cfg.seed)
    exp_dir = experiment_dir(cfg)
    policy = SACPolicy(cfg.policy)
    replay = cfg.policy.other.replay_buffer
    buffer_ = DequeBuffer(replay.size, prioritized=replay.prioritized, alpha=replay.alpha, beta=replay.beta,
                          seed=cfg.seed)
    ctx = OnlineRLContext()
    if resume:
        resume_into(cfg, policy, ctx, buffer_)
    with env_managers(cfg) as (collector_env, evaluator_env):
        # StepCollector draws its warm-up actions from the action space: seed it, or runs differ.
        collector_env.action_space.seed(cfg.seed)
        with task.start(async_mode=async_mode, ctx=ctx):
            task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
            task.use(StepCollector(cfg, policy.collect_mode, collector_env,
                                   random_collect_size=cfg.policy.collect.random_collect_size))
            if cfg.policy.nstep > 1:
                task.use(nstep_reward_enhancer(cfg))
            task.use(data_pusher(cfg, buffer_))
            task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer_), lock=True)
            task.use(CkptSaver(policy, exp_dir, train_freq=ckpt_freq, buffer=buffer_), lock=True)
            task.use(online_logger(str(exp_dir / "tb")))
            if max_env_step is not None:
                task.use(termination_checker(max_env_step=max_env_step))
            if progress:
                task.use(progress_bar(max_env_step))
            task.run()
            return task.ctx
