"""Evaluation: run the eval policy for whole episodes and report the mean return."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from conveyor.engine import OnlineRLContext, task

__all__ = ["interaction_evaluator", "evaluate"]


def evaluate(policy: Any, env: Any, n_episode: int, seed: Optional[int] = None) -> Dict[str, Any]:
    """Run ``n_episode`` complete episodes of ``policy`` (an eval-mode view) on an env manager.

    Episodes are shared out evenly over the envs up front (env ``i`` runs ``n_episode // N`` episodes,
    one more for the first ``n_episode % N``), so short episodes do not crowd out long ones. An episode
    whose env crashes is not counted and is run again. Returns ``returns`` and ``lengths`` (lists),
    ``mean`` and ``std`` of the returns.
    """
    n = env.env_num
    quota = np.full(n, n_episode // n)
    quota[: n_episode % n] += 1
    obs = env.reset(seed=seed)
    if hasattr(policy, "reset"):
        policy.reset()
    returns: List[float] = []
    lengths: List[int] = []
    while quota.sum() > 0:
        action = policy.forward(obs)["action"]
        ts = env.step(action)
        ended = ts.terminated | ts.truncated | ts.crashed
        if ended.any():
            ids = np.flatnonzero(ended)
            for i in ids:
                episode = ts.info[i].get("episode")
                if quota[i] > 0 and not ts.crashed[i] and episode is not None:
                    returns.append(float(episode["r"]))
                    lengths.append(int(episode["l"]))
                    quota[i] -= 1
            if hasattr(policy, "reset"):
                policy.reset(ids.tolist())
        obs = ts.obs
    return {"returns": returns, "lengths": lengths, "mean": float(np.mean(returns)), "std": float(np.std(returns))}


def interaction_evaluator(cfg: Any, policy: Any, env: Any):
    """Evaluates the policy every ``cfg.policy.eval.evaluator.eval_freq`` train iterations (and first of
    all at the start), on ``cfg.env.n_evaluator_episode`` episodes; sets ``task.finish`` once the mean
    return reaches ``cfg.env.stop_value``. If ``eval_env_step_freq`` is set, it also evaluates
    whenever that many env steps have passed since the last evaluation.

    Reads ctx: ``train_iter``, ``env_step``, ``last_eval_iter``.
    Writes ctx: ``eval_value`` (mean return), ``eval_output`` (returns, lengths, mean, std, and the
    ``env_step`` / ``train_iter`` it was taken at),
    ``last_eval_iter``, ``last_eval_value``.
    """
    evaluator_cfg = cfg.policy.eval.evaluator
    freq = evaluator_cfg.eval_freq
    env_freq = evaluator_cfg.get("eval_env_step_freq")
    n_episode = cfg.env.n_evaluator_episode
    stop_value = cfg.env.get("stop_value")
    base_seed = (cfg.get("seed") or 0) + 100_000  # evaluation episodes never replay training seeds
    state = {"evaluations": 0, "env_step": 0}

    def _evaluate(ctx: OnlineRLContext) -> None:
        due = ctx.last_eval_iter is None or ctx.train_iter - ctx.last_eval_iter >= freq
        if env_freq is not None and ctx.last_eval_iter is not None:
            due = due or ctx.env_step - state["env_step"] >= env_freq
        if not due:
            return
        result = evaluate(policy, env, n_episode, seed=base_seed + 1000 * state["evaluations"])
        result.update(env_step=ctx.env_step, train_iter=ctx.train_iter)
        state["evaluations"] += 1
        state["env_step"] = ctx.env_step
        ctx.eval_value = result["mean"]
        ctx.eval_output = result
        ctx.last_eval_iter = ctx.train_iter
        ctx.last_eval_value = result["mean"]
        if stop_value is not None and result["mean"] >= stop_value:
            task.finish = True

    return _evaluate
