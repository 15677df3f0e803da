"""Offline RL middleware: feeding a fixed dataset to a learner, and recording what an online pipeline collects.

- :func:`offline_data_fetcher` (:class:`OfflineDataFetcher`) hands out shuffled minibatches of an
  :class:`~conveyor.data.offline.OfflineDataset`, epoch after epoch, as ``ctx.train_data``: the same batch
  layout a replay buffer's ``sample()`` gives, so the learners of online pipelines take it unchanged.
- :func:`episode_recorder` (:class:`EpisodeRecorder`) writes the whole episodes a collector gathers to a
  :class:`~conveyor.data.offline.DatasetWriter` (a Minari dataset).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import gymnasium as gym
import numpy as np
import torch

from conveyor.data.batch import map_nested, to_numpy, tree_of_tensors
from conveyor.data.offline import (DatasetError, DatasetWriter, OfflineDataset, check_spaces, concat_nested,
                                   leaves, load_dataset)
from conveyor.engine import FINISH_EVENT, OfflineRLContext, OnlineRLContext, declares, task

__all__ = ["OfflineDataFetcher", "offline_data_fetcher", "EpisodeRecorder", "episode_recorder"]


@declares(writes=("train_data", "train_epoch"))
class OfflineDataFetcher:
    """Shuffled minibatches of ``cfg.policy.learn.batch_size`` transitions over a whole dataset, epoch by epoch.

    Each epoch draws one permutation of the dataset's rows (from a generator seeded with ``seed``, default
    ``cfg.seed``) and hands it out in order, one minibatch per call; the last minibatch of an epoch holds the
    remainder when ``batch_size`` does not divide the dataset. A batch is a ttorch tree with ``obs``,
    ``action``, ``reward``, ``next_obs``, ``terminated``, ``truncated`` and ``index`` (the dataset rows), as a
    replay buffer's ``sample()`` gives it. The arrays are prepared once, here; a call is one ``np.take`` per
    field, wrapped as tensors without a copy.
    The dataset's spaces are checked against ``observation_space`` / ``action_space`` when given.
    ``cfg.policy.other.dataset.reward_scale`` ``'returns_range'`` multiplies the rewards handed out by
    :attr:`reward_scale` = 1000 / (the best minus the worst episode return of the dataset), as the IQL paper does
    on locomotion datasets; evaluation returns stay the env's.
    ``state_dict()`` holds the generator, the position in the epoch and the epoch count, so a resume
    hands out the very batches an uninterrupted run would.

    Writes ctx: ``train_data`` (a minibatch), ``train_epoch`` (epochs completed).
    """

    def __init__(self, cfg: Any, dataset: Any, *, observation_space: Optional[gym.Space] = None,
                 action_space: Optional[gym.Space] = None, seed: Optional[int] = None) -> None:
        batch_size = cfg.policy.learn.get("batch_size")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"offline_data_fetcher: cfg.policy.learn.batch_size must be an int > 0, got {batch_size!r}")
        self._dataset: OfflineDataset = load_dataset(dataset)
        if len(self._dataset) == 0:
            raise DatasetError(f"offline_data_fetcher: dataset {self._dataset.source} holds no transitions")
        check_spaces(self._dataset, observation_space, action_space)
        self._batch_size = batch_size
        self._size = len(self._dataset)
        self._arrays = _arrays(self._dataset)
        self.reward_scale = _reward_scale(cfg, self._dataset)
        if self.reward_scale != 1.0:
            self._arrays["reward"] = self._arrays["reward"] * np.float32(self.reward_scale)
        self._rng = np.random.default_rng(cfg.get("seed") if seed is None else seed)
        self._epoch_rng_state: Dict[str, Any] = copy.deepcopy(self._rng.bit_generator.state)
        self._order: np.ndarray = self._permutation()
        self._position = 0
        self._epoch = 0

    def __repr__(self) -> str:
        return (f"OfflineDataFetcher(transitions={self._size}, batch_size={self._batch_size}, "
                f"epoch={self._epoch}, position={self._position})")

    @property
    def dataset(self) -> OfflineDataset:
        """The dataset handed out."""
        return self._dataset

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        """Minibatches in one pass over the dataset."""
        return -(-self._size // self._batch_size)

    def _permutation(self) -> np.ndarray:
        self._epoch_rng_state = copy.deepcopy(self._rng.bit_generator.state)
        return self._rng.permutation(self._size)

    def next_batch(self) -> Any:
        """The next minibatch (a ttorch tree), starting a new epoch after the last one of an epoch."""
        if self._position >= self._size:
            self._order, self._position = self._permutation(), 0
        index = self._order[self._position:self._position + self._batch_size]
        self._position += len(index)
        if self._position >= self._size:
            self._epoch += 1
        batch = _gather(self._arrays, index)
        batch["index"] = torch.from_numpy(index)
        return tree_of_tensors(batch)

    def __call__(self, ctx: OfflineRLContext) -> None:
        epoch = self._epoch
        ctx.train_data = self.next_batch()
        if self._epoch != epoch:
            ctx.train_epoch = self._epoch

    def state_dict(self) -> Dict[str, Any]:
        """The generator at the start of this epoch's permutation, the position in it and the epochs done."""
        return {"rng": copy.deepcopy(self._epoch_rng_state), "position": self._position, "epoch": self._epoch,
                "size": self._size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: the same permutation, from the same position."""
        if state["size"] != self._size:
            raise DatasetError(f"offline_data_fetcher: the state was saved over a dataset of {state['size']} "
                               f"transitions, this one ({self._dataset.source}) has {self._size}; resume with the "
                               f"dataset the run was started with")
        self._rng.bit_generator.state = copy.deepcopy(state["rng"])
        self._order = self._permutation()
        self._position, self._epoch = int(state["position"]), int(state["epoch"])


def _reward_scale(cfg: Any, dataset: OfflineDataset) -> float:
    """What the rewards handed out are multiplied by (``cfg.policy.other.dataset.reward_scale``)."""
    kind = cfg.policy.get("other", {}).get("dataset", {}).get("reward_scale", "none")
    if kind == "none":
        return 1.0
    if kind != "returns_range":
        raise ValueError(f"offline_data_fetcher: policy.other.dataset.reward_scale must be 'none' or 'returns_range', "
                         f"got {kind!r}")
    returns = dataset.episode_returns()
    spread = float(returns.max() - returns.min())
    if not spread > 0:
        raise DatasetError(f"offline_data_fetcher: reward_scale 'returns_range' needs episodes of different returns, "
                           f"but every episode of {dataset.source} returns {float(returns[0]):g}: set "
                           f"policy.other.dataset.reward_scale='none'")
    return 1000.0 / spread


def _arrays(dataset: OfflineDataset) -> Dict[str, Any]:
    """The dataset's arrays as batches hold them, prepared once: contiguous, float64 as float32 (as ``to_tensor``)."""
    return map_nested(lambda a: np.ascontiguousarray(a, dtype=np.float32 if a.dtype == np.float64 else a.dtype),
                      dataset.as_batch())


def _gather(arrays: Dict[str, Any], index: np.ndarray) -> Dict[str, Any]:
    """Rows ``index`` of every array as tensors: one ``np.take`` per leaf (the fastest gather on CPU), no copy
    into torch."""
    return map_nested(lambda leaf: torch.from_numpy(np.take(leaf, index, axis=0)), arrays)


def offline_data_fetcher(cfg: Any, dataset: Any, *, observation_space: Optional[gym.Space] = None,
                         action_space: Optional[gym.Space] = None, seed: Optional[int] = None) -> OfflineDataFetcher:
    """Minibatches of a dataset (an :class:`OfflineDataset`, or what :func:`load_dataset` takes) as
    ``ctx.train_data``, epoch by epoch (see :class:`OfflineDataFetcher`)."""
    return OfflineDataFetcher(cfg, dataset, observation_space=observation_space, action_space=action_space,
                              seed=seed)


_FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")


@declares(reads=("trajectories", "episodes"), optional=("episodes",))  # a StepCollector writes no episodes
class EpisodeRecorder:
    """Adds every episode a collector finishes to a :class:`DatasetWriter`, whole and as collected.

    Place it right after the collector (before an n-step enhancer, which rewrites rewards and next
    observations). From ``ctx.episodes`` (EpisodeCollector) each episode is added as it is; from
    ``ctx.trajectories`` (StepCollector, ``[T, N]``) each env's transitions are gathered across calls until
    its episode ends (``terminated`` or ``truncated``); an episode cut by an env crash (a row with
    ``valid`` False) is dropped. ``state_dict()`` holds the episodes still running; the writer's pending
    episodes are written at every checkpoint. The writer is closed when the pipeline ends.

    Reads ctx: ``trajectories``, ``episodes``.
    """

    def __init__(self, writer: DatasetWriter) -> None:
        self._writer = writer
        self._running: List[List[Dict[str, np.ndarray]]] = []
        task.on(FINISH_EVENT, lambda *_: writer.close())

    def __repr__(self) -> str:
        return f"EpisodeRecorder({self._writer!r})"

    @property
    def writer(self) -> DatasetWriter:
        """Where episodes go."""
        return self._writer

    def __call__(self, ctx: OnlineRLContext) -> None:
        if ctx.episodes is not None:
            for episode in ctx.episodes:
                self._writer.add_episode(to_numpy(episode))
        elif ctx.trajectories is not None:
            self._add_steps(to_numpy(ctx.trajectories))

    def _add_steps(self, data: Dict[str, Any]) -> None:
        if "discount" in data:
            raise ValueError("episode_recorder: ctx.trajectories holds n-step returns ('discount'); place the "
                             "recorder right after the collector, before nstep_reward_enhancer")
        reward = data["reward"]
        if reward.ndim == 1:  # a flat [T] batch from a single env
            data = map_nested(lambda a: a[:, None], data)
            reward = data["reward"]
        steps, envs = reward.shape
        while len(self._running) < envs:
            self._running.append([])
        valid = data.get("valid", np.ones((steps, envs), dtype=bool))
        cuts = (data["terminated"] | data["truncated"]) | ~valid
        for i in range(envs):
            start = 0
            for t in np.flatnonzero(cuts[:, i]).tolist():
                if valid[t, i]:
                    self._extend(i, _rows(data, start, t + 1, i))
                    self._writer.add_episode(concat_nested(self._running[i]))
                self._running[i] = []  # an episode ended, or a crash cut it: it is dropped
                start = t + 1
            if start < steps:
                self._extend(i, _rows(data, start, steps, i))

    def _extend(self, env: int, part: Dict[str, Any]) -> None:
        """Continue env ``env``'s running episode with ``part``; a running episode ``part`` does not continue
        (its env was reseeded on a resume) is dropped."""
        running = self._running[env]
        if running and not all(np.array_equal(a[-1], b[0]) for a, b in
                               zip(leaves(running[-1]["next_obs"]), leaves(part["obs"]))):
            running.clear()
        running.append(part)

    def state_dict(self) -> Dict[str, Any]:
        """The episodes still running, per env; writes the writer's pending episodes first."""
        self._writer.flush()
        return {"running": copy.deepcopy(self._running)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on with the running episodes of :meth:`state_dict`."""
        self._running = copy.deepcopy(state["running"])


def _rows(data: Dict[str, Any], start: int, stop: int, env: int) -> Dict[str, Any]:
    """Env ``env``'s transitions ``start:stop`` of a ``[T, N]`` batch, for the fields a dataset keeps."""
    return {k: map_nested(lambda a: a[start:stop, env], data[k]) for k in _FIELDS}


def episode_recorder(writer: DatasetWriter) -> EpisodeRecorder:
    """Record the episodes an online pipeline collects into ``writer`` (see :class:`EpisodeRecorder`)."""
    return EpisodeRecorder(writer)
