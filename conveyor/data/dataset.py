"""The in-memory offline dataset: N transitions as numpy arrays, episodes one after another.

An :class:`OfflineDataset` holds ``observations``, ``actions``, ``rewards`` (float32),
``next_observations``, ``terminations`` and ``truncations`` (bool, kept apart: a terminated transition
does not bootstrap, a truncated one does, as everywhere in Conveyor, see ``conveyor/data/batch.py``),
``episode_ids`` and the two gymnasium spaces. Where datasets come from is :mod:`conveyor.data.offline`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import gymnasium as gym
import numpy as np

from conveyor.data.batch import Nested, map_nested

__all__ = ["DatasetError", "FIELDS", "OfflineDataset", "check_spaces", "concat_datasets", "concat_nested", "leaves"]

FIELDS = ("observations", "actions", "rewards", "next_observations", "terminations", "truncations")
"""The arrays of a transitions file, one row per transition."""


class DatasetError(ValueError):
    """A dataset cannot be read or used: the message names the file or dataset and what is wrong."""


def one_line(exc: BaseException) -> str:
    """An exception as one line of text, for the errors that name a file it came from."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def leaves(data: Nested) -> List[np.ndarray]:
    """The arrays of a (nested) dict of arrays, in key order; ``[data]`` for an array."""
    out: List[np.ndarray] = []
    map_nested(out.append, data)
    return out


def _rows(data: Nested) -> int:
    return len(leaves(data)[0])


@dataclass
class OfflineDataset:
    """N transitions, episodes one after another, with the spaces of the env that made them.

    ``observations`` / ``next_observations`` are arrays ``[N, ...]`` (dicts of them for Dict spaces),
    ``actions`` ``[N, ...]``, ``rewards`` float32 ``[N]``, ``terminations`` / ``truncations`` bool ``[N]``,
    ``episode_ids`` int64 ``[N]`` (0, 0, ..., 1, 1, ...). ``source`` says where it was loaded from.
    """

    observations: Nested
    actions: np.ndarray
    rewards: np.ndarray
    next_observations: Nested
    terminations: np.ndarray
    truncations: np.ndarray
    observation_space: gym.Space
    action_space: gym.Space
    episode_ids: np.ndarray = field(default=None)  # type: ignore[assignment]
    source: str = "<memory>"

    def __post_init__(self) -> None:
        self.rewards = np.asarray(self.rewards, dtype=np.float32).reshape(-1)
        self.terminations = np.asarray(self.terminations).astype(bool, copy=False).reshape(-1)
        self.truncations = np.asarray(self.truncations).astype(bool, copy=False).reshape(-1)
        self.actions = np.asarray(self.actions)
        n = len(self.rewards)
        for name in FIELDS:
            rows = _rows(getattr(self, name))
            if rows != n:
                raise DatasetError(f"{self.source}: '{name}' has {rows} rows but 'rewards' has {n}; "
                                   f"every field needs one row per transition")
        if self.episode_ids is None:
            ends = self.terminations | self.truncations
            self.episode_ids = np.concatenate(([0], np.cumsum(ends[:-1]))).astype(np.int64) if n else \
                np.zeros(0, dtype=np.int64)
        self.episode_ids = np.asarray(self.episode_ids, dtype=np.int64).reshape(-1)
        if len(self.episode_ids) != n:
            raise DatasetError(f"{self.source}: 'episode_ids' has {len(self.episode_ids)} rows but 'rewards' has {n}")

    def __len__(self) -> int:
        return len(self.rewards)

    def __repr__(self) -> str:
        return (f"OfflineDataset({len(self)} transitions, {self.num_episodes} episodes, "
                f"observation_space={self.observation_space}, action_space={self.action_space}, "
                f"source={self.source!r})")

    @property
    def num_episodes(self) -> int:
        """How many episodes (the last one of a plain transitions file may be unfinished)."""
        return int(self.episode_ids[-1]) + 1 if len(self) else 0

    def episode_returns(self) -> np.ndarray:
        """The undiscounted return of each episode, in order."""
        return np.bincount(self.episode_ids, weights=self.rewards, minlength=self.num_episodes)

    def episodes(self) -> Iterator["OfflineDataset"]:
        """Each episode as a dataset of its own (views of these arrays, no copies)."""
        bounds = np.flatnonzero(np.diff(self.episode_ids)) + 1
        starts = np.concatenate(([0], bounds)) if len(self) else np.zeros(0, dtype=np.int64)
        for start, stop in zip(starts, np.append(starts[1:], len(self)).astype(np.int64)):
            yield self.slice(int(start), int(stop))

    def slice(self, start: int, stop: int) -> "OfflineDataset":
        """Transitions ``start`` to ``stop`` (views), episode ids renumbered from 0."""
        cut = slice(start, stop)
        ids = self.episode_ids[cut]
        return OfflineDataset(
            observations=map_nested(lambda a: a[cut], self.observations), actions=self.actions[cut],
            rewards=self.rewards[cut], next_observations=map_nested(lambda a: a[cut], self.next_observations),
            terminations=self.terminations[cut], truncations=self.truncations[cut],
            observation_space=self.observation_space, action_space=self.action_space,
            episode_ids=ids - ids[0] if len(ids) else ids, source=self.source)

    def as_batch(self) -> Dict[str, Any]:
        """The transitions under the names replay batches use: ``obs``, ``action``, ``reward``, ``next_obs``,
        ``terminated``, ``truncated`` (numpy, no copies)."""
        return {"obs": self.observations, "action": self.actions, "reward": self.rewards,
                "next_obs": self.next_observations, "terminated": self.terminations, "truncated": self.truncations}


