"""Offline datasets: transitions recorded once, loaded whole, trained on many times.

An :class:`OfflineDataset` holds N transitions as numpy arrays, episodes one after another:
``observations``, ``actions``, ``rewards`` (float32), ``next_observations``, ``terminations`` and
``truncations`` (bool, kept apart: a terminated transition does not bootstrap, a truncated one does,
as everywhere in Conveyor, see ``conveyor/data/batch.py``), ``episode_ids`` and the two gymnasium spaces.

Where datasets come from (:func:`load_dataset`), nothing is ever downloaded:

- a Minari dataset (the ``minari`` package's format, what the Gymnasium ecosystem uses for offline RL),
  by id in a local dataset folder (``root``, else ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``)
  or by the path of its folder; :class:`DatasetWriter` writes them;
- a ``.npz`` or HDF5 (``.h5`` / ``.hdf5``) file of transitions, one array per field named as above (the
  D4RL names ``terminals`` / ``timeouts`` are read too), with the spaces as
  ``minari.serialization.serialize_space`` JSON (key or attribute ``observation_space`` / ``action_space``)
  or given to :func:`load_dataset`; :func:`save_dataset` writes them.
"""
from __future__ import annotations

import os
import shutil
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import gymnasium as gym
import numpy as np

from conveyor.data.batch import Nested, map_nested

__all__ = ["OfflineDataset", "DatasetError", "DatasetWriter", "load_dataset", "save_dataset", "check_spaces",
           "concat_datasets",
           "dataset_root",
           "concat_nested", "leaves"]

PathLike = Union[str, "os.PathLike[str]"]

FIELDS = ("observations", "actions", "rewards", "next_observations", "terminations", "truncations")
"""The arrays of a transitions file, one row per transition."""

_ALIASES = {"terminations": ("terminals",), "truncations": ("timeouts",)}  # D4RL's names
_FILE_SUFFIXES = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}
_INSTALL = "pip install 'conveyor[offline]'"


