"""Transitions files: a ``.npz`` or HDF5 (``.h5`` / ``.hdf5``) file, one array per field of
:data:`~conveyor.data.dataset.FIELDS` (the D4RL names ``terminals`` / ``timeouts`` are read too), with the
spaces as ``minari.serialization.serialize_space`` JSON (key or attribute ``observation_space`` /
``action_space``) or given by the reader.
"""
from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import gymnasium as gym
import numpy as np

from conveyor.data.dataset import FIELDS, DatasetError, OfflineDataset, one_line

__all__ = ["FILE_SUFFIXES", "read_transitions", "save_dataset"]

PathLike = Union[str, "os.PathLike[str]"]

FILE_SUFFIXES = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}
"""The suffixes of transitions files, and their kind."""
_ALIASES = {"terminations": ("terminals",), "truncations": ("timeouts",)}  # D4RL's names


def save_dataset(dataset: OfflineDataset, path: PathLike) -> Path:
    """Write ``dataset`` as a ``.npz`` or HDF5 (``.h5`` / ``.hdf5``) transitions file, spaces included."""
    path = Path(path)
    kind = FILE_SUFFIXES.get(path.suffix.lower())
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
        raise DatasetError(f"{path}: {name} is not a serialized gymnasium space ({one_line(exc)})") from None


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
        raise DatasetError(f"cannot read {path}: corrupt or truncated .npz file ({one_line(exc)})") from None
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
        raise DatasetError(f"cannot read {path}: corrupt or truncated HDF5 file ({one_line(exc)})") from None
    spaces = [_space(path, attrs[key], given, key) for key, given in
              (("observation_space", observation_space), ("action_space", action_space))]
    return _from_arrays(path, arrays, *spaces)


def read_transitions(path: Path, observation_space: Optional[gym.Space] = None,
                     action_space: Optional[gym.Space] = None) -> OfflineDataset:
    """The dataset in the transitions file ``path`` (its kind from its suffix, one of :data:`FILE_SUFFIXES`)."""
    reader = _read_npz if FILE_SUFFIXES[path.suffix.lower()] == "npz" else _read_hdf5
    return reader(path, observation_space, action_space)
