"""Running statistics, and the observation and reward normalisers policies keep in their checkpoints.

:class:`RunningMeanStd` merges batches into a mean and variance with Chan et al.'s parallel update
(exact for any batch sizes, float64). :class:`ObsNormaliser` normalises with one set of statistics
while it gathers the observations to add next, and folds them in only when told to (:meth:`commit`):
an on-policy policy commits when it starts collecting after an update, so a rollout is normalised the
same way when it is acted on, valued and learned from (the ratio of new to old action probabilities
starts at exactly 1). :class:`RewardNormaliser` works the same way on the discounted returns of each env,
whose standard deviation scales rewards (Stable-Baselines3 VecNormalize's ``norm_reward``). What a published
version acts with is frozen into one :class:`FrozenNormaliser`.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["RunningMeanStd", "ObsNormaliser", "RewardNormaliser", "FrozenNormaliser"]


class RunningMeanStd:
    """Mean and variance of every element of a stream of batches ``[B, *shape]`` (float64)."""

    def __init__(self, shape: Sequence[int] = ()) -> None:
        self.shape = tuple(shape)
        self.mean = np.zeros(self.shape, np.float64)
        self.var = np.ones(self.shape, np.float64)
        self.count = 0

    def update(self, batch: np.ndarray) -> None:
        """Merge a batch ``[B, *shape]`` into the statistics."""
        batch = np.asarray(batch, np.float64).reshape((-1,) + self.shape)
        if len(batch):
            self.merge(batch.mean(axis=0), batch.var(axis=0), len(batch))

    def merge(self, mean: np.ndarray, var: np.ndarray, count: int) -> None:
        """Merge the statistics of another sample (``mean``, population ``var``, ``count``)."""
        if count <= 0:
            return
        if self.count == 0:
            self.mean, self.var, self.count = np.array(mean, np.float64), np.array(var, np.float64), int(count)
            return
        total = self.count + count
        delta = mean - self.mean
        m2 = self.var * self.count + var * count + delta**2 * self.count * count / total
        self.mean = self.mean + delta * count / total
        self.var = m2 / total
        self.count = total

    def merge_from(self, other: "RunningMeanStd") -> None:
        """Merge ``other``'s statistics into these."""
        self.merge(other.mean, other.var, other.count)

    def pack(self) -> np.ndarray:
        """``count``, ``mean`` and ``var`` in one flat float64 array (:meth:`unpack` reads it back), to send."""
        return np.concatenate([[float(self.count)], self.mean.reshape(-1), self.var.reshape(-1)])

    @classmethod
    def unpack(cls, packed: np.ndarray, shape: Sequence[int] = ()) -> "RunningMeanStd":
        """The statistics :meth:`pack` wrote for ``shape``."""
        stats = cls(shape)
        size = int(np.prod(stats.shape, dtype=np.int64))
        stats.count = int(packed[0])
        stats.mean = np.array(packed[1:1 + size], np.float64).reshape(stats.shape)
        stats.var = np.array(packed[1 + size:1 + 2 * size], np.float64).reshape(stats.shape)
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.mean = np.array(state_dict["mean"], np.float64).reshape(self.shape)
        self.var = np.array(state_dict["var"], np.float64).reshape(self.shape)
        self.count = int(state_dict["count"])


