"""The on-policy pipeline the PPO zoo entries share: collect a rollout, estimate GAE advantages, train
several epochs of minibatches on it, evaluate, checkpoint."""
from __future__ import annotations

from typing import Any, List, Mapping, Optional

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware import StepCollector, gae_estimator, interaction_evaluator, multistep_trainer
from conveyor.policy import PPOPolicy
from conveyor.zoo._online import prepare, seed_everything, train_online

__all__ = ["train_ppo"]


def train_ppo(main_config: Mapping[str, Any], cfg: Optional[Mapping[str, Any]] = None, *, seed: Optional[int] = None,
              exp_name: Optional[str] = None, max_env_step: Optional[int] = None, resume: bool = False,
              async_mode: bool = False, progress: bool = True, ckpt_freq: int = 1000,
              ckpt_interval: Optional[float] = None, max_train_iter: Optional[int] = None) -> OnlineRLContext:
    """Train PPO with ``cfg`` (default ``main_config``); returns the final context.

    Each round collects ``policy.collect.n_sample`` transitions, estimates their advantages and takes
    ``learn.epoch_per_collect`` passes of ``learn.batch_size`` minibatches over them. ``latest.pth.tar``
    (the whole pipeline's state, the observation normaliser included) is written every ``ckpt_freq``
    gradient steps and every ``ckpt_interval`` seconds. Training stops at the stop value, or at ``max_env_step``
    env steps or ``max_train_iter`` gradient steps when given.
    """
    cfg = prepare(main_config, PPOPolicy, cfg, seed=seed, exp_name=exp_name, resume=resume)
    seed_everything(cfg.seed)
    policy = PPOPolicy(cfg.policy)

    def build(collection: List[Any], evaluator_env: Any) -> None:  # roles: what each node of a distributed run keeps
        task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env), role=task.role.EVALUATOR)
        for mw in collection:
            task.use(mw, role=task.role.COLLECTOR)
        task.use(multistep_trainer(cfg, policy.learn_mode), role=task.role.LEARNER)  # locks against checkpoints

    return train_online(cfg, policy, ppo_collection, build, resume=resume, async_mode=async_mode,
                        max_env_step=max_env_step, progress=progress, ckpt_freq=ckpt_freq, ckpt_interval=ckpt_interval,
                        max_train_iter=max_train_iter)


def ppo_collection(cfg: Any, policy: Any, env: Any) -> List[Any]:
    """A StepCollector, then GAE advantages by the same version of the policy; run in a collector process in
    async mode."""
    return [StepCollector(cfg, policy.collect_mode, env), gae_estimator(cfg, policy.collect_mode)]
