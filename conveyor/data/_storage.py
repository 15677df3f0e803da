"""Ring storage for nested transitions: one preallocated numpy array per leaf.

A transition such as ``{"obs": {"image": ..., "state": ...}, "reward": ...}`` is flattened to leaf
paths (``("obs", "image")``, ...). The first data seen fixes the paths, each leaf's shape and its
dtype; every array has shape ``(capacity, *leaf_shape)``. Later data must match, so a mistake shows
up at the write that made it, naming the key, rather than as a bad batch much later.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from treevalue import TreeValue

KeyPath = tuple[str, ...]

_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex: what numpy and torch both hold
_PY_SCALAR_KINDS = {bool: "biuf", int: "iuf", float: "fc"}  # where a Python scalar may be written
_PY_SCALAR_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64), float: np.dtype(np.float32)}


def dotted(path: KeyPath) -> str:
    """A leaf path as users write it in errors: ``obs.image``."""
    return ".".join(path)


_LEAF_TYPES = (np.ndarray, np.generic, torch.Tensor, bool, int, float)  # checked first: the common, fast case


def _is_branch(value: Any) -> bool:
    if isinstance(value, _LEAF_TYPES):
        return False
    if isinstance(value, (dict, TreeValue, Mapping)):
        return True
    # as in batch.map_nested: a tuple/list of arrays is a branch keyed "0", "1", ...; of scalars, a leaf
    return isinstance(value, (tuple, list)) and len(value) > 0 and not np.isscalar(value[0])


def unflatten(paths: list[KeyPath], values: list[Any]) -> dict:
    """The nested dict whose leaves at ``paths`` are ``values`` (the inverse of :func:`flatten`)."""
    out: dict = {}
    for path, value in zip(paths, values):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def flatten(data: Any, where: str) -> dict[KeyPath, Any]:
    """The leaves of a nested dict / ttorch tree, keyed by path."""
    if not isinstance(data, (dict, TreeValue, Mapping)):
        raise TypeError(
            f"{where} takes a dict of arrays (nested dicts allowed) or a ttorch tree, "
            f"got {type(data).__name__}")
    out: dict[KeyPath, Any] = {}
    _flatten_into(data, (), out, where)
    if not out:
        raise ValueError(f"{where}: the data holds no arrays (an empty dict); pass a transition such as "
                         f"{{'obs': ..., 'action': ..., 'reward': ...}}")
    return out


def _flatten_into(data: Any, prefix: KeyPath, out: dict[KeyPath, Any], where: str) -> None:
    items = enumerate(data) if isinstance(data, (tuple, list)) else data.items()
    for key, value in items:
        if isinstance(key, str):
            pass
        elif isinstance(key, int):  # a tuple's position, as in batch.map_nested
            key = str(key)
        else:
            raise TypeError(f"{where}: key {key!r} under '{dotted(prefix) or '<top>'}' is not a str; "
                            f"transitions are keyed by strings")
        path = prefix + (key,)
        if _is_branch(value):
            _flatten_into(value, path, out, where)
        else:
            out[path] = value


def to_array(value: Any) -> np.ndarray:
    """A leaf as numpy: tensors without a copy on CPU; Python floats (and lists of them) as float32."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    scalar_dtype = _PY_SCALAR_DTYPES.get(type(value))  # exact type: np.float64 subclasses float
    if scalar_dtype is not None:
        return np.asarray(value, dtype=scalar_dtype)
    array = np.asarray(value)
    if array.dtype == np.float64 and isinstance(value, (list, tuple)):
        array = array.astype(np.float32)
    return array


