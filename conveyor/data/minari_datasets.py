"""Minari datasets (the ``minari`` package's format, what the Gymnasium ecosystem uses for offline RL):
read from a local dataset folder, written by :class:`DatasetWriter`. Nothing is ever downloaded.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import gymnasium as gym
import numpy as np

from conveyor.data.batch import Nested, map_nested
from conveyor.data.dataset import DatasetError, OfflineDataset, concat_nested, leaves, one_line

__all__ = ["DatasetWriter", "dataset_root", "read_metadata", "read_minari"]

PathLike = Union[str, "os.PathLike[str]"]

_INSTALL = "pip install 'conveyor[offline]'"


def _minari() -> Any:
    try:
        import minari
    except ImportError as exc:  # pragma: no cover - minari is in the offline and test extras
        raise ImportError(f"Minari datasets need the minari package: {_INSTALL}") from exc
    return minari


def dataset_root(root: Optional[PathLike] = None) -> Path:
    """The local Minari dataset folder: ``root``, else ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``."""
    if root is not None:
        return Path(root)
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env) if env else Path.home() / ".minari" / "datasets"


def _minari_data_dir(path: Path) -> Path:
    """A Minari dataset's ``data`` folder from the dataset's folder or the data folder itself."""
    if (path / "metadata.json").is_file():
        return path
    if (path / "data" / "metadata.json").is_file():
        return path / "data"
    raise DatasetError(f"{path}: not a Minari dataset folder (no data/metadata.json)")


def read_metadata(path: Path) -> Dict[str, Any]:
    """The metadata of the Minari dataset in folder ``path`` (the dataset's or its ``data`` folder), as Minari
    stores it: its own keys (``dataset_id``, ``total_steps``...) and those a writer added."""
    data_dir = _minari_data_dir(path)
    try:
        return json.loads((data_dir / "metadata.json").read_text())
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read the metadata of Minari dataset {data_dir}: {one_line(exc)}") from None


def read_minari(path: Path) -> OfflineDataset:
    """The transitions of the Minari dataset in folder ``path`` (the dataset's or its ``data`` folder)."""
    data_dir = _minari_data_dir(path)
    minari = _minari()
    try:
        dataset = minari.MinariDataset(data_dir)
        episodes = list(dataset.iterate_episodes())
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise DatasetError(f"cannot read Minari dataset {data_dir}: {one_line(exc)}") from None
    if not episodes:
        raise DatasetError(f"Minari dataset {data_dir} holds no episodes")
    obs, next_obs, parts = [], [], {k: [] for k in ("actions", "rewards", "terminations", "truncations")}
    for episode in episodes:
        steps = len(episode.rewards)
        obs_leaves = leaves(episode.observations)
        if any(len(leaf) != steps + 1 for leaf in obs_leaves) or len(episode.terminations) != steps \
                or len(episode.truncations) != steps or len(leaves(episode.actions)[0]) != steps:
            raise DatasetError(f"Minari dataset {data_dir}: episode {episode.id} is malformed ({steps} rewards "
                               f"need {steps + 1} observations and {steps} actions, terminations and truncations)")
        obs.append(map_nested(lambda a: a[:-1], episode.observations))
        next_obs.append(map_nested(lambda a: a[1:], episode.observations))
        for key in parts:
            parts[key].append(getattr(episode, key))
    lengths = [len(ep.rewards) for ep in episodes]
    return OfflineDataset(observations=concat_nested(obs), actions=concat_nested(parts["actions"]),
                          rewards=np.concatenate(parts["rewards"]), next_observations=concat_nested(next_obs),
                          terminations=np.concatenate(parts["terminations"]),
                          truncations=np.concatenate(parts["truncations"]),
                          observation_space=dataset.observation_space, action_space=dataset.action_space,
                          episode_ids=np.repeat(np.arange(len(episodes)), lengths), source=str(path))


class DatasetWriter:
    """Writes episodes as a Minari dataset ``<root>/<dataset_id>/`` (``root``: see :func:`dataset_root`).

    ``dataset_id`` follows Minari's ``(namespace/)name-v<version>``; an id that exists already is refused
    unless ``overwrite``. ``metadata`` adds keys to the dataset's metadata (JSON values; Minari keeps keys it does
    not know, and reads ``ref_min_score`` / ``ref_max_score`` for normalised scores); :meth:`update_metadata`
    adds more later. Episodes added with :meth:`add_episode` are written every ``flush_steps``
    transitions and by :meth:`close` (also on leaving a ``with`` block); observations are stored losslessly.
    """

    def __init__(self, dataset_id: str, observation_space: gym.Space, action_space: gym.Space, *,
                 root: Optional[PathLike] = None, env_id: Optional[str] = None,
                 algorithm_name: Optional[str] = None, description: Optional[str] = None,
                 overwrite: bool = False, flush_steps: int = 10_000,
                 metadata: Optional[Mapping[str, Any]] = None) -> None:
        if not isinstance(flush_steps, int) or flush_steps <= 0:
            raise ValueError(f"DatasetWriter flush_steps must be an int > 0, got {flush_steps!r}")
        minari = _minari()
        from minari.dataset.minari_dataset import parse_dataset_id
        from minari.dataset.minari_storage import MinariStorage
        try:
            parse_dataset_id(dataset_id)
        except (ValueError, TypeError):
            raise DatasetError(f"dataset id {dataset_id!r} is not a Minari id: use (namespace/)name-v<version>, "
                               f"e.g. 'cartpole/expert-v0'") from None
        self.dataset_id = dataset_id
        self.path = (dataset_root(root) / dataset_id).absolute()
        if self.path.exists():
            if not overwrite:
                raise FileExistsError(f"a dataset '{dataset_id}' exists already at {self.path}: choose another id "
                                      f"(or version), or overwrite it (--overwrite, overwrite=True)")
            shutil.rmtree(self.path)
        self.observation_space, self.action_space = observation_space, action_space
        env_spec = gym.spec(env_id) if env_id is not None else None
        (self.path / "data").mkdir(parents=True)
        self._storage = MinariStorage.new(self.path / "data", observation_space=observation_space,
                                          action_space=action_space, env_spec=env_spec, data_format="hdf5",
                                          jpeg_encoding=False)
        extra = metadata
        metadata: Dict[str, Any] = {"dataset_id": dataset_id, "minari_version": minari.__version__}
        if algorithm_name is not None:
            metadata["algorithm_name"] = algorithm_name
        if description is not None:
            metadata["description"] = description
        self._storage.update_metadata(metadata)
        if extra:
            self.update_metadata(extra)
        self._flush_steps = flush_steps
        self._pending: List[Any] = []
        self._pending_steps = 0
        self.episodes_written = 0
        self.steps_written = 0
        self.episode_returns: List[float] = []  # of every episode added, in order
        self._closed = False

    def __repr__(self) -> str:
        return f"DatasetWriter({self.dataset_id!r}, episodes={self.episodes_written + len(self._pending)})"

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def steps_added(self) -> int:
        """Transitions of every episode added so far, written or pending."""
        return self.steps_written + self._pending_steps

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Add (or replace) keys of the dataset's metadata; Minari's own keys (``dataset_id``, the spaces...) are
        refused with a ``ValueError``."""
        reserved = {"dataset_id", "observation_space", "action_space", "env_spec", "data_format", "jpeg_encoding",
                    "minari_version", "total_episodes", "total_steps"}.intersection(metadata)
        if reserved:
            raise ValueError(f"DatasetWriter.update_metadata: {sorted(reserved)} are Minari's own keys; use other names")
        self._storage.update_metadata(dict(metadata))

    def add_episode(self, episode: Mapping[str, Any]) -> None:
        """Add one whole episode given as a batch of its transitions: ``obs``, ``action``, ``reward``,
        ``next_obs``, ``terminated``, ``truncated`` (numpy or tensors, leading dim = episode length)."""
        from minari.data_collector import EpisodeBuffer
        if self._closed:
            raise ValueError(f"{self!r} is closed: open a new writer to add episodes")
        ep = {k: map_nested(_numpy, episode[k]) for k in ("obs", "action", "reward", "next_obs",
                                                            "terminated", "truncated")}
        steps = len(np.asarray(ep["reward"]).reshape(-1))
        if steps == 0:
            return
        _check_continuous(self.dataset_id, ep["obs"], ep["next_obs"])
        obs = _with_final(ep["obs"], ep["next_obs"])
        self._pending.append(EpisodeBuffer(
            observations=obs, actions=ep["action"], rewards=np.asarray(ep["reward"], dtype=np.float32).reshape(-1),
            terminations=np.asarray(ep["terminated"], dtype=bool).reshape(-1),
            truncations=np.asarray(ep["truncated"], dtype=bool).reshape(-1)))
        self._pending_steps += steps
        self.episode_returns.append(float(np.sum(self._pending[-1].rewards)))
        if self._pending_steps >= self._flush_steps:
            self.flush()

    def add_dataset(self, dataset: OfflineDataset) -> None:
        """Add every episode of ``dataset`` (e.g. to turn a transitions file into a Minari dataset)."""
        for episode in dataset.episodes():
            self.add_episode(episode.as_batch())

    def flush(self) -> None:
        """Write the episodes added since the last flush."""
        if self._pending:
            self._storage.update_episodes(self._pending)
            self.episodes_written += len(self._pending)
            self.steps_written += self._pending_steps
            self._pending, self._pending_steps = [], 0

    def close(self) -> Path:
        """Write what is pending; returns the dataset's folder. Closing twice does nothing more."""
        if not self._closed:
            self.flush()
            self._closed = True
        return self.path


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def _with_final(obs: Nested, next_obs: Nested) -> Nested:
    """The T+1 observations of an episode (Minari's layout) from its T obs and T next_obs."""
    if isinstance(obs, Mapping):
        return {k: _with_final(obs[k], next_obs[k]) for k in obs}
    return np.concatenate([obs, next_obs[-1:]])


def _check_continuous(dataset_id: str, obs: Nested, next_obs: Nested) -> None:
    """Refuse an episode whose ``obs[t + 1]`` is not its ``next_obs[t]``: Minari stores each observation once."""
    for first, then in zip(leaves(obs), leaves(next_obs)):
        same = (first[1:] == then[:-1]).reshape(len(first) - 1, -1).all(axis=1)
        if not same.all():
            step = int(np.flatnonzero(~same)[0])
            raise DatasetError(f"dataset {dataset_id}: an episode's obs[{step + 1}] differs from its next_obs[{step}]; "
                               f"add whole episodes, each one continuous run of an env")
