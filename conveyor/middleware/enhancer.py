"""Enhancers rewrite collected transitions before training: n-step returns."""
from __future__ import annotations

from typing import Any

import torch

from conveyor.data.batch import map_nested
from conveyor.engine import OnlineRLContext

__all__ = ["nstep_reward_enhancer", "nstep_returns"]


def nstep_returns(batch: Any, gamma: float, nstep: int) -> Any:
    """n-step returns over a time-major batch ``[T, N]``, in place; returns the batch.

    Each transition's window runs ``m <= nstep`` steps forward and stops after an episode end
    (terminated or truncated) or at the end of the batch. Then ``reward`` is the discounted sum over the
    window, ``next_obs`` / ``terminated`` / ``truncated`` are those of the window's last step, and
    ``discount = gamma ** m`` is the factor for the bootstrap value. A window ending in truncation
    still bootstraps from the final observation; only termination stops it.
    """
    reward, terminated, truncated = batch.reward, batch.terminated, batch.truncated
    if reward.ndim != 2:
        raise ValueError(f"nstep_returns needs a time-major batch [T, N]; got reward of shape {tuple(reward.shape)}")
    steps, n_env = reward.shape
    done = terminated | truncated
    total = reward.clone()
    last = torch.arange(steps).unsqueeze(1).expand(steps, n_env).clone()
    extending = ~done
    for k in range(1, min(nstep, steps)):
        can = extending[: steps - k]
        total[: steps - k] += can * (gamma ** k) * reward[k:]
        last[: steps - k] = torch.where(can, last[: steps - k] + 1, last[: steps - k])
        extending[: steps - k] = can & ~done[k:]
        extending[steps - k:] = False
    length = last - torch.arange(steps).unsqueeze(1) + 1
    env = torch.arange(n_env).unsqueeze(0).expand(steps, n_env)
    batch.reward = total
    batch.discount = (gamma ** length.float()).float()
    batch.terminated = terminated[last, env]
    batch.truncated = truncated[last, env]
    batch.next_obs = _gather_tree(batch.next_obs, last, env)
    return batch


def _gather_tree(obs: Any, t: torch.Tensor, env: torch.Tensor) -> Any:
    if isinstance(obs, torch.Tensor) and not hasattr(obs, "items"):
        return obs[t, env]
    return type(obs)(map_nested(lambda leaf: leaf[t, env], {k: v for k, v in obs.items()}))


def nstep_reward_enhancer(cfg: Any):
    """Turns one-step transitions into ``cfg.policy.nstep``-step ones (see :func:`nstep_returns`).

    Reads ctx: ``trajectories`` (time-major ``[T, N]``, from ``StepCollector``).
    Writes ctx: ``trajectories`` with n-step ``reward``, ``next_obs``, ``terminated``, ``truncated`` and ``discount``.
    """
    gamma, nstep = cfg.policy.discount_factor, cfg.policy.nstep
    if not isinstance(nstep, int) or nstep < 1:
        raise ValueError(f"cfg.policy.nstep must be an int >= 1, got {nstep!r}")

    def _nstep(ctx: OnlineRLContext) -> None:
        if ctx.trajectories is not None:
            nstep_returns(ctx.trajectories, gamma, nstep)

    return _nstep