class RingStorage:
    """Preallocated per-leaf arrays of ``capacity`` rows, allocated from the first data written."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.paths: list[KeyPath] = []
        self.specs: list[tuple[tuple[int, ...], np.dtype]] = []  # each leaf's per-transition shape and dtype
        self.arrays: list[np.ndarray] = []
        self._path_set: frozenset[KeyPath] = frozenset()

    @property
    def allocated(self) -> bool:
        """Whether the first data has fixed the layout."""
        return bool(self.arrays)

    def allocate(self, leaves: dict[KeyPath, np.ndarray], batched: bool, where: str) -> None:
        """Fix paths, shapes and dtypes from the first data (per transition, or per row when batched)."""
        for path, array in leaves.items():
            if array.dtype.kind not in _NUMERIC_KINDS:
                raise TypeError(f"{where}: key '{dotted(path)}' holds {array.dtype} data; "
                                f"the buffer stores numbers and bools only")
        self.paths = list(leaves)
        self._path_set = frozenset(self.paths)
        self.specs = [(tuple(a.shape[1:] if batched else a.shape), a.dtype) for a in leaves.values()]
        self.arrays = [self._new_array(path, shape, dtype) for path, (shape, dtype) in zip(self.paths, self.specs)]

    def _new_array(self, path: KeyPath, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The ring array of one leaf (a subclass may store something else per row, e.g. frame ids)."""
        return np.zeros((self.capacity, *shape), dtype=dtype)

    def reset(self) -> None:
        """Forget the layout and free the arrays."""
        self.paths, self.specs, self.arrays, self._path_set = [], [], [], frozenset()

    def layout(self) -> str:
        """The stored leaves with their per-transition shapes and dtypes, for error messages."""
        return ", ".join(f"{dotted(p)}: {dtype}{list(shape)}" for p, (shape, dtype) in zip(self.paths, self.specs))

    def state(self, length: int) -> dict:
        """Copies of the first ``length`` rows as a nested dict under ``"storage"`` (None before the first data)."""
        if not self.allocated:
            return {"storage": None}
        return {"storage": unflatten(self.paths, [a[:length].copy() for a in self.arrays])}

    def load(self, state: dict, where: str) -> None:
        """Refill a reset storage from :meth:`state`: rows from slot 0 on."""
        if state.get("frames") is not None:
            raise ValueError(f"{where}: the state was saved by a buffer with frame_stack (deduplicated frames); "
                             f"build this one with the same frame_stack to load it")
        if state["storage"] is not None:
            arrays = {p: np.asarray(a) for p, a in flatten(state["storage"], where).items()}
            self.allocate(arrays, batched=True, where=where)
            self.write_rows(0, list(arrays.values()), begin=0)

    def match(self, flat: dict[KeyPath, Any], batched: bool, where: str) -> list[np.ndarray]:
        """The leaves of ``flat`` in storage order as arrays, checked against the stored layout."""
        if flat.keys() != self._path_set:
            missing = sorted(dotted(p) for p in self._path_set - flat.keys())
            extra = sorted(dotted(p) for p in flat.keys() - self._path_set)
            raise ValueError(
                f"{where}: the data's keys differ from the buffer's"
                + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else "")
                + f". Every transition must have the keys of the first one ({self.layout()}); "
                f"clear() the buffer to store a new layout")
        out = []
        for path, (stored_shape, stored_dtype) in zip(self.paths, self.specs):
            value = flat[path]
            array = to_array(value)
            if batched and array.ndim == 0:
                raise ValueError(f"{where}: key '{dotted(path)}' is a scalar; extend() takes a batch with "
                                 f"a leading dim on every leaf (use push() for one transition)")
            shape = array.shape[1:] if batched else array.shape
            if shape != stored_shape:
                hint = ""
                if batched and array.ndim == len(stored_shape) + 2:
                    hint = "; extend() takes one leading batch dim: merge [T, N, ...] with flatten_batch(batch, 2)"
                raise ValueError(
                    f"{where}: key '{dotted(path)}' has shape {tuple(array.shape)}, but the buffer stores "
                    f"{stored_shape} per transition (the shape of the first data){hint}")
            if array.dtype != stored_dtype:
                array = self._cast(value, array, stored_dtype, path, where)
            out.append(array)
        if batched and len({len(a) for a in out}) > 1:
            lengths = ", ".join(f"{dotted(p)}: {len(a)}" for p, a in zip(self.paths, out))
            raise ValueError(f"{where}: leaves have different leading (batch) dims ({lengths}); "
                             f"every leaf needs one row per transition")
        return out

    @staticmethod
    def _cast(value: Any, array: np.ndarray, dtype: np.dtype, path: KeyPath, where: str) -> np.ndarray:
        """Allow a dtype change within its kind (float into int is refused); the write itself casts.

        A Python scalar is converted from its own value, not its default dtype, so 0.1 into a float64
        key stays exact.
        """
        kinds = _PY_SCALAR_KINDS.get(type(value))
        allowed = dtype.kind in kinds if kinds else np.can_cast(array.dtype, dtype, "same_kind")
        if not allowed:
            raise ValueError(
                f"{where}: key '{dotted(path)}' holds {array.dtype} data, but the buffer stores {dtype} "
                f"(the dtype of the first data); convert it first, e.g. np.asarray(x, dtype=np.{dtype})")
        return np.asarray(value, dtype=dtype) if kinds else array

    def write_one(self, slot: int, values: list[np.ndarray]) -> None:
        """Store one transition at ``slot``."""
        for stored, value in zip(self.arrays, values):
            stored[slot] = value

    def write_rows(self, start: int, values: list[np.ndarray], begin: int) -> None:
        """Store rows ``begin:`` of a batch from ``start`` on, wrapping past the end of the ring."""
        n = len(values[0]) - begin if values else 0
        first = min(n, self.capacity - start)
        for stored, value in zip(self.arrays, values):
            stored[start:start + first] = value[begin:begin + first]
            if n > first:
                stored[:n - first] = value[begin + first:]

    def gather(self, slots: np.ndarray) -> list[torch.Tensor]:
        """Fresh tensors holding the rows at ``slots`` of every leaf."""
        return [torch.from_numpy(stored.take(slots, axis=0)) for stored in self.arrays]
