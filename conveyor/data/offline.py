"""Offline datasets: transitions recorded once, loaded whole, trained on many times.

An :class:`~conveyor.data.dataset.OfflineDataset` holds N transitions as numpy arrays, episodes one
after another (:mod:`conveyor.data.dataset`). This module loads one from wherever it was stored, and
gathers the dataset names in one place.

Where datasets come from (:func:`load_dataset`), nothing is ever downloaded:

- a Minari dataset (the ``minari`` package's format, what the Gymnasium ecosystem uses for offline RL),
  by id in a local dataset folder (``root``, else ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``)
  or by the path of its folder; :class:`DatasetWriter` writes them
  (:mod:`conveyor.data.minari_datasets`);
- a ``.npz`` or HDF5 (``.h5`` / ``.hdf5``) file of transitions, one array per field of the dataset (the
  D4RL names ``terminals`` / ``timeouts`` are read too), with the spaces as
  ``minari.serialization.serialize_space`` JSON (key or attribute ``observation_space`` / ``action_space``)
  or given to :func:`load_dataset`; :func:`save_dataset` writes them (:mod:`conveyor.data.transition_files`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import gymnasium as gym

from conveyor.data.dataset import (FIELDS, DatasetError, OfflineDataset, check_spaces, concat_datasets, concat_nested,
                                   leaves)
from conveyor.data.minari_datasets import DatasetWriter, dataset_root, read_metadata, read_minari
from conveyor.data.transition_files import FILE_SUFFIXES, read_transitions, save_dataset

__all__ = ["OfflineDataset", "DatasetError", "DatasetWriter", "load_dataset", "save_dataset", "check_spaces",
           "concat_datasets", "dataset_root", "dataset_metadata", "concat_nested", "leaves", "FIELDS"]

PathLike = Union[str, "os.PathLike[str]"]


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
    kind = FILE_SUFFIXES.get(path.suffix.lower())
    if path.is_file():
        if kind is None:
            raise DatasetError(f"{path}: not a dataset file; use a .npz, .h5 or .hdf5 transitions file "
                               f"or a Minari dataset folder")
        return read_transitions(path, observation_space, action_space)
    if path.is_dir():
        return read_minari(path)
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
    return read_minari(folder)


def dataset_metadata(dataset_id: PathLike, *, root: Optional[PathLike] = None) -> dict:
    """The metadata of a Minari dataset (an id in the local dataset folder, see :func:`load_dataset`, or its
    folder's path). A missing dataset is a ``FileNotFoundError``."""
    path = Path(dataset_id)
    if not path.is_dir():
        path = dataset_root(root) / dataset_id
    if not path.is_dir():
        raise FileNotFoundError(f"no Minari dataset '{dataset_id}' in {dataset_root(root)}")
    return read_metadata(path)
