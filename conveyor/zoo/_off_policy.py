"""The off-policy pipeline DQN and SAC zoo entries share: explore, collect, n-step, replay, learn, evaluate, save."""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Type

from conveyor.data import DequeBuffer
from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import (OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler,
                                 interaction_evaluator, nstep_reward_enhancer)
from conveyor.zoo._online import prepare, seed_everything, train_online

__all__ = ["train_off_policy"]


def train_off_policy(main_config: Mapping[str, Any], policy_cls: Type[Any], cfg: Optional[Mapping[str, Any]] = None,
                     *, seed: Optional[int] = None, exp_name: Optional[str] = None, max_env_step: Optional[int] = None,
                     resume: bool = False, async_mode: bool = False, progress: bool = True,
                     ckpt_freq: int = 1000, ckpt_interval: Optional[float] = None,
                     max_train_iter: Optional[int] = None) -> OnlineRLContext:
    """Train an off-policy algorithm with ``cfg`` (default ``main_config``); returns the final context.

    Exploration is eps-greedy when the config has ``policy.other.eps`` (DQN), and uniformly random
    actions for the first ``policy.collect.random_collect_size`` env steps when it has that (SAC).
    ``latest.pth.tar`` (the whole pipeline's state, replay buffer included) is written every
    ``ckpt_freq`` gradient steps and every ``ckpt_interval`` seconds. Training stops at the stop value, or at
    ``max_env_step`` env steps or ``max_train_iter`` gradient steps when given.
    """
    cfg = prepare(main_config, policy_cls, cfg, seed=seed, exp_name=exp_name, resume=resume)
    seed_everything(cfg.seed)
    policy = policy_cls(cfg.policy)
    replay = cfg.policy.other.replay_buffer
    buffer_ = DequeBuffer(replay.size, prioritized=replay.prioritized, alpha=replay.alpha, beta=replay.beta,
                          beta_end=replay.beta_end, beta_anneal_steps=replay.beta_anneal_steps, seed=cfg.seed)

    def build(collection: List[Any], evaluator_env: Any) -> None:  # roles: what each node of a distributed run keeps
        task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env), role=task.role.EVALUATOR)
        if "eps" in cfg.policy.other:
            task.use(eps_greedy_handler(cfg), role=task.role.COLLECTOR)
        for mw in collection:
            task.use(mw, role=task.role.COLLECTOR)
        task.use(data_pusher(cfg, buffer_), role=task.role.LEARNER)
        task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer_), role=task.role.LEARNER)  # both lock internally

    return train_online(cfg, policy, off_policy_collection, build, buffer=buffer_, resume=resume,
                        async_mode=async_mode, max_env_step=max_env_step, progress=progress, ckpt_freq=ckpt_freq,
                        ckpt_interval=ckpt_interval, max_train_iter=max_train_iter)


def off_policy_collection(cfg: Any, policy: Any, env: Any) -> List[Any]:
    """A StepCollector (random actions for the first ``policy.collect.random_collect_size`` env steps), then
    the n-step enhancer when ``policy.nstep > 1``; run in a collector process in async mode."""
    stage = [StepCollector(cfg, policy.collect_mode, env,
                           random_collect_size=cfg.policy.collect.get("random_collect_size", 0))]
    if cfg.policy.nstep > 1:
        stage.append(nstep_reward_enhancer(cfg))
    return stage