class DatasetError(ValueError):
    """A dataset cannot be read or used: the message names the file or dataset and what is wrong."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _minari() -> Any:
    try:
        import minari
    except ImportError as exc:  # pragma: no cover - minari is in the offline and test extras
        raise ImportError(f"Minari datasets need the minari package: {_INSTALL}") from exc
    return minari


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


def dataset_root(root: Optional[PathLike] = None) -> Path:
    """The local Minari dataset folder: ``root``, else ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``."""
    if root is not None:
        return Path(root)
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env) if env else Path.home() / ".minari" / "datasets"


def load_dataset(source: Union[PathLike, OfflineDataset], *, root: Optional[PathLike] = None,
                 observation_space: Optional[gym.Space] = None,
                 action_space: Optional[gym.Space] = None) -> OfflineDataset:
    """Load a Minari dataset (an id in the local dataset folder, or its folder's path) or a ``.npz`` / HDF5
    transitions file. ``observation_space`` / ``action_space`` are used by files that do not store them.

    A missing dataset is a ``FileNotFoundError``; a corrupt, truncated or malformed one a :class:`DatasetError`
    naming the file. An :class:`OfflineDataset` is returned as it is.
    """
    if isinstance(source, OfflineDataset):
        return source
    path = Path(source)
    kind = _FILE_SUFFIXES.get(path.suffix.lower())
    if path.is_file():
        if kind is None:
            raise DatasetError(f"{path}: not a dataset file; use a .npz, .h5 or .hdf5 transitions file "
                               f"or a Minari dataset folder")
        reader = _read_npz if kind == "npz" else _read_hdf5
        return reader(path, observation_space, action_space)
    if path.is_dir():
        return _read_minari(path)
    if kind is not None:
        raise FileNotFoundError(f"no dataset file at {path}")
    root_dir = dataset_root(root)
    folder = root_dir / str(source)
    if not folder.is_dir():
        known = sorted(p.parent.parent.relative_to(root_dir).as_posix()
                       for p in root_dir.glob("**/data/metadata.json")) if root_dir.is_dir() else []
        listing = f"local datasets: {', '.join(known)}" if known else "it holds none"
        raise FileNotFoundError(f"no dataset at {path} and no Minari dataset '{source}' in {root_dir} ({listing}); "
                                f"record one with `conveyor collect ... --dataset-id {source}` (nothing is downloaded)")
    return _read_minari(folder)


# --- Minari datasets ---------------------------------------------------------------------------------------
def _minari_data_dir(path: Path) -> Path:
    """A Minari dataset's ``data`` folder from the dataset's folder or the data folder itself."""
    if (path / "metadata.json").is_file():
        return path
    if (path / "data" / "metadata.json").is_file():
        return path / "data"
    raise DatasetError(f"{path}: not a Minari dataset folder (no data/metadata.json)")


def _read_minari(path: Path) -> OfflineDataset:
    data_dir = _minari_data_dir(path)
    minari = _minari()
    try:
        dataset = minari.MinariDataset(data_dir)
        episodes = list(dataset.iterate_episodes())
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise DatasetError(f"cannot read Minari dataset {data_dir}: {_one_line(exc)}") from None
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


def concat_nested(parts: List[Nested]) -> Nested:
    """Concatenate same-structured (nested) arrays along their first axis."""
    first = parts[0]
    if isinstance(first, Mapping):
        return {k: concat_nested([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return {str(i): concat_nested([p[i] for p in parts]) for i in range(len(first))}
    return np.concatenate(parts)


class DatasetWriter:
    """Writes episodes as a Minari dataset ``<root>/<dataset_id>/`` (``root``: see :func:`dataset_root`).

    ``dataset_id`` follows Minari's ``(namespace/)name-v<version>``; an id that exists already is refused
    unless ``overwrite``. Episodes added with :meth:`add_episode` are written every ``flush_steps``
    transitions and by :meth:`close` (also on leaving a ``with`` block); observations are stored losslessly.
    """

    def __init__(self, dataset_id: str, observation_space: gym.Space, action_space: gym.Space, *,
                 root: Optional[PathLike] = None, env_id: Optional[str] = None,
                 algorithm_name: Optional[str] = None, description: Optional[str] = None,
                 overwrite: bool = False, flush_steps: int = 10_000) -> None:
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
        metadata: Dict[str, Any] = {"dataset_id": dataset_id, "minari_version": minari.__version__}
        if algorithm_name is not None:
            metadata["algorithm_name"] = algorithm_name
        if description is not None:
            metadata["description"] = description
        self._storage.update_metadata(metadata)
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


# --- transitions files ------------------------------------------------------------------------------------
def save_dataset(dataset: OfflineDataset, path: PathLike) -> Path:
    """Write ``dataset`` as a ``.npz`` or HDF5 (``.h5`` / ``.hdf5``) transitions file, spaces included."""
    path = Path(path)
    kind = _FILE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DatasetError(f"{path}: unknown file type; name it .npz, .h5 or .hdf5 (or write a Minari dataset "
                           f"with DatasetWriter)")
    if isinstance(dataset.observations, Mapping):
        raise DatasetError(f"{path}: transitions files hold array observations only; store Dict observations "
                           f"as a Minari dataset (DatasetWriter)")
    from minari.serialization import serialize_space
    arrays = {name: getattr(dataset, name) for name in FIELDS}
    arrays["episode_ids"] = dataset.episode_ids
    spaces = {"observation_space": serialize_space(dataset.observation_space),
              "action_space": serialize_space(dataset.action_space)}
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "npz":
        with open(path, "wb") as f:
            np.savez(f, **arrays, **{k: np.asarray(v) for k, v in spaces.items()})
    else:
        import h5py
        with h5py.File(path, "w") as f:
            for name, array in arrays.items():
                f.create_dataset(name, data=array)
            f.attrs.update(spaces)
    return path


def _space(path: Path, stored: Any, given: Optional[gym.Space], name: str) -> gym.Space:
    if given is not None:
        return given
    if stored is None:
        raise DatasetError(f"{path} stores no {name}: pass {name}=... to load_dataset, or write the file with "
                           f"save_dataset()")
    from minari.serialization import deserialize_space
    try:
        return deserialize_space(str(stored))
    except (ValueError, KeyError, TypeError, NotImplementedError) as exc:
        raise DatasetError(f"{path}: {name} is not a serialized gymnasium space ({_one_line(exc)})") from None


def _pick(path: Path, arrays: Mapping[str, Any], name: str) -> Any:
    for key in (name, *_ALIASES.get(name, ())):
        if key in arrays:
            return arrays[key]
    raise DatasetError(f"{path} has no '{name}' array (it holds: {', '.join(sorted(arrays)) or 'nothing'}); "
                       f"a transitions file needs {', '.join(FIELDS)}")


_READ_ERRORS = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error)


def _from_arrays(path: Path, arrays: Mapping[str, Any], obs_space: Any, act_space: Any) -> OfflineDataset:
    return OfflineDataset(**{name: np.asarray(_pick(path, arrays, name)) for name in FIELDS},
                          observation_space=obs_space, action_space=act_space,
                          episode_ids=arrays.get("episode_ids"), source=str(path))


def _read_npz(path: Path, observation_space: Optional[gym.Space], action_space: Optional[gym.Space]) -> OfflineDataset:
    if not zipfile.is_zipfile(path):  # else numpy reads it as a pickle and complains about pickles
        raise DatasetError(f"cannot read {path}: corrupt or truncated .npz file (not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except _READ_ERRORS as exc:
        raise DatasetError(f"cannot read {path}: corrupt or truncated .npz file ({_one_line(exc)})") from None
    spaces = [_space(path, arrays.pop(key, None), given, key) for key, given in
              (("observation_space", observation_space), ("action_space", action_space))]
    return _from_arrays(path, arrays, *spaces)


def _read_hdf5(path: Path, observation_space: Optional[gym.Space], action_space: Optional[gym.Space]) -> OfflineDataset:
    import h5py
    try:
        with h5py.File(path, "r") as f:
            arrays = {key: f[key][()] for key in f.keys() if isinstance(f[key], h5py.Dataset)}
            attrs = {key: f.attrs.get(key) for key in ("observation_space", "action_space")}
    except _READ_ERRORS as exc:
        raise DatasetError(f"cannot read {path}: corrupt or truncated HDF5 file ({_one_line(exc)})") from None
    spaces = [_space(path, attrs[key], given, key) for key, given in
              (("observation_space", observation_space), ("action_space", action_space))]
    return _from_arrays(path, arrays, *spaces)
