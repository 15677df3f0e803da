"""Enhancers rewrite collected transitions before training: n-step returns.

The n-step rule (docs/design.md): every valid transition gets a window of ``m = min(nstep, steps to its
episode's end)`` steps, however collection is chunked into calls. A window stops after a step that
terminated or was truncated, and before a crashed step (``valid == False``): the step before a crash is
truncated unless it terminated (it bootstraps from its true next observation), the crashed row itself is
no transition and never enters a window. The transition's ``reward`` is then the discounted sum over its window,
``next_obs`` / ``terminated`` / ``truncated`` are those of the window's last step and ``discount = gamma ** m``
is the factor of the bootstrap value (only ``terminated`` stops bootstrapping).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import treetensor.torch as ttorch

from conveyor.data.batch import map_nested
from conveyor.engine import OnlineRLContext, declares

__all__ = ["nstep_reward_enhancer", "nstep_returns", "NStepEnhancer"]

_WINDOW_KEYS = ("reward", "next_obs", "terminated", "truncated")  # rewritten from the window; the rest from its start


def _check_time_major(reward: torch.Tensor, where: str) -> None:
    if reward.ndim != 2:
        raise ValueError(f"{where} needs a time-major batch [T, N]; got reward of shape {tuple(reward.shape)}")


def _crash_truncated(terminated: torch.Tensor, truncated: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``truncated`` with the step before each crash marked truncated unless it terminated (what the collector
    does within a call; a call cannot see that the next call starts with a crash)."""
    out = truncated.clone()
    out[:-1] |= valid[:-1] & ~valid[1:] & ~terminated[:-1]
    return out


def _windows(reward: torch.Tensor, done: torch.Tensor, valid: torch.Tensor, gamma: float, nstep: int):
    """Every row's window over a time-major ``[T, N]`` chunk, vectorised over rows: the discounted reward sum,
    the index of its last row and its length. A window grows while it has fewer than ``nstep`` rows, its last
    row is no episode end and the next row exists and is valid."""
    steps, n_env = reward.shape
    total = reward.clone()
    last = torch.arange(steps).unsqueeze(1).expand(steps, n_env).clone()
    extending = ~done
    for k in range(1, min(nstep, steps)):
        can = extending[: steps - k] & valid[k:]
        total[: steps - k] += can * (gamma ** k) * reward[k:]
        last[: steps - k] += can
        extending[: steps - k] = can & ~done[k:]
        extending[steps - k:] = False
    length = last - torch.arange(steps).unsqueeze(1) + 1
    return total, last, length


def _gather_tree(obs: Any, t: torch.Tensor, env: torch.Tensor) -> Any:
    if isinstance(obs, torch.Tensor) and not hasattr(obs, "items"):
        return obs[t, env]
    return type(obs)(map_nested(lambda leaf: leaf[t, env], {k: v for k, v in obs.items()}))


def nstep_returns(batch: Any, gamma: float, nstep: int) -> Any:
    """n-step returns over one time-major batch ``[T, N]``, in place; returns the batch.

    Windows follow the module's rule but also stop at the end of the batch (:class:`NStepEnhancer` carries
    them over to the next batch instead). Rows with ``valid == False`` keep their values and enter no window.
    """
    _check_time_major(batch.reward, "nstep_returns")
    steps, n_env = batch.reward.shape
    valid = batch.valid if "valid" in batch else torch.ones(steps, n_env, dtype=torch.bool)
    terminated, truncated = batch.terminated, _crash_truncated(batch.terminated, batch.truncated, valid)
    total, last, length = _windows(batch.reward, terminated | truncated, valid, gamma, nstep)
    env = torch.arange(n_env).unsqueeze(0).expand(steps, n_env)
    batch.reward = total
    batch.discount = (gamma ** length.float()).float()
    batch.terminated = terminated[last, env]
    batch.truncated = truncated[last, env]
    batch.next_obs = _gather_tree(batch.next_obs, last, env)
    return batch