def concat_datasets(datasets: Sequence[OfflineDataset]) -> OfflineDataset:
    """The transitions of ``datasets`` one after another (e.g. expert and noisy data into a mixed dataset);
    their spaces must agree. Episode ids are renumbered so episodes stay apart."""
    if not datasets:
        raise ValueError("concat_datasets needs at least one dataset")
    first = datasets[0]
    for other in datasets[1:]:
        check_spaces(other, first.observation_space, first.action_space, where=f"dataset {first.source}")
    offsets = np.cumsum([0] + [d.num_episodes for d in datasets[:-1]])
    return OfflineDataset(
        observations=concat_nested([d.observations for d in datasets]),
        actions=np.concatenate([d.actions for d in datasets]), rewards=np.concatenate([d.rewards for d in datasets]),
        next_observations=concat_nested([d.next_observations for d in datasets]),
        terminations=np.concatenate([d.terminations for d in datasets]),
        truncations=np.concatenate([d.truncations for d in datasets]),
        observation_space=first.observation_space, action_space=first.action_space,
        episode_ids=np.concatenate([d.episode_ids + k for d, k in zip(datasets, offsets)]),
        source=" + ".join(d.source for d in datasets))


def check_spaces(dataset: OfflineDataset, observation_space: Optional[gym.Space] = None,
                 action_space: Optional[gym.Space] = None, *, where: str = "the policy's env") -> None:
    """Refuse a dataset whose spaces differ from those given (None: not checked); the error shows both."""
    for what, mine, theirs in (("observation", dataset.observation_space, observation_space),
                               ("action", dataset.action_space, action_space)):
        if theirs is not None and mine != theirs:
            raise DatasetError(f"dataset {dataset.source} has {what} space {mine} but {where} has {theirs}: "
                               f"record the dataset in the env the policy acts in")


def concat_nested(parts: List[Nested]) -> Nested:
    """Concatenate same-structured (nested) arrays along their first axis."""
    first = parts[0]
    if isinstance(first, Mapping):
        return {k: concat_nested([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return {str(i): concat_nested([p[i] for p in parts]) for i in range(len(first))}
    return np.concatenate(parts)
