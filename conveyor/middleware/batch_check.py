"""Batches received from other nodes: counted, merged (several collectors' into one), and checked against the
env's spaces before they reach a buffer or a loss.

A peer with the secret can send batches in the right layout holding values no env could have produced: an
action a ``Discrete(2)`` space does not have (the learner's indexing would end the run), NaN observations or
infinite rewards (they would turn every weight into NaN). :class:`SpaceCheck` finds them, so the exchanger
drops such a batch whole (:class:`~conveyor.middleware.messages.BadMessage`). It imports no torch: a received
tensor is read through its numpy view.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, Iterator, List, Tuple

from conveyor.middleware.messages import BadMessage

__all__ = ["SpaceCheck", "count_transitions", "end_indices", "held_transitions", "merge_batches", "merge_end_idx"]

OBSERVATION_KEYS = ("obs", "next_obs")
"""The keys of a batch that hold observations (:mod:`conveyor.data.batch`)."""
FLAG_KEYS = ("terminated", "truncated", "done", "valid")
"""The keys of a batch that hold 0/1 flags."""
_SLACK = 1e-5  # relative: how far past a Box's bound an action may round (float32 has 24 bits)


def count_transitions(trajectories: Any) -> int:
    """How many transitions a batch of trajectories holds: the size of its leading dims (``reward``'s shape), or the
    length of DI-engine's form, a list of transitions."""
    if isinstance(trajectories, list):
        return len(trajectories)
    try:
        return math.prod(trajectories["reward"].shape)
    except (KeyError, IndexError, TypeError, AttributeError):
        raise BadMessage("its trajectory_end_idx comes with trajectories without a 'reward' array to count them by") \
            from None


def held_transitions(payload: Dict[str, Any], rows: Dict[str, int]) -> int:
    """How many transitions a checked batch holds at most: its trajectories', its training data's (``reward``'s
    size, else their first dim: ``rows``), or its episodes' together."""
    counts = [sum(_held_in(ep, 0) for ep in payload["episodes"] or ())]
    counts += [_held_in(payload[name], rows.get(name, 0)) for name in ("trajectories", "train_data")
               if payload[name] is not None]
    return max(counts)


def _held_in(batch: Any, rows: int) -> int:
    try:
        return math.prod(batch["reward"].shape)
    except (KeyError, IndexError, TypeError, AttributeError):
        return rows


def end_indices(value: Any) -> Any:
    """``value`` as a 1-D array of indices >= 0 if it is one, or DI-engine's form of one, a list of ints; else None."""
    if isinstance(value, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 63 for i in value):
            return None
        import numpy as np  # here: a list of ints may arrive before numpy was needed
        return np.array(value, dtype=np.int64)
    np = sys.modules.get("numpy")
    is_indices = np is not None and isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu" \
        and (value.size == 0 or int(value.min()) >= 0)
    return value if is_indices else None


def merge_end_idx(payloads: List[Dict[str, Any]]) -> Any:
    """The received ``trajectory_end_idx`` as flat indices into the merged trajectories (each collector's shifted
    by the transitions before its own), a list of ints with DI-engine's lists of transitions, else an array; None
    unless every batch of trajectories came with them."""
    sent = [p for p in payloads if p["trajectories"] is not None]
    if not sent or any(p.get("trajectory_end_idx") is None for p in sent):
        return None
    np = sys.modules["numpy"]  # the arrays received are numpy's (a list of indices became one on receipt)
    offsets = np.cumsum([0] + [count_transitions(p["trajectories"]) for p in sent[:-1]])
    merged = np.concatenate([p["trajectory_end_idx"] + offset for p, offset in zip(sent, offsets)])
    return merged.tolist() if isinstance(sent[0]["trajectories"], list) else merged


def merge_batches(batches: List[Any], by_sample_dim: bool = False) -> Any:
    """The collectors' batches joined on their first dim, or (``by_sample_dim``: training data) on their sample dim
    (:func:`conveyor.data.batch.sample_dim`: a recurrent policy's sequences ``[L, B]`` side by side)."""
    if len(batches) <= 1:
        return batches[0] if batches else None
    if isinstance(batches[0], list):  # DI-engine's lists of transitions (every batch is one: same layout)
        return [item for batch in batches for item in batch]
    import treetensor.torch as ttorch  # here: these modules import no torch until data arrives

    from conveyor.data.batch import sample_dim
    dim = sample_dim(batches[0]) if by_sample_dim else 0
    try:
        return ttorch.cat(batches, dim=dim)
    except Exception as e:
        raise ValueError(f"ContextExchanger: trajectories from several collectors do not concatenate along their "
                         f"dim {dim} ({type(e).__name__}: {e}); give every collector the same env count") from None


def _leaves(value: Any, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], Any]]:
    """Every array of a (nested) batch with its key path; a dict, a treetensor tree or a list/tuple of them."""
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if np is not None and isinstance(value, np.ndarray):
        yield path, value
    elif torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        yield path, (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, str(i)))
    elif callable(getattr(value, "items", None)):
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))