@declares(reads=("trajectories",), writes=("trajectories",))
class NStepEnhancer:
    """Turns the collector's one-step transitions into n-step ones across collection calls (see the module doc).

    Each call appends the new rows ``[T, N]`` to the rows carried from the last call and hands on every
    transition whose window is now final as a flat batch ``[B]`` in time-major order: ended by an episode end,
    or followed by a row that has arrived (``nstep`` rows long, or cut by the crash of that row). Transitions
    whose window needs rows of the next call wait: each env's last ``nstep`` rows are carried over (one more
    than a window needs, since a crash in the next call's first row truncates a window ending just before it),
    so the buffer holds only finished n-step transitions, exactly those of one long call however collection is
    chunked. The carried rows are the enhancer's state (``state_dict`` / ``load_state_dict``), so a resumed run
    finishes the windows it left open.

    Reads ctx: ``trajectories`` (time-major ``[T, N]``, from ``StepCollector``; rows with ``valid == False``
    are crashed steps).
    Writes ctx: ``trajectories``: flat batch ``[B]`` of finished transitions (without ``valid``), with n-step
    ``reward``, ``next_obs``, ``terminated``, ``truncated`` and ``discount``; other keys are their first step's.
    """

    def __init__(self, gamma: float, nstep: int) -> None:
        if not isinstance(nstep, int) or isinstance(nstep, bool) or nstep < 1:
            raise ValueError(f"cfg.policy.nstep must be an int >= 1, got {nstep!r}")
        self._gamma = float(gamma)
        self._nstep = nstep
        self._carry: Optional[ttorch.Tensor] = None  # the last rows (at most nstep), as collected
        self._waiting: Optional[torch.Tensor] = None  # [C, N]: which carried rows are transitions still waiting

    def __repr__(self) -> str:
        return f"NStepEnhancer(nstep={self._nstep}, gamma={self._gamma})"

    def __call__(self, ctx: OnlineRLContext) -> None:
        if ctx.trajectories is not None:
            ctx.trajectories = self.process(ctx.trajectories)

    def process(self, batch: Any) -> ttorch.Tensor:
        """The transitions of ``batch`` (time-major ``[T, N]``) and the carried rows whose windows are now complete."""
        _check_time_major(batch.reward, "NStepEnhancer")
        steps, n_env = batch.reward.shape
        if "valid" not in batch:
            batch = ttorch.Tensor({**dict(batch.items()), "valid": torch.ones(steps, n_env, dtype=torch.bool)})
        rows, candidate = batch, batch.valid
        if self._carry is not None:
            self._check_matches(batch)
            rows = ttorch.cat([self._carry, batch], dim=0)
            candidate = torch.cat([self._waiting, batch.valid], dim=0)
        length_all, _ = rows.reward.shape
        valid = rows.valid
        terminated, truncated = rows.terminated, _crash_truncated(rows.terminated, rows.truncated, valid)
        done = terminated | truncated
        total, last, length = _windows(rows.reward, done, valid, self._gamma, self._nstep)
        env = torch.arange(n_env).unsqueeze(0).expand(length_all, n_env)
        # A window is final once it ended an episode, or once the row after it has arrived: only then is it known
        # whether that row crashed, which makes the window's last step truncated (as in one long call).
        complete = done[last, env] | (last + 1 < length_all)
        emit = candidate & complete
        self._carry = rows[-self._nstep:]
        self._waiting = (candidate & ~complete)[-self._nstep:]

        out: Dict[str, Any] = {key: rows[key][emit] for key in rows.keys() if key not in _WINDOW_KEYS + ("valid",)}
        last, env_e = last[emit], env[emit]
        out["reward"] = total[emit]
        out["discount"] = (self._gamma ** length[emit].double()).float()
        out["terminated"] = terminated[last, env_e]
        out["truncated"] = truncated[last, env_e]
        out["next_obs"] = _gather_tree(rows.next_obs, last, env_e)
        return ttorch.Tensor(out)

    def _check_matches(self, batch: Any) -> None:
        carried, new = sorted(self._carry.keys()), sorted(batch.keys())
        if carried != new or self._carry.reward.shape[1] != batch.reward.shape[1]:
            raise ValueError(f"NStepEnhancer: this batch (keys {new}, {batch.reward.shape[1]} envs) does not continue "
                             f"the carried rows (keys {carried}, {self._carry.reward.shape[1]} envs); every call "
                             f"must bring the same keys from the same envs")

    def state_dict(self) -> Dict[str, Any]:
        """The carried rows and which of them still wait for their windows (copies)."""
        if self._carry is None:
            return {"carry": None, "waiting": None}
        return {"carry": _to_dict(self._carry), "waiting": self._waiting.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: the next call finishes the carried windows."""
        if state["carry"] is None:
            self._carry, self._waiting = None, None
            return
        carry = ttorch.Tensor(state["carry"])
        waiting = torch.as_tensor(state["waiting"], dtype=torch.bool)
        if waiting.shape != carry.reward.shape or len(waiting) > self._nstep:
            raise ValueError(f"NStepEnhancer.load_state_dict: the state carries {tuple(carry.reward.shape)} rows, "
                             f"which nstep={self._nstep} cannot have come from; load a state of the same nstep")
        self._carry, self._waiting = carry, waiting


def _to_dict(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor) and not hasattr(tree, "items"):
        return tree.clone()
    return {key: _to_dict(value) for key, value in tree.items()}


def nstep_reward_enhancer(cfg: Any) -> NStepEnhancer:
    """The n-step enhancer for ``cfg.policy.nstep`` and ``cfg.policy.discount_factor`` (see :class:`NStepEnhancer`)."""
    return NStepEnhancer(cfg.policy.discount_factor, cfg.policy.nstep)
