"""Running observation statistics, and an observation normaliser policies keep in their checkpoints.

:class:`RunningMeanStd` merges batches into a mean and variance with Chan et al.'s parallel update
(exact for any batch sizes, float64). :class:`ObsNormaliser` normalises with one set of statistics
while it gathers the observations to add next, and folds them in only when told to (:meth:`commit`):
an on-policy policy commits when it starts collecting after an update, so a rollout is normalised the
same way when it is acted on, valued and learned from (the ratio of new to old action probabilities
starts at exactly 1).
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["RunningMeanStd", "ObsNormaliser", "FrozenNormaliser"]


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

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.mean = np.array(state_dict["mean"], np.float64).reshape(self.shape)
        self.var = np.array(state_dict["var"], np.float64).reshape(self.shape)
        self.count = int(state_dict["count"])


class FrozenNormaliser:
    """``clip((obs - mean) * inv_std)`` with fixed statistics: what a published policy version acts with."""

    __slots__ = ("mean", "inv_std", "clip")

    def __init__(self, mean: torch.Tensor, inv_std: torch.Tensor, clip: float | None) -> None:
        self.mean, self.inv_std, self.clip = mean, inv_std, clip

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        out = (obs.float() - self.mean) * self.inv_std
        return out if self.clip is None else out.clamp(-self.clip, self.clip)


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