class SpaceCheck:
    """``check(name, batch)`` raises :class:`BadMessage` unless every array of ``batch`` (leading batch dims,
    then a transition's) could come from envs with these spaces: ``obs`` / ``next_obs`` of the observation
    space's shape and kind (float or integer; its leaves', for a ``Dict`` / ``Tuple`` space), ``action`` inside
    the action space (a ``Discrete``'s or ``MultiDiscrete``'s range, a ``Box``'s shape and bounds), the flags
    (``terminated``, ``truncated``, ``done``, ``valid``) 0 or 1, and every float array finite."""

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        from gymnasium import spaces  # here: gymnasium is loaded wherever spaces exist
        self._spaces = spaces
        self.observation_space, self.action_space = observation_space, action_space

    def __repr__(self) -> str:
        return f"SpaceCheck({self.observation_space}, {self.action_space})"

    def __call__(self, name: str, batch: Any) -> None:
        np = sys.modules["numpy"]
        if isinstance(batch, list):  # DI-engine's form: a list of transitions, each a batch of one
            leaves = ((path[1:], np.expand_dims(array, 0)) for path, array in _leaves(batch))
        else:
            leaves = _leaves(batch)
        for path, array in leaves:
            where = f"its {name}.{'.'.join(path)}"
            kind = array.dtype.kind
            if kind not in "biuf":
                raise BadMessage(f"{where} has dtype {array.dtype}, not a number")
            if kind == "f" and not np.isfinite(array).all():
                raise BadMessage(f"{where} holds NaN or infinite values")
            if path and path[-1] in FLAG_KEYS and kind != "b" and array.size and not np.isin(array, (0, 1)).all():
                raise BadMessage(f"{where} holds values other than 0 and 1")
            if path and path[0] in OBSERVATION_KEYS:
                self._check_value(where, array, self._leaf_space(self.observation_space, path[1:]))
            elif path == ("action",):
                self._check_value(where, array, self.action_space, bounded=True)

    def _leaf_space(self, space: Any, path: Tuple[str, ...]) -> Any:
        """The leaf of a nested space at ``path`` (dicts for ``Dict``, ``"0"``, ``"1"``... for ``Tuple``); None
        where the path leads nowhere in it."""
        spaces = self._spaces
        for key in path:
            if isinstance(space, spaces.Dict) and key in space.spaces:
                space = space.spaces[key]
            elif isinstance(space, spaces.Tuple) and key.isdigit() and int(key) < len(space.spaces):
                space = space.spaces[int(key)]
            else:
                return None
        return space

    def _check_value(self, where: str, array: Any, space: Any, bounded: bool = False) -> None:
        np, spaces = sys.modules["numpy"], self._spaces
        if space is None or not isinstance(space, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete,
                                                    spaces.MultiBinary)):
            raise BadMessage(f"{where} is not part of the space {self.observation_space if space is None else space}")
        shape = tuple(space.shape)
        if array.ndim <= len(shape) or tuple(array.shape[array.ndim - len(shape):]) != shape:
            raise BadMessage(f"{where} has shape {tuple(array.shape)}: a batch of {space} has [..., *{shape}]")
        if (array.dtype.kind == "f") != (np.dtype(space.dtype).kind == "f"):
            raise BadMessage(f"{where} has dtype {array.dtype}, but {space} holds {space.dtype}")
        if not bounded or not array.size:
            return
        if isinstance(space, spaces.Discrete):
            low, high = int(space.start), int(space.start) + int(space.n) - 1
        elif isinstance(space, spaces.MultiDiscrete):
            start = np.asarray(getattr(space, "start", 0))
            low, high = start, start + np.asarray(space.nvec) - 1
        elif isinstance(space, spaces.MultiBinary):
            low, high = 0, 1
        else:  # a policy's squashed or clipped action may round past a bound by a few ulps
            low = space.low - _SLACK * np.maximum(1, abs(space.low))
            high = space.high + _SLACK * np.maximum(1, abs(space.high))
        if not ((array >= low) & (array <= high)).all():
            raise BadMessage(f"{where} holds values outside {space}")
