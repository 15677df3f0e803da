"""Advantage estimation for on-policy learning: GAE(lambda) over the collector's time-major trajectories."""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch
import treetensor.torch as ttorch
import treevalue

from conveyor.data.batch import flatten_batch
from conveyor.engine import OnlineRLContext, declares
from conveyor.middleware.protocols import Buffer, ValuePolicy
from conveyor.policy.marl_model import bootstrap_agent_mask

__all__ = ["gae_estimator", "generalized_advantage"]

# Keys a learner never reads again once advantages are estimated: dropping them halves minibatch gathers.
_CONSUMED = ("next_obs", "next_hidden", "valid")


def generalized_advantage(reward: np.ndarray, value: np.ndarray, next_value: np.ndarray, done: np.ndarray,
                          gamma: float, gae_lambda: float, mask: Optional[np.ndarray] = None) -> np.ndarray:
    """GAE(lambda) advantages of time-major arrays ``[T, ...]`` (vectorised over the trailing dims).

    ``next_value[t]`` is the value of transition ``t``'s next state (0 where the episode terminated);
    ``done[t]`` marks the last transition of an episode (terminated or truncated), where the sum of
    discounted TD errors restarts::

        delta[t] = reward[t] + gamma * next_value[t] - value[t]
        adv[t]   = delta[t] + gamma * lambda * (1 - done[t]) * adv[t + 1]

    A team's arrays have an agent axis after the env's: ``reward``, ``value``, ``next_value`` ``[T, N, A]`` with
    ``done`` per env ``[T, N]`` (broadcast over the agents). ``mask`` (``[T, N, A]``, bool: the agent mask) marks
    the steps that count: elsewhere (an agent that has left) the advantage is 0 and nothing carries through, and
    an agent present at ``t`` but not at ``t + 1`` of the same episode left after step ``t``: its ``next_value``
    there is taken as 0, as at a termination. For the chunk's last step, set ``next_value`` to 0 where the agent
    is absent from the next observation.
    """
    done = done.reshape(done.shape + (1,) * (np.ndim(reward) - np.ndim(done)))
    if mask is not None:
        mask = np.asarray(mask, bool)
        left = np.zeros_like(mask)
        left[:-1] = mask[:-1] & ~mask[1:] & ~done[:-1]
        next_value = next_value * ~left
    delta = reward + gamma * next_value - value
    carry = gamma * gae_lambda * (1.0 - done.astype(np.float32))
    adv = np.empty_like(delta)
    last = np.zeros_like(delta[0])
    for t in range(len(delta) - 1, -1, -1):
        last = delta[t] + carry[t] * last
        if mask is not None:
            last = last * mask[t]
        adv[t] = last
    return adv


