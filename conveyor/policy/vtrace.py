"""V-trace (Espeholt et al. 2018, "IMPALA"): value targets and policy-gradient advantages for trajectories acted by
an older ("behaviour") policy, corrected towards the one being learned ("target") by clipped importance weights.

For one time-major trajectory of ``T`` steps (vectorised over trailing dims), with ``ratio[t] = pi(a|x) / mu(a|x)``
(target over behaviour probability of the action taken), ``rho[t] = min(rho_bar, ratio[t])`` and
``c[t] = min(c_bar, ratio[t])``::

    delta[t] = rho[t] * (r[t] + discount[t] * next_value[t] - value[t])
    acc[t]   = delta[t] + discount[t] * c[t] * (1 - done[t]) * acc[t + 1]          (acc[T] = 0)
    vs[t]    = value[t] + acc[t]
    vs'[t]   = next_value[t] + (1 - done[t]) * acc[t + 1]                        (the target after step t)
    pg_adv[t] = rho[t] * (r[t] + discount[t] * vs'[t] - value[t])

``next_value[t]`` is the value of the state after step ``t``: ``value[t + 1]`` inside an episode, the bootstrap
value after the last step (the paper's ``V(x_s+n)``), and the value of the true final observation where an episode
was truncated. ``discount[t]`` is ``gamma``, or 0 where the episode terminated (then ``next_value`` is not read).
``done[t]`` cuts the trace after a step whose successor belongs to another episode though ``discount`` is not 0
(a truncation, or an env that restarted): ``vs'`` is then that step's own ``next_value``. With ``rho_bar = c_bar
= 1`` and on-policy data (``ratio = 1``) ``vs`` is the n-step bootstrapped return to the end of the trajectory
(or of the episode), and ``rho_bar`` bounds the fixed point of the value (``rho_bar`` -> infinity: the target
policy's value), ``c_bar`` only the speed of convergence, as the paper's section 4 explains.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["vtrace", "VTrace"]


class VTrace(NamedTuple):
    """What :func:`vtrace` returns, each shaped like its ``reward`` (no gradient flows through any)."""

    vs: torch.Tensor
    """Value targets ``v_s`` of each step's state."""
    pg_advantage: torch.Tensor
    """Policy-gradient advantages ``rho_s * (r_s + gamma * v_s+1 - V(x_s))``."""
    rho: torch.Tensor
    """The clipped importance weights ``min(rho_bar, pi / mu)``."""


def vtrace(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, reward: torch.Tensor, value: torch.Tensor,
           next_value: torch.Tensor, discount: torch.Tensor, done: Optional[torch.Tensor] = None, *,
           rho_bar: Optional[float] = 1.0, c_bar: Optional[float] = 1.0) -> VTrace:
    """V-trace targets of time-major trajectories ``[T, ...]`` (see the module docstring for the recursion).

    ``behaviour_logp`` / ``target_logp``: log-probabilities of the actions taken under the acting and the learned
    policy. ``value``: ``V(x_t)``; ``next_value``: the value of the state after each step (for one unroll inside
    an episode ``torch.cat([value[1:], bootstrap_value[None]])``). ``discount``: ``gamma``, 0 where an episode
    terminated. ``done`` (optional, bool): the step's successor is not the next row's state (a truncated episode,
    where ``discount`` stays ``gamma``). ``rho_bar`` / ``c_bar``: clip thresholds of the importance weights
    (``None``: unclipped); the paper's experiments use 1 and 1. Computed without gradient.
    """
    shape = reward.shape
    for name, tensor in (("behaviour_logp", behaviour_logp), ("target_logp", target_logp), ("value", value),
                         ("next_value", next_value), ("discount", discount), ("done", done)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"vtrace: {name} has shape {tuple(tensor.shape)}, reward {tuple(shape)}: every input "
                             f"is one value per step, time-major [T, ...]")
    for name, bar in (("rho_bar", rho_bar), ("c_bar", c_bar)):
        if bar is not None and not bar > 0:
            raise ValueError(f"vtrace: {name} must be > 0 (or None: unclipped), got {bar!r}")
    with torch.no_grad():
        ratio = (target_logp - behaviour_logp).exp()
        rho = ratio if rho_bar is None else ratio.clamp(max=rho_bar)
        c = ratio if c_bar is None else ratio.clamp(max=c_bar)
        go_on = discount if done is None else discount * (~done.bool()).to(discount.dtype)
        delta = rho * (reward + discount * next_value - value)
        carry = go_on * c
        acc = torch.empty_like(delta)
        after = torch.zeros_like(delta)  # acc[t + 1], cut where the trace is cut
        last = torch.zeros_like(delta[0])
        for t in range(shape[0] - 1, -1, -1):
            after[t] = last if done is None else last * (~done[t].bool()).to(last.dtype)
            last = delta[t] + carry[t] * last
            acc[t] = last
        vs = value + acc
        vs_next = next_value + after
        pg_advantage = rho * (reward + discount * vs_next - value)
    return VTrace(vs, pg_advantage, rho)
