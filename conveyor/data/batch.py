"""Batches: the one data layout collectors, buffers and policies share.

Observations arrive from env managers as numpy arrays with a leading env dimension, or, for
``Dict``/``Tuple`` spaces, as dicts (tuples become dicts keyed ``"0"``, ``"1"``, ...) of such arrays.
A batch of transitions is a ``treetensor.torch.Tensor`` tree whose leaves share the leading
batch dimensions. Trees are built once per batch, never per transition.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import treetensor.torch as ttorch

try:  # builds a tree's storage straight from a dict, skipping ttorch's per-leaf conversion pass
    from treevalue.tree.common import create_storage as _create_storage
except ImportError:  # pragma: no cover - should treevalue move it, trees are still built, only slower
    _create_storage = None

__all__ = ["Nested", "map_nested", "to_tensor", "to_device", "to_host", "to_numpy", "stack_nested", "concat_nested", "as_tree",
           "tree_of_tensors", "flatten_batch", "sample_dim"]

Nested = Any  # an array, or a dict of Nested


def map_nested(fn: Callable[[Any], Any], data: Nested) -> Nested:
    """Apply ``fn`` to every leaf of a nested dict (tuples/lists are treated as dicts keyed by index)."""
    if isinstance(data, (np.ndarray, torch.Tensor)):  # the common leaf first: the Mapping check is an ABC's, ~1 µs
        return fn(data)
    if isinstance(data, Mapping):
        return {k: map_nested(fn, v) for k, v in data.items()}
    if isinstance(data, (tuple, list)) and data and not np.isscalar(data[0]):
        return {str(i): map_nested(fn, v) for i, v in enumerate(data)}
    return fn(data)


def to_tensor(data: Nested, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Any:
    """Numpy (nested) data to torch: a plain tensor for an array, a ttorch tree for a dict.

    Uses ``torch.from_numpy`` (no copy on CPU); float64 becomes float32 unless ``dtype`` says otherwise. To a CUDA
    ``device``, host leaves go through pinned (page-locked) memory and are copied asynchronously, one copy per leaf.
    """
    target = None if device is None else torch.device(device)

    def leaf(x: Any) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        elif t.dtype == torch.float64:
            t = t.float()
        return t if target is None else to_device(t, target)

    if isinstance(data, ttorch.Tensor):
        return data if device is None and dtype is None else ttorch.Tensor(map_nested(leaf, _tree_to_dict(data)))
    if isinstance(data, (Mapping, tuple, list)) and not isinstance(data, np.ndarray):
        tensors = map_nested(leaf, data)
        return tree_of_tensors(tensors) if isinstance(tensors, dict) else ttorch.Tensor(tensors)
    return leaf(data)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from host memory to CUDA through pinned memory with a non-blocking copy, so the
    transfer runs by DMA at full speed and overlaps the work queued before it (the copy is ordered on the stream)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
    return pinned.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """``tensors`` as numpy arrays, in one trip back from the device: from CUDA every copy is queued non-blocking
    (into pinned memory) and the stream is synchronised once, so an acting step waits for the GPU once rather
    than once per output."""
    cuda = [t.device for t in tensors if t.is_cuda]
    host = [t.detach().to("cpu", non_blocking=bool(cuda)) for t in tensors]
    for device in set(cuda):
        torch.cuda.current_stream(device).synchronize()
    return tuple(t.numpy() for t in host)


def to_numpy(data: Any) -> Nested:
    """A tensor or ttorch tree back to numpy (a dict of arrays for a tree)."""
    if isinstance(data, ttorch.Tensor):
        return map_nested(lambda t: t.detach().cpu().numpy(), _tree_to_dict(data))
    if isinstance(data, torch.Tensor):
        return data.detach().cpu().numpy()
    if isinstance(data, Mapping):
        return {k: to_numpy(v) for k, v in data.items()}
    return np.asarray(data)


def _tree_to_dict(tree: ttorch.Tensor) -> dict:
    out = {}
    for key, value in tree.items():
        out[key] = _tree_to_dict(value) if isinstance(value, ttorch.Tensor) else value
    return out


def stack_nested(items: Sequence[Nested], axis: int = 0) -> Nested:
    """Stack a sequence of same-structured (nested) numpy arrays along a new axis."""
    first = items[0]
    if isinstance(first, dict) or (not isinstance(first, np.ndarray) and isinstance(first, Mapping)):
        return {k: stack_nested([it[k] for it in items], axis) for k in first}
    # np.array builds the stacked array in C, about 3x faster than np.stack on the small arrays collectors
    # stack once per call; like np.stack it raises ValueError when the shapes differ.
    return np.array(items) if axis == 0 else np.stack(items, axis=axis)


def concat_nested(items: Sequence[Nested]) -> Nested:
    """Join a sequence of same-structured (nested) numpy arrays along their first axis (batches of rows)."""
    first = items[0]
    if isinstance(first, dict) or (not isinstance(first, np.ndarray) and isinstance(first, Mapping)):
        return {k: concat_nested([it[k] for it in items]) for k in first}
    return np.concatenate(items)


def as_tree(data: Mapping[str, Any]) -> ttorch.Tensor:
    """A dict of (nested) numpy arrays or tensors as one ttorch tree of tensors."""
    return to_tensor(data)


def tree_of_tensors(data: Mapping[str, Any]) -> ttorch.Tensor:
    """A nested dict whose leaves are already torch tensors as a ttorch tree, without copying them.

    Skips the per-leaf conversion of ``as_tree`` (about 2 us a leaf), for hot paths such as sampling.
    """
    if _create_storage is None:
        return ttorch.Tensor(data)
    return ttorch.Tensor(_create_storage(data))


def flatten_batch(batch: ttorch.Tensor, ndim: int) -> ttorch.Tensor:
    """Merge the first ``ndim`` leading dimensions of every leaf (e.g. ``[T, N, ...] -> [T*N, ...]``)."""
    if ndim <= 1:
        return batch
    return batch.flatten(0, ndim - 1) if isinstance(batch, torch.Tensor) else \
        ttorch.Tensor(map_nested(lambda t: t.flatten(0, ndim - 1), _tree_to_dict(batch)))


def sample_dim(train_data: Any) -> int:
    """The dim along which a batch of training data holds its samples: 1 for a recurrent policy's sequences
    ``[L, B]`` (they carry ``episode_start``: conveyor.middleware.gae_estimator), 0 for rows (transitions ``[B]``,
    IMPALA's unrolls ``[U, T]``). Minibatches take whole samples, and batches from several collectors join along it."""
    return 1 if "episode_start" in train_data else 0