@declares(reads=("trajectories",), writes=("train_data",), factory=True)
def gae_estimator(cfg: Any, policy: ValuePolicy, buffer: Optional[Buffer] = None):
    """GAE(``cfg.policy.gae_lambda``) advantages and returns for the trajectories the collector just gathered.

    ``ctx.trajectories`` is time-major ``[T, N]`` (:class:`StepCollector`; whole episodes end to end,
    ``[T]``, from :class:`EpisodeCollector` work too), with the policy's ``value`` of each ``obs``
    (computed with ``policy.value`` when absent). Rewards go through ``policy.scale_reward`` first where the
    view has it (PPO's ``reward_norm`` scales them, and its discounted returns go into the batch as
    ``discounted_return`` for the learner's statistics; the ``reward`` written stays raw). The value of each
    transition's next state is the next row's ``value`` inside an episode, ``policy.value(next_obs)`` where
    the trajectory was cut short (a truncated episode, whose ``next_obs`` is the true final observation, and
    the end of the chunk, whose episodes go on in the next call), and zero where the episode terminated. Rows with ``valid == False``
    (crashed env steps) take no part and are dropped. ``return = adv + value``.

    A team's trajectories (MAPPO, IPPO) carry an agent axis after ``[T, N]`` in ``reward`` and ``value``
    (``terminated`` and ``truncated`` stay per env) and an ``agent_mask`` (a key of the trajectory or of its
    observation mapping): advantages follow it as :func:`generalized_advantage` says, and the policy's ``value``
    of an observation is 0 for the agents absent from it, except where the episode was truncated: every agent
    leaves then, but each that took the step bootstraps from its value of the final observation.

    Recurrent policies store ``hidden`` (their state before each step) and ``next_hidden`` (after it):
    bootstrapping then calls ``policy.value(next_obs, hidden=next_hidden)``, and the output is a batch of
    sequences ``[L, B]`` (``L = cfg.policy.learn.sequence_length``: each env's trajectory cut into pieces
    of ``L`` steps, the last padded) with ``episode_start`` (reset the state before this step) and
    ``mask`` (a real, valid step), for the learner to replay from each sequence's first ``hidden``.

    With a ``buffer`` the flat batch is pushed into it (``buffer.extend``) instead.

    Reads ctx: ``trajectories``.
    Writes ctx: ``train_data`` (flat batch ``[B]`` of valid rows: the trajectory's keys, such as ``obs``,
    ``action``, ``logp``, ``value``, ``reward``, plus ``adv``, ``return`` and, with reward normalisation,
    ``discounted_return``; without ``next_obs``), unless a buffer is given.
    """
    if not callable(getattr(policy, "value", None)):
        raise TypeError(f"gae_estimator needs a view with value(obs), such as an actor-critic policy's collect_mode "
                        f"(e.g. PPOPolicy(...).collect_mode), got {policy!r}")
    gamma = float(cfg.policy.discount_factor)
    gae_lambda = float(cfg.policy.gae_lambda)
    sequence_length = int(cfg.policy.learn.get("sequence_length") or 0)
    scale_reward = getattr(policy, "scale_reward", None)

    def _estimate(ctx: OnlineRLContext) -> None:
        traj = ctx.trajectories
        if traj is None:
            return
        if traj.reward.ndim == 1:  # whole episodes end to end (EpisodeCollector): one env's time axis
            traj = traj.unsqueeze(1)
        reward = traj.reward.numpy()
        steps, n = reward.shape[:2]  # a team's rewards have an agent axis after these: [T, N, A]
        terminated, truncated = traj.terminated.numpy(), traj.truncated.numpy()
        valid = traj.valid.numpy() if "valid" in traj else np.ones_like(terminated)
        done = terminated | truncated | ~valid
        discounted = None
        if scale_reward is not None:
            reward, discounted = scale_reward(reward, done)
        if "value" in traj:
            value = traj.value.numpy()
        else:
            value = policy.value(flatten_batch(traj.obs, 2)).reshape(reward.shape)
        recurrent = "hidden" in traj

        # The value of each transition's next state: the next row's own value inside an episode, the critic's
        # value of next_obs where the trajectory was cut short, nothing after a termination.
        next_value = np.zeros_like(value)
        next_value[:-1] = value[1:]
        cut = truncated.copy()
        cut[-1] = True  # the chunk ends: its episodes go on in the next call
        bootstrap = cut & ~terminated & valid
        if bootstrap.any():
            rows = torch.from_numpy(bootstrap)
            state = {"hidden": traj.next_hidden[rows]} if recurrent else {}
            next_value[bootstrap] = policy.value(_bootstrap_obs(traj, rows, truncated[bootstrap]), **state)
        next_value[terminated] = 0.0
        adv = generalized_advantage(reward, value, next_value, done, gamma, gae_lambda, _agent_mask(traj))
        adv[~valid] = 0.0

        data: Dict[str, Any] = {key: traj[key] for key in traj.keys() if key not in _CONSUMED}
        data["value"] = torch.from_numpy(value)
        data["adv"] = torch.from_numpy(adv)
        data["return"] = torch.from_numpy(adv + value)
        if discounted is not None:
            data["discounted_return"] = torch.from_numpy(discounted)
        if recurrent:
            if buffer is not None:
                raise ValueError("gae_estimator: a recurrent policy's sequences cannot be pushed into a replay buffer; "
                                 "leave buffer=None and train from ctx.train_data")
            if sequence_length <= 0:
                raise ValueError("gae_estimator: trajectories carry a recurrent 'hidden' state but "
                                 "cfg.policy.learn.sequence_length is not set")
            episode_start = np.zeros_like(done)
            episode_start[1:] = done[:-1]
            data["episode_start"] = torch.from_numpy(episode_start)
            data["mask"] = torch.from_numpy(valid)
            ctx.train_data = _sequences(ttorch.Tensor(data), steps, sequence_length)
            return
        flat = flatten_batch(ttorch.Tensor(data), 2)
        if not valid.all():
            flat = flat[torch.from_numpy(valid.reshape(-1))]
        if buffer is not None:
            buffer.extend(flat)
        else:
            ctx.train_data = flat

    return _estimate


def _bootstrap_obs(traj: ttorch.Tensor, rows: torch.Tensor, truncated: np.ndarray) -> Any:
    """The next observations of the ``rows`` that bootstrap. A team's agents all leave at a truncation (the agent
    mask of the episode's final observation is False), yet they were cut short, not terminated: there the agents
    that took the step (the agent mask of ``obs``) are valued. At a chunk end inside an episode, an agent absent from
    ``next_obs`` left after the step and is valued 0, as :func:`generalized_advantage` asks."""
    next_obs = traj.next_obs[rows]
    if not (isinstance(next_obs, ttorch.Tensor) and "agent_mask" in next_obs and "agent_mask" in traj.obs):
        return next_obs
    next_obs.agent_mask = bootstrap_agent_mask(traj.obs.agent_mask[rows], next_obs.agent_mask,
                                               torch.from_numpy(truncated))
    return next_obs


def _agent_mask(traj: ttorch.Tensor) -> Optional[np.ndarray]:
    """A team's agent mask ``[T, N, A]`` (a key of the trajectory, or of its observation mapping), else None."""
    for tree in (traj, traj.obs):
        if isinstance(tree, ttorch.Tensor) and "agent_mask" in tree:
            return tree.agent_mask.numpy()
    return None


def _sequences(batch: ttorch.Tensor, steps: int, length: int) -> ttorch.Tensor:
    """``[T, N, ...]`` leaves as ``[L, K * N, ...]``: each env's steps cut into ``K = ceil(T / L)`` sequences
    of ``L`` (sequence ``k * N + n`` is env ``n``'s steps ``k * L ...``); padding steps are zeros (mask False)."""
    pieces = -(-steps // length)
    pad = pieces * length - steps

    def cut(x: torch.Tensor) -> torch.Tensor:
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        rest = x.shape[1:]
        return x.reshape(pieces, length, *rest).transpose(0, 1).reshape(length, pieces * rest[0], *rest[1:])

    return treevalue.mapping(batch, cut)
