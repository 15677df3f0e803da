"""``SequenceBuffer``: a replay buffer of fixed-length sequences cut from collected ``[T, N]`` chunks.

Recurrent learners (QMIX's GRU agents) learn from sequences ``[L, B]`` that start where an episode starts, because
an unroll begins from a zero recurrent state. ``extend`` cuts each env's column of a time-major chunk at every
episode end (``done``, else ``terminated | truncated``) and around every step that does not count
(``valid`` False, a crashed env's), then every ``L`` steps, and pads each piece to ``L`` steps with zeros and
``mask`` False. Each piece is one row of a :class:`~conveyor.data.DequeBuffer` whose leaves are ``[L, ...]``, so
storage, eviction (the oldest sequence first), sampling, seeding and ``state_dict`` are that buffer's own; this
class adds only the cutting and the time-major view of a sample. A piece starts at an episode start when the
chunk's column does (collect ``n_sample = env_num * episode_length`` for fixed-length episodes) or after an
episode end inside the chunk; otherwise it starts mid-episode, from a zero state.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any

import numpy as np
import treetensor.torch as ttorch

from conveyor.data._storage import flatten, to_array, unflatten
from conveyor.data.buffer import DequeBuffer

__all__ = ["SequenceBuffer"]

_STATE_VERSION = 1


def _cuts(ends: np.ndarray, valid: np.ndarray, length: int) -> list[tuple[int, int]]:
    """``(begin, end)`` step ranges of one env's column: runs of valid steps split after each episode end and
    every ``length`` steps."""
    pieces: list[tuple[int, int]] = []
    begin = None
    for t in range(len(ends)):
        if not valid[t]:
            if begin is not None:
                pieces.append((begin, t))
            begin = None
            continue
        if begin is None:
            begin = t
        if ends[t] or t + 1 - begin == length:
            pieces.append((begin, t + 1))
            begin = None
    if begin is not None:
        pieces.append((begin, len(ends)))
    return pieces


class SequenceBuffer:
    """At most ``size`` sequences of ``sequence_length`` steps; ``sample(n)`` gives a time-major batch ``[L, n]``
    with ``mask`` (False on padding) and ``index`` ``[n]`` (see the module doc). ``seed`` makes sampling
    reproducible. Thread-safe as its :class:`~conveyor.data.DequeBuffer` is.
    """

    sequences = True  # pushers hand it whole time-major chunks (data_pusher), not flattened transitions
    prioritized = False

    def __init__(self, size: int, sequence_length: int, *, seed: int | None = None) -> None:
        if not isinstance(sequence_length, Integral) or isinstance(sequence_length, bool) or sequence_length <= 0:
            raise ValueError(f"SequenceBuffer sequence_length must be a positive int (steps per sequence, e.g. the "
                             f"episode length 25 of simple_spread_v3), got {sequence_length!r}")
        self._length = int(sequence_length)
        self._rows = DequeBuffer(size, seed=seed)

    @property
    def size(self) -> int:
        """The capacity: the most sequences kept."""
        return self._rows.size

    @property
    def sequence_length(self) -> int:
        """Steps per stored sequence (shorter pieces are padded)."""
        return self._length

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"SequenceBuffer(size={self.size}, sequence_length={self._length}, len={len(self)})"

    def extend(self, chunk: Any) -> None:
        """Cut a time-major chunk (every leaf ``[T, N, ...]``: a collector's ``trajectories``) into padded sequences
        and store them in order; of more than ``size``, the newest stay."""
        where = "SequenceBuffer.extend"
        leaves = {path: to_array(value) for path, value in flatten(chunk, where).items()}
        if ("reward",) not in leaves or leaves[("reward",)].ndim < 2:
            raise ValueError(f"{where} takes a time-major chunk with 'reward' [T, N, ...] (a collector's "
                             f"trajectories), got keys {sorted('.'.join(p) for p in leaves)}")
        steps, envs = leaves[("reward",)].shape[:2]
        valid = leaves.pop(("valid",), np.ones((steps, envs), dtype=bool)).astype(bool)
        if ("done",) in leaves:
            ends = leaves[("done",)].astype(bool)
        else:
            ends = leaves[("terminated",)].astype(bool) | leaves.get(("truncated",), np.zeros_like(valid)).astype(bool)
        pieces = [(n, begin, end) for n in range(envs) for begin, end in _cuts(ends[:, n], valid[:, n], self._length)]
        if not pieces:
            return
        rows: dict[tuple[str, ...], np.ndarray] = {}
        for path, array in leaves.items():
            if array.shape[:2] != (steps, envs):
                raise ValueError(f"{where}: key '{'.'.join(path)}' has shape {array.shape}; every leaf needs the "
                                 f"chunk's leading dims [T, N] = [{steps}, {envs}]")
            rows[path] = np.zeros((len(pieces), self._length, *array.shape[2:]), dtype=array.dtype)
        mask = np.zeros((len(pieces), self._length), dtype=bool)
        for row, (n, begin, end) in enumerate(pieces):
            for path, array in leaves.items():
                rows[path][row, :end - begin] = array[begin:end, n]
            mask[row, :end - begin] = True
        rows[("mask",)] = mask
        self._rows.extend(unflatten(list(rows), list(rows.values())))

    def sample(self, n: int) -> ttorch.Tensor:
        """``n`` sequences drawn uniformly with replacement, time-major ``[L, n, ...]``, with ``index`` ``[n]``."""
        if len(self._rows) == 0:
            raise ValueError("SequenceBuffer.sample: the buffer is empty; extend() it with collected chunks first")
        batch = self._rows.sample(n)
        index = batch.index
        del batch["index"]
        batch = batch.transpose(0, 1)
        batch.index = index
        return batch

    def update_priority(self, index: Any, priority: Any) -> None:
        """Refused: sequences are sampled uniformly."""
        raise ValueError("SequenceBuffer.update_priority: sequences are sampled uniformly; there are no priorities")

    def clear(self) -> None:
        """Drop every sequence (the RNG stream goes on)."""
        self._rows.clear()

    def state_dict(self) -> dict:
        """The stored sequences, position, and RNG state, for checkpoints."""
        return {"version": _STATE_VERSION, "sequence_length": self._length, "rows": self._rows.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` exactly."""
        where = "SequenceBuffer.load_state_dict"
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"{where}: unknown state version {state.get('version')!r} (expected {_STATE_VERSION}); "
                             f"pass what SequenceBuffer.state_dict() returned")
        if state["sequence_length"] != self._length:
            raise ValueError(f"{where}: the state holds sequences of {state['sequence_length']} steps, this buffer "
                             f"{self._length}; build it with sequence_length={state['sequence_length']} to load it")
        self._rows.load_state_dict(state["rows"])