class FrozenNormaliser:
    """The statistics a published policy version acts with, fixed: ``clip((obs - mean) * inv_std)`` for
    observations (the identity when ``mean`` is None) and ``clip(reward * reward_scale)`` for rewards
    (:meth:`scale_reward`; the identity when ``reward_scale`` is None)."""

    __slots__ = ("mean", "inv_std", "clip", "reward_scale", "reward_clip")

    def __init__(self, mean: torch.Tensor | None, inv_std: torch.Tensor | None, clip: float | None,
                 reward_scale: float | None = None, reward_clip: float | None = None) -> None:
        self.mean, self.inv_std, self.clip = mean, inv_std, clip
        self.reward_scale, self.reward_clip = reward_scale, reward_clip

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return obs
        out = (obs.float() - self.mean) * self.inv_std
        return out if self.clip is None else out.clamp(-self.clip, self.clip)

    def scale_reward(self, reward: np.ndarray) -> np.ndarray:
        """Rewards (numpy) scaled by the frozen return statistics and clipped, as float32."""
        if self.reward_scale is None:
            return reward
        out = np.asarray(reward, np.float32) * np.float32(self.reward_scale)
        return out if self.reward_clip is None else np.clip(out, -self.reward_clip, self.reward_clip)

    def wire(self) -> dict[str, Any]:
        """Plain data for a codec (see :data:`conveyor.policy.weights.WIRE_TYPES`)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def to(self, device: torch.device | str) -> "FrozenNormaliser":
        """These statistics with their tensors on ``device`` (``self`` when they are there already)."""
        if self.mean is None or self.mean.device == torch.device(device):
            return self
        return FrozenNormaliser(self.mean.to(device), self.inv_std.to(device), self.clip, self.reward_scale,
                                self.reward_clip)

    def __reduce__(self) -> tuple:
        """Pickled with host tensors, so a process it is sent to (a collector process) needs no CUDA."""
        cpu = self.to("cpu")
        return FrozenNormaliser, (cpu.mean, cpu.inv_std, cpu.clip, cpu.reward_scale, cpu.reward_clip)


class ObsNormaliser:
    """``clip((obs - mean) / sqrt(var + eps), -clip, clip)`` with running statistics of observed data.

    :meth:`observe` gathers observations (cheaply: it keeps the tensors); :meth:`commit` folds what was
    gathered into the statistics that :meth:`__call__` uses. Before any commit it is the identity (up
    to clipping). Thread-safe: a collector may observe while a checkpoint is taken.
    """

    _FLUSH_EVERY = 256  # gathered batches are merged into the pending statistics this often, bounding memory

    def __init__(self, shape: int | Sequence[int], *, clip: float | None = 10.0, eps: float = 1e-8) -> None:
        self.shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        self.clip = clip
        self.eps = eps
        self.stats = RunningMeanStd(self.shape)
        self.pending = RunningMeanStd(self.shape)
        self._gathered: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._mean = torch.zeros(self.shape)
        self._inv_std = torch.ones(self.shape)
        self._sync_tensors()

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        """Normalised float observations (any leading dims)."""
        if self._mean.device != obs.device:
            self._mean, self._inv_std = self._mean.to(obs.device), self._inv_std.to(obs.device)
        out = (obs.float() - self._mean) * self._inv_std
        return out if self.clip is None else out.clamp(-self.clip, self.clip)

    def frozen(self, device: torch.device | str | None = None) -> FrozenNormaliser:
        """The statistics in use now, as a normaliser that never changes (tensors on ``device``)."""
        with self._lock:
            mean, inv_std = self._mean, self._inv_std  # replaced, never written in place, by commits
        if device is not None:
            mean, inv_std = mean.to(device), inv_std.to(device)
        return FrozenNormaliser(mean, inv_std, self.clip)

    def observe(self, obs: torch.Tensor) -> None:
        """Gather a batch ``[B, *shape]`` of raw observations for the next :meth:`commit`."""
        with self._lock:
            self._gathered.append(obs.detach())
            if len(self._gathered) >= self._FLUSH_EVERY:
                self._flush()

    def observe_stats(self, stats: RunningMeanStd) -> None:
        """Gather the statistics of observations seen elsewhere (another learner's) for the next :meth:`commit`."""
        with self._lock:
            self._flush()
            self.pending.merge_from(stats)

    def commit(self) -> bool:
        """Fold everything observed since the last commit into the statistics; whether anything changed."""
        with self._lock:
            self._flush()
            if self.pending.count == 0:
                return False
            self.stats.merge(self.pending.mean, self.pending.var, self.pending.count)
            self.pending = RunningMeanStd(self.shape)
            self._sync_tensors()
            return True

    def _flush(self) -> None:
        if self._gathered:
            batch = torch.cat([o.reshape(-1, *self.shape) for o in self._gathered]).double().cpu().numpy()
            self._gathered = []
            self.pending.update(batch)

    def _sync_tensors(self) -> None:
        device = self._mean.device
        self._mean = torch.as_tensor(self.stats.mean, dtype=torch.float32, device=device)
        self._inv_std = torch.as_tensor(1.0 / np.sqrt(self.stats.var + self.eps), dtype=torch.float32, device=device)

    def state_dict(self) -> dict[str, Any]:
        """The statistics in use and those gathered but not yet committed."""
        with self._lock:
            self._flush()
            return {"stats": self.stats.state_dict(), "pending": self.pending.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        with self._lock:
            self.stats.load_state_dict(state_dict["stats"])
            self.pending.load_state_dict(state_dict["pending"])
            self._gathered = []
            self._sync_tensors()

    def __repr__(self) -> str:
        return f"ObsNormaliser(shape={self.shape}, clip={self.clip}, count={self.stats.count})"


class RewardNormaliser:
    """Scales rewards by ``1 / sqrt(var + eps)`` of each env's discounted return ``R = gamma * R + reward``
    (reset at episode ends), clipped to ``+-clip``: Stable-Baselines3 VecNormalize's ``norm_reward``.

    :meth:`discount` runs the envs' returns through a time-major chunk of rewards ``[T, N]`` where they are
    collected (the returns carried from one chunk to the next are part of :meth:`state_dict`); :meth:`gather`
    takes returns in where the statistics are kept, and :meth:`commit` folds what was gathered into the
    statistics :meth:`scale` reads, as :class:`ObsNormaliser` does, so one rollout is scaled with one set of
    statistics. Thread-safe.
    """

    def __init__(self, gamma: float, *, clip: float | None = 10.0, eps: float = 1e-8) -> None:
        self.gamma, self.clip, self.eps = float(gamma), clip, eps
        self.stats = RunningMeanStd(())
        self.pending = RunningMeanStd(())
        self.returns: np.ndarray | None = None  # each env's discounted return so far, [N]
        self._lock = threading.Lock()

    def discount(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        """Each env's discounted return after every step of ``reward [T, N]`` (float32 ``[T, N]``), going on from
        the returns of the previous chunk; ``done`` ends a return after its step."""
        reward = np.asarray(reward, np.float64)
        returns = np.empty_like(reward)
        with self._lock:
            carry = self.returns
            if carry is None or carry.shape != reward.shape[1:]:
                carry = np.zeros(reward.shape[1:], np.float64)
            for t in range(len(reward)):
                carry = carry * self.gamma + reward[t]
                returns[t] = carry
                carry = np.where(done[t], 0.0, carry)
            self.returns = carry
        return returns.astype(np.float32)

    def gather(self, returns: np.ndarray) -> None:
        """Take discounted returns (any shape) in for the next :meth:`commit`."""
        with self._lock:
            self.pending.update(np.asarray(returns, np.float64).reshape(-1))

    def gather_stats(self, stats: RunningMeanStd) -> None:
        """Take the statistics of returns gathered elsewhere (another learner's) in for the next :meth:`commit`."""
        with self._lock:
            self.pending.merge_from(stats)

    def commit(self) -> bool:
        """Fold the returns gathered since the last commit into the statistics; whether anything changed."""
        with self._lock:
            if self.pending.count == 0:
                return False
            self.stats.merge(self.pending.mean, self.pending.var, self.pending.count)
            self.pending = RunningMeanStd(())
            return True

    def scale(self) -> float:
        """The factor rewards are multiplied by now: ``1 / sqrt(var + eps)`` of the committed returns."""
        with self._lock:
            return float(1.0 / np.sqrt(self.stats.var + self.eps))

    def state_dict(self) -> dict[str, Any]:
        """The statistics in use, those gathered but not yet committed, and each env's return so far."""
        with self._lock:
            return {"stats": self.stats.state_dict(), "pending": self.pending.state_dict(),
                    "returns": None if self.returns is None else self.returns.copy()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        with self._lock:
            self.stats.load_state_dict(state_dict["stats"])
            self.pending.load_state_dict(state_dict["pending"])
        self.load_returns(state_dict["returns"])

    def load_returns(self, returns: np.ndarray | None) -> None:
        """Set each env's discounted return so far (``state_dict()["returns"]``), e.g. a collector replica's."""
        with self._lock:
            self.returns = None if returns is None else np.array(returns, np.float64)

    def __repr__(self) -> str:
        return f"RewardNormaliser(gamma={self.gamma}, clip={self.clip}, count={self.stats.count})"
