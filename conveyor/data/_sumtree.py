"""A vectorised sum tree with a min tree alongside, for prioritized replay.

Every level is one numpy array, so a batch update or a batch of samples costs a few numpy calls per
level and no Python work per index. Two choices keep the tree shallow, because on small batches
each numpy call costs about a microsecond whatever its size:

- a node sums (and takes the min of) ``FANOUT`` children, not 2;
- the tree stops growing once a level has at most ``TOP_SIZE`` entries; that top level is searched
  flat (one ``cumsum`` + ``searchsorted`` for all samples) instead of through more levels.

So a million slots take three levels below a flat top of 245 entries, where a binary tree takes 20.

Layout: ``sums[0]`` holds the leaves, padded to a multiple of ``FANOUT``; entry ``r`` of
``sums[d + 1]`` is the sum of row ``r`` of ``sums[d].reshape(-1, FANOUT)``; ``sums[-1]`` is the top.
Padding and unset leaves are 0 in the sum tree and +inf in the min tree, so they are never sampled
and never the minimum.
"""
from __future__ import annotations

import numpy as np

FANOUT = 16
TOP_SIZE = 1024
_UPPER = np.triu(np.ones((FANOUT, FANOUT)))  # x @ _UPPER: running sums along the rows of x


def _level_lengths(capacity: int) -> list[int]:
    """Array lengths from the leaves up to the flat top level."""
    lengths = [capacity]
    while lengths[-1] > TOP_SIZE:
        rows = -(-lengths[-1] // FANOUT)
        lengths[-1] = rows * FANOUT
        lengths.append(rows)
    return lengths


class SumMinTree:
    """Sums and minima of ``capacity`` non-negative leaf values, updated and sampled in batches."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        lengths = _level_lengths(capacity)
        self.sums = [np.zeros(n, dtype=np.float64) for n in lengths]
        self.mins = [np.full(n, np.inf, dtype=np.float64) for n in lengths]
        self._dirty: list[int] = []
        self._top_cumsum: np.ndarray | None = None
        self._min: float | None = None

    @property
    def leaves(self) -> np.ndarray:
        """The leaf values (including padding past ``capacity``)."""
        return self.sums[0]

    @property
    def total(self) -> float:
        """The sum of all leaves."""
        return float(self._cumsum()[-1])

    @property
    def min(self) -> float:
        """The smallest leaf that has been set (+inf when none has)."""
        self.flush()
        if self._min is None:
            self._min = float(self.mins[-1].min())
        return self._min

    def clear(self) -> None:
        """Reset every leaf to unset (0 for the sum, +inf for the min)."""
        for level in self.sums:
            level.fill(0.0)
        for level in self.mins:
            level.fill(np.inf)
        self._dirty.clear()
        self._top_changed()

    def set_one(self, slot: int, value: float) -> None:
        """Set one leaf now and its ancestors at the next read, so a single push stays O(1)."""
        self.sums[0][slot] = value
        self.mins[0][slot] = value
        self._dirty.append(slot)
        if len(self._dirty) >= 4096:
            self.flush()

    def flush(self) -> None:
        """Bring the ancestors of leaves set by ``set_one`` up to date."""
        if self._dirty:
            slots = np.array(self._dirty, dtype=np.int64)
            self._dirty.clear()
            self._propagate(slots)

    def update(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``slots`` to ``values`` (the last value wins for a repeated slot)."""
        self.sums[0][slots] = values
        self.mins[0][slots] = values
        if self._dirty:
            slots = np.concatenate([slots, np.array(self._dirty, dtype=np.int64)])
            self._dirty.clear()
        self._propagate(slots)

    def fill(self, start: int, stop: int, value: float) -> None:
        """Set leaves ``start:stop`` to ``value``, recomputing ancestors by slices (for ``extend``)."""
        self.flush()
        self.sums[0][start:stop] = value
        self.mins[0][start:stop] = value
        for depth in range(1, len(self.sums)):
            start, stop = start // FANOUT, (stop - 1) // FANOUT + 1
            self.sums[depth][start:stop] = self.sums[depth - 1].reshape(-1, FANOUT)[start:stop].sum(axis=1)
            self.mins[depth][start:stop] = self.mins[depth - 1].reshape(-1, FANOUT)[start:stop].min(axis=1)
        self._top_changed()

    def _propagate(self, slots: np.ndarray) -> None:
        """Recompute, level by level, the ancestors of ``slots`` from their children."""
        idx = slots
        for depth in range(1, len(self.sums)):
            idx = idx // FANOUT
            self.sums[depth][idx] = self.sums[depth - 1].reshape(-1, FANOUT).take(idx, axis=0).sum(axis=1)
            self.mins[depth][idx] = self.mins[depth - 1].reshape(-1, FANOUT).take(idx, axis=0).min(axis=1)
        self._top_changed()

    def _top_changed(self) -> None:
        self._top_cumsum = None
        self._min = None

    def _cumsum(self) -> np.ndarray:
        """Running sums of the top level after a leading 0, cached until the next update."""
        self.flush()
        if self._top_cumsum is None:
            self._top_cumsum = np.concatenate(([0.0], np.cumsum(self.sums[-1])))
        return self._top_cumsum

    def find(self, fractions: np.ndarray) -> np.ndarray:
        """The leaf holding each prefix sum ``fraction * total`` (fractions in ``[0, 1)``).

        All targets descend together: ``searchsorted`` on the top level's running sums, then one
        row of ``FANOUT`` children per level, whose running sums come from one small matmul with a
        triangular matrix (about 3x faster than ``np.cumsum`` along short rows). A target is kept below
        the sum of the row it enters; should rounding still land one on an empty leaf, that target
        is looked up again exactly.
        """
        cs = self._cumsum()
        total = cs[-1]
        u = np.minimum(fractions * total, np.nextafter(total, 0.0))
        node = np.searchsorted(cs[1:], u, side="right")
        u -= cs[node]
        base = np.arange(len(u)) * FANOUT
        for level in self.sums[-2::-1]:
            block = level.reshape(-1, FANOUT).take(node, axis=0)
            cs = block @ _UPPER
            np.minimum(u, np.nextafter(cs[:, -1], 0.0), out=u)
            j = np.minimum((cs <= u[:, None]).sum(axis=1), FANOUT - 1)
            u -= (cs - block).take(base + j)
            node *= FANOUT
            node += j
        empty = self.sums[0][node] <= 0.0
        if empty.any():
            exact = np.cumsum(self.sums[0])
            targets = np.minimum(fractions[empty] * exact[-1], np.nextafter(exact[-1], 0.0))
            node[empty] = np.searchsorted(exact, targets, side="right")
        return node

    def state_dict(self) -> dict:
        """Copies of every level, so a restored tree sums and samples bit for bit the same."""
        self.flush()
        return {"sums": [a.copy() for a in self.sums], "mins": [a.copy() for a in self.mins]}

    def load_state_dict(self, state: dict) -> None:
        """Restore levels saved by ``state_dict`` from a tree of the same capacity."""
        saved_levels = list(state["sums"]) + list(state["mins"])
        mine_levels = self.sums + self.mins
        if [np.shape(a) for a in saved_levels] != [a.shape for a in mine_levels]:
            raise ValueError(
                f"the saved priority tree has levels {[np.shape(a) for a in state['sums']]}, this buffer's "
                f"{[a.shape for a in self.sums]}: load a state saved by a buffer of the same size")
        for mine, saved in zip(mine_levels, saved_levels):
            mine[...] = saved
        self._dirty.clear()
        self._top_changed()
