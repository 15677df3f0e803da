"""Evaluation: run one pinned version of the eval policy for whole episodes and report the mean return.

Env crashes during an evaluation are bounded: a crashed episode is dropped and run again, at most
``max_crashes`` times per evaluation; one more is an :class:`EvaluationError`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from conveyor.engine import OnlineRLContext, declares, task
from conveyor.envs import agent_returns as agent_returns_of

__all__ = ["EVAL_EVENT", "EVAL_PROGRESS_EVENT", "EvaluationError", "InteractionEvaluator", "interaction_evaluator", "evaluate"]

log = logging.getLogger("conveyor.evaluator")

EVAL_EVENT = "evaluator.result"
"""Emitted with ``ctx.eval_output`` after each evaluation, also one that ends the iteration at the stop value
(the middleware after the evaluator are then not entered, so they cannot read it from the context)."""

EVAL_PROGRESS_EVENT = "evaluator.progress"
"""Emitted in this process only, after each env step of an evaluation, with ``(episodes finished, episodes asked)``:
what shows progress while a long evaluation runs (:func:`~conveyor.middleware.progress_bar`)."""


class EvaluationError(RuntimeError):
    """An evaluation gave up: its envs crashed more often than ``max_crashes`` allows."""


def evaluate(policy: Any, env: Any, n_episode: int, seed: Optional[int] = None,
             max_crashes: Optional[int] = None, on_step: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Run ``n_episode`` complete episodes of ``policy`` (an eval-mode view or a snapshot) on an env manager.

    Episodes are shared out evenly over the envs up front (env ``i`` runs ``n_episode // N`` episodes,
    one more for the first ``n_episode % N``), so short episodes do not crowd out long ones. An episode
    whose env crashes is not counted and is run again; after ``max_crashes`` crashes (default
    ``n_episode``) the next one raises :class:`EvaluationError`. Returns ``returns`` and ``lengths``
    (lists), ``mean`` and ``std`` of the returns, ``crashes`` (env crashes seen), ``dropped``
    (episodes lost to them) and ``summary``, the score as the evaluation protocol reports it:
    ``"12.3 +- 4.5 over 10 episodes (seed 7)"`` (env ``i`` is seeded ``seed + i``; Atari episodes are
    whole unclipped games). ``on_step(episodes finished)`` is called after each env step, for progress.
    On a team's envs (episodes whose info holds ``agent_r``) the returns are the team's (summed over agents) and
    ``agent_returns`` (per episode, a list over agents) and ``agent_mean`` (per agent) are added.
    """
    limit = n_episode if max_crashes is None else max_crashes
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(f"evaluate(max_crashes={max_crashes!r}): must be an int >= 0 or None")
    n = env.env_num
    quota = np.full(n, n_episode // n)
    quota[: n_episode % n] += 1
    obs = env.reset(seed=seed)
    if hasattr(policy, "reset"):
        policy.reset()
    returns: List[float] = []
    lengths: List[int] = []
    agent_returns: List[List[float]] = []
    crashes = dropped = 0
    while quota.sum() > 0:
        action = policy.forward(obs)["action"]
        ts = env.step(action)
        ended = ts.terminated | ts.truncated | ts.crashed
        if ended.any():
            ids = np.flatnonzero(ended)
            for i in ids:
                if ts.crashed[i]:
                    crashes += 1
                    dropped += int(quota[i] > 0)
                    if crashes > limit:
                        raise EvaluationError(
                            f"evaluation on {getattr(env, 'env_id', 'the envs')} gave up after {crashes} env crashes "
                            f"({dropped} episodes dropped, {len(returns)} of {n_episode} finished), more than "
                            f"max_crashes={limit} allows; last error: {ts.info[i].get('error')}. Fix the env, or "
                            f"raise max_crashes if its failures are rare")
                    continue
                episode = ts.info[i].get("episode")
                if quota[i] > 0 and episode is not None:
                    returns.append(float(episode["r"]))
                    lengths.append(int(episode["l"]))
                    agents = agent_returns_of(episode)
                    if agents is not None:
                        agent_returns.append(agents)
                    quota[i] -= 1
            if hasattr(policy, "reset"):
                policy.reset(ids.tolist())
        obs = ts.obs
        if on_step is not None:
            on_step(len(returns))
    mean, std = float(np.mean(returns)), float(np.std(returns))
    result = {"returns": returns, "lengths": lengths, "mean": mean, "std": std, "crashes": crashes,
              "dropped": dropped, "summary": f"{mean:.1f} +- {std:.1f} over {len(returns)} episodes "
                                            f"({'unseeded' if seed is None else f'seed {seed}'})"}
    if agent_returns:
        result["agent_returns"] = agent_returns
        result["agent_mean"] = np.mean(agent_returns, axis=0).tolist()
        result["summary"] = f"team {result['summary']}; per agent {', '.join(f'{r:.1f}' for r in result['agent_mean'])}"
    return result


@declares(reads=("train_iter", "env_step", "last_eval_iter"), optional=("env_step",),
          writes=("eval_value", "eval_output", "last_eval_iter", "last_eval_value"))
class InteractionEvaluator:
    """Evaluates one pinned version of the policy every ``cfg.policy.eval.evaluator.eval_freq`` train
    iterations (and first of all at the start), on ``cfg.env.n_evaluator_episode`` episodes; if
    ``eval_env_step_freq`` is set, also whenever that many env steps have passed since the last evaluation.

    The policy is pinned with ``policy.snapshot()`` (the policy itself if it has none), so the whole
    evaluation sees one version of the weights, and the snapshot goes into ``ctx.eval_output`` for the
    checkpoint saver. Once the mean return reaches ``cfg.env.stop_value`` it sets ``task.finish`` and
    ends the iteration, so nothing trains after the evaluation that scored. Each result is also emitted
    as :data:`EVAL_EVENT` (the checkpoint saver listens to it), and its progress after each env step as
    :data:`EVAL_PROGRESS_EVENT` (the progress bar shows it). Evaluation ``k`` seeds its
    envs with ``seed + 100000 + 1000 k`` (never training seeds); the count survives a resume.

    Reads ctx: ``train_iter``, ``env_step`` (when the context has it), ``last_eval_iter``.
    Writes ctx: ``eval_value`` (mean return: a team's), ``eval_output`` (``returns, lengths, mean, std, summary,
    env_step, train_iter, weight_version, crashes, dropped, snapshot, seed, stop_value_reached``, and for a team
    ``agent_returns, agent_mean``: see :func:`evaluate`), ``last_eval_iter``, ``last_eval_value``.
    """

    def __init__(self, cfg: Any, policy: Any, env: Any, *, max_crashes: Optional[int] = None) -> None:
        evaluator_cfg = cfg.policy.eval.evaluator
        self._freq = evaluator_cfg.eval_freq
        self._env_freq = evaluator_cfg.get("eval_env_step_freq")
        self._n_episode = cfg.env.n_evaluator_episode
        self._stop_value = cfg.env.get("stop_value")
        self._base_seed = (cfg.get("seed") or 0) + 100_000
        self._max_crashes = max_crashes
        self._policy = policy
        self._env = env
        self._evaluations = 0
        self._env_step = 0

    def __repr__(self) -> str:
        return f"InteractionEvaluator(eval_freq={self._freq}, n_episode={self._n_episode})"

    def state_dict(self) -> Dict[str, Any]:
        """How many evaluations ran (their seeds follow from it) and the env step of the last one."""
        return {"evaluations": self._evaluations, "env_step": self._env_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on with the evaluation schedule of :meth:`state_dict`."""
        self._evaluations = int(state["evaluations"])
        self._env_step = int(state["env_step"])

    def _progress(self, episodes: int) -> None:
        task.emit(EVAL_PROGRESS_EVENT, episodes, self._n_episode, only_local=True)

    def __call__(self, ctx: OnlineRLContext) -> None:
        env_step = getattr(ctx, "env_step", None)  # None in an offline pipeline (OfflineRLContext): no env steps
        due = ctx.last_eval_iter is None or ctx.train_iter - ctx.last_eval_iter >= self._freq
        if self._env_freq is not None and ctx.last_eval_iter is not None and env_step is not None:
            due = due or env_step - self._env_step >= self._env_freq
        if not due:
            return
        snapshot = self._policy.snapshot() if hasattr(self._policy, "snapshot") else self._policy
        seed = self._base_seed + 1000 * self._evaluations
        result = evaluate(snapshot, self._env, self._n_episode, seed=seed, max_crashes=self._max_crashes,
                          on_step=self._progress)
        if result["crashes"]:
            log.warning("evaluation at train iter %d: %d env crashes, %d episodes dropped and run again",
                        ctx.train_iter, result["crashes"], result["dropped"])
        reached = self._stop_value is not None and result["mean"] >= self._stop_value
        result.update(env_step=env_step, train_iter=ctx.train_iter, seed=seed, snapshot=snapshot,
                      stop_value_reached=reached, weight_version=getattr(snapshot, "version", None))
        self._evaluations += 1
        self._env_step = env_step or 0
        ctx.eval_value = result["mean"]
        ctx.eval_output = result
        ctx.last_eval_iter = ctx.train_iter
        ctx.last_eval_value = result["mean"]
        task.emit(EVAL_EVENT, result)
        if reached:
            task.finish = True
            task.end_iteration()


def interaction_evaluator(cfg: Any, policy: Any, env: Any, *,
                          max_crashes: Optional[int] = None) -> InteractionEvaluator:
    """The evaluator middleware (see :class:`InteractionEvaluator`)."""
    return InteractionEvaluator(cfg, policy, env, max_crashes=max_crashes)
