"""Frame-deduplicated replay storage: each image frame is stored once, stacks are rebuilt at sampling.

An Atari transition holds ``obs`` and ``next_obs`` stacks of ``k`` frames ``[k, H, W]``; consecutive
stacks of one env share ``k - 1`` frames and ``next_obs`` of one step is ``obs`` of the next, so a naive
ring stores every frame about ``2k`` times. Here every frame leaf of ``obs`` / ``next_obs`` is replaced
in the ring by ``k`` frame ids, and the frames live once in a :class:`FramePool`.

Frames are matched by content, not by position: a frame's bytes are hashed, looked up among the frames
alive in the pool and compared in full before an id is shared (a hash collision only costs a copy). So
no env index or ordering is assumed: envs may interleave, batches may be chunked anyway, n-step
``next_obs`` may point several steps ahead, an episode's first stack may repeat its reset frame; sampling
returns exactly the arrays that were written. Each frame counts the ring rows that reference it and
goes back to a free list when the last one is overwritten, so the pool holds the frames of the live
transitions only (about one per transition on Atari) and its memory grows in chunks as they are used.
"""
from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

from conveyor.data._storage import KeyPath, RingStorage, dotted, flatten

__all__ = ["FramePool", "FrameStorage", "FrameStack"]

FrameStack = Union[int, str, None]
"""How a buffer stores image stacks: ``"auto"`` (deduplicate uint8 ``[k, H, W]`` observations with
``k > 1``), an int ``k`` (deduplicate ``[k, H, W]`` observations of any dtype, else refuse them) or
``None`` (store every array as given)."""

_FRAME_KEYS = ("obs", "next_obs")  # the top-level keys whose leaves may be frame stacks
_CHUNK_BYTES = 1 << 29  # the pool grows by chunks of at most this many bytes (their pages load as used)


def check_frame_stack(value: Any, where: str) -> FrameStack:
    """``value`` if it is a valid frame_stack setting, else a ValueError saying which are."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{where} frame_stack must be 'auto', an int >= 1 (the frames per observation) or None "
                     f"(no frame deduplication), got {value!r}")


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _same_frames(a: np.ndarray, b: np.ndarray, lead: int) -> np.ndarray:
    """Whether ``a`` and ``b`` hold the same bytes, per index of their ``lead`` leading dims (the rest is a frame,
    contiguous); compared 8 bytes at a time where a frame's size allows."""
    a, b = (x.reshape(*x.shape[:lead], -1).view(np.uint8) for x in (a, b))
    if a.shape[-1] % 8 == 0:
        a, b = a.view(np.uint64), b.view(np.uint64)
    return (a == b).all(axis=-1)


class FramePool:
    """Unique frames of one shape and dtype in reference-counted slots, shared by content.

    :meth:`add` returns one slot id per frame given (an existing slot for a frame already alive) and
    counts the reference; :meth:`release` drops references and frees slots no row references any more.
    """

    def __init__(self, frame_shape: tuple[int, ...], dtype: np.dtype, chunk_frames: int) -> None:
        self.frame_shape = tuple(frame_shape)
        self.dtype = np.dtype(dtype)
        self._chunk = _pow2_floor(chunk_frames)
        self._shift = self._chunk.bit_length() - 1
        self._chunks: list[np.ndarray] = []
        self._refs = np.zeros(0, dtype=np.int64)  # per slot: the ring rows' references to it
        self._keys = np.zeros(0, dtype=np.int64)  # per slot: its frame's hash, to forget it when freed
        self._free = np.zeros(0, dtype=np.int64)  # a stack of freed slots, reused last-freed first
        self._n_free = 0
        self._high = 0  # slots ever used; [0, _high) are live or free
        self._index: dict[int, int] = {}  # frame hash -> the live slot holding that frame

    @property
    def live(self) -> int:
        """Frames referenced by at least one row."""
        return self._high - self._n_free

    @property
    def nbytes(self) -> int:
        """Bytes of the slots in use so far (live or free), what the pool keeps resident."""
        return self._high * self.dtype.itemsize * int(np.prod(self.frame_shape))

    def add(self, frames: np.ndarray) -> np.ndarray:
        """Slot ids (int64) of ``frames`` ``[M, *frame_shape]``, storing those not alive yet; each id is referenced."""
        frames = np.ascontiguousarray(frames)
        view = memoryview(frames.tobytes())  # slices of bytes hash in place: one copy per call, none per frame
        size = frames.nbytes // max(1, len(frames))
        index, ids, fresh = self._index, [], []
        for i in range(len(frames)):
            key = hash(view[i * size:(i + 1) * size])
            slot = index.get(key)
            if slot is None:
                slot = index[key] = self._alloc()
                self._keys[slot] = key  # not cached above: _alloc may grow the arrays
                fresh.append(i)
            ids.append(slot)
        out = np.array(ids, dtype=np.int64)
        if fresh:
            self._put(out[fresh], frames[fresh])
        if len(fresh) < len(frames):  # equal hashes; make sure the bytes are equal too
            for i in np.flatnonzero(~_same_frames(self.take(out), frames, 1)).tolist():  # a collision: keep apart
                out[i] = self._alloc()
                self._put(out[i:i + 1], frames[i:i + 1])
        self.share(out)
        return out

    def share(self, ids: np.ndarray) -> None:
        """Add one reference per id to frames already alive."""
        slots, counts = np.unique(ids, return_counts=True)
        self._refs[slots] += counts

    def release(self, ids: np.ndarray) -> None:
        """Drop one reference per id; a slot left unreferenced is forgotten and reused by later frames."""
        slots, counts = np.unique(ids, return_counts=True)
        self._refs[slots] -= counts
        dead = slots[self._refs[slots] == 0]
        for slot, key in zip(dead.tolist(), self._keys[dead].tolist()):
            if self._index.get(key) == slot:
                del self._index[key]
        self._free[self._n_free:self._n_free + len(dead)] = dead
        self._n_free += len(dead)

    def take(self, ids: np.ndarray) -> np.ndarray:
        """A fresh array of the frames at ``ids``, shaped ``[*ids.shape, *frame_shape]``."""
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        chunk, offset = flat >> self._shift, flat & (self._chunk - 1)
        if len(self._chunks) == 1:
            out = self._chunks[0].take(offset, axis=0)
        else:
            out = np.empty((len(flat), *self.frame_shape), dtype=self.dtype)
            for c in np.unique(chunk).tolist():
                rows = chunk == c
                out[rows] = self._chunks[c].take(offset[rows], axis=0)
        return out.reshape(*np.shape(ids), *self.frame_shape)

    def _alloc(self) -> int:
        if self._n_free:
            self._n_free -= 1
            return int(self._free[self._n_free])
        if self._high == len(self._chunks) * self._chunk:
            self._grow()
        self._high += 1
        return self._high - 1

    def _grow(self) -> None:
        # np.zeros maps untouched pages lazily: a chunk costs memory as its slots are used
        self._chunks.append(np.zeros((self._chunk, *self.frame_shape), dtype=self.dtype))
        extra = np.zeros(self._chunk, dtype=np.int64)
        self._refs, self._keys, self._free = (np.concatenate([a, extra]) for a in (self._refs, self._keys, self._free))

    def _put(self, ids: np.ndarray, frames: np.ndarray) -> None:
        chunk, offset = ids >> self._shift, ids & (self._chunk - 1)
        for c in np.unique(chunk).tolist():
            rows = chunk == c
            self._chunks[c][offset[rows]] = frames[rows]

    def state_dict(self) -> dict:
        """Copies of the slots in use, their reference counts and the free list (hashes are recomputed on load)."""
        frames = [c.copy() for c in self._chunks[:self._high >> self._shift]]
        rest = self._high & (self._chunk - 1)
        if rest:
            frames.append(self._chunks[self._high >> self._shift][:rest].copy())
        return {"frames": frames, "refs": self._refs[:self._high].copy(), "free": self._free[:self._n_free].copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into an empty pool, slot for slot."""
        frames = np.concatenate(state["frames"]) if state["frames"] else np.zeros((0, *self.frame_shape), self.dtype)
        for _ in range(-(-len(frames) // self._chunk)):
            self._grow()
        self._high = len(frames)
        self._put(np.arange(self._high), frames)
        self._refs[:self._high] = state["refs"]
        self._n_free = len(state["free"])
        self._free[:self._n_free] = state["free"]
        for slot in np.flatnonzero(self._refs[:self._high] > 0).tolist():
            key = hash(frames[slot].tobytes())
            self._keys[slot] = key
            self._index.setdefault(key, slot)


def _stack_ids(pool: FramePool, stacks: np.ndarray, before: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """The frame ids ``[n, k]`` of ``stacks`` ``[n, k, *frame]``, added to ``pool``. With ``before`` (the obs stacks of
    the same rows and their ids, for next_obs), frames equal to the obs frame one place later (a 1-step transition's
    ``next_obs[:-1] == obs[1:]``) are compared and shared instead of hashed."""
    stacks = np.ascontiguousarray(stacks)
    n, k = stacks.shape[:2]
    if before is None:
        return pool.add(stacks.reshape(n * k, *stacks.shape[2:])).reshape(n, k)
    obs, obs_ids = np.ascontiguousarray(before[0]), before[1]
    new = np.ones((n, k), dtype=bool)
    new[:, :-1] = ~_same_frames(stacks[:, :-1], obs[:, 1:], 2)
    out = np.empty((n, k), dtype=np.int64)
    out[:, :-1] = obs_ids[:, 1:]
    out[new] = pool.add(stacks[new])
    pool.share(out[~new])
    return out


class FrameStorage(RingStorage):
    """A :class:`RingStorage` whose frame-stack leaves of ``obs`` / ``next_obs`` hold ids into :class:`FramePool`s.

    Leaves with the same frame shape and dtype (``obs`` and ``next_obs``) share one pool. Other leaves, and
    every leaf when no observation is a frame stack, are stored as :class:`RingStorage` stores them.
    """

    def __init__(self, capacity: int, frame_stack: FrameStack) -> None:
        super().__init__(capacity)
        self.frame_stack = check_frame_stack(frame_stack, "FrameStorage")
        self._frames: dict[int, FramePool] = {}  # leaf position -> the pool its frames are in
        self._follows: dict[int, int] = {}  # a next_obs leaf's position -> its obs leaf's (same pool and stack size)
        self._pending: set[KeyPath] = set()  # the frame leaves being allocated
        self._filled = 0  # ring rows written so far: their ids hold references

    @property
    def pools(self) -> list[FramePool]:
        """The frame pools in use (none when no observation is stored as frames)."""
        return list({id(p): p for p in self._frames.values()}.values())

    def allocate(self, leaves: dict[KeyPath, np.ndarray], batched: bool, where: str,
                 frame_paths: list[KeyPath] | None = None) -> None:
        """As :meth:`RingStorage.allocate`; frame leaves are chosen by ``frame_stack`` (or given as ``frame_paths``)."""
        shapes = {p: (tuple(a.shape[1:] if batched else a.shape), a.dtype) for p, a in leaves.items()}
        chosen = self._choose(shapes, where) if frame_paths is None else frame_paths
        self._pending = set(chosen)
        super().allocate(leaves, batched, where)
        pools: dict[tuple, FramePool] = {}
        self._frames = {}
        for i, (path, (shape, dtype)) in enumerate(zip(self.paths, self.specs)):
            if path in self._pending:
                frame_bytes = dtype.itemsize * int(np.prod(shape[1:]))
                chunk = min(max(16, self.capacity // 2), max(1, _CHUNK_BYTES // max(1, frame_bytes)))
                self._frames[i] = pools.setdefault((shape[1:], dtype.str), FramePool(shape[1:], dtype, chunk))
        position = {path: i for i, path in enumerate(self.paths)}
        self._follows = {}
        for i in self._frames:
            obs = position.get(("obs",) + self.paths[i][1:])
            if self.paths[i][0] == "next_obs" and obs in self._frames and self.specs[obs] == self.specs[i] \
                    and self.specs[i][0][0] > 1:
                self._follows[i] = obs
        self._filled = 0

    def _choose(self, shapes: dict[KeyPath, tuple], where: str) -> list[KeyPath]:
        """The observation leaves to store as frames under ``frame_stack``."""
        if self.frame_stack is None:
            return []
        candidates = {p: s for p, s in shapes.items() if p[0] in _FRAME_KEYS}
        if self.frame_stack == "auto":
            return [p for p, (shape, dtype) in candidates.items()
                    if dtype == np.uint8 and len(shape) == 3 and shape[0] > 1]
        chosen = [p for p, (shape, _) in candidates.items() if len(shape) == 3 and shape[0] == self.frame_stack]
        if not chosen:
            seen = ", ".join(f"'{dotted(p)}' {dtype}{list(shape)}" for p, (shape, dtype) in candidates.items())
            raise ValueError(f"{where}: frame_stack={self.frame_stack} needs observations of shape "
                             f"[{self.frame_stack}, H, W], got {seen or 'no obs'}; set frame_stack to 'auto' "
                             f"(deduplicate uint8 stacks only) or None")
        return chosen

    def _new_array(self, path: KeyPath, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if path not in self._pending:
            return super()._new_array(path, shape, dtype)
        id_dtype = np.int32 if 2 * self.capacity * shape[0] < 2 ** 31 else np.int64
        return np.zeros((self.capacity, shape[0]), dtype=id_dtype)

    def reset(self) -> None:
        super().reset()
        self._frames, self._follows, self._filled = {}, {}, 0

    def layout(self) -> str:
        frames = [dotted(self.paths[i]) for i in self._frames]
        return super().layout() + (f" (frames of {', '.join(frames)} stored once)" if frames else "")

    def write_one(self, slot: int, values: list[np.ndarray]) -> None:
        self.write_rows(slot, [np.asarray(v)[None] for v in values], begin=0)

    def write_rows(self, start: int, values: list[np.ndarray], begin: int) -> None:
        """As :meth:`RingStorage.write_rows`, frames going to their pools and the rows overwritten releasing theirs."""
        if not self._frames:
            return super().write_rows(start, values, begin)
        n = len(values[0]) - begin
        if n <= 0:
            return
        rows = list(values)
        order = [i for i in self._frames if i not in self._follows] + list(self._follows)  # obs before next_obs
        for i in order:  # add first: a frame the overwritten rows share stays alive
            before = self._follows.get(i)
            rows[i] = _stack_ids(self._frames[i], values[i][begin:],
                                 None if before is None else (values[before][begin:], rows[before]))
        slots = (start + np.arange(n)) % self.capacity
        overwritten = slots[slots < self._filled]
        old = {i: self.arrays[i][overwritten] for i in self._frames}
        super().write_rows(start, [r if i in self._frames else r[begin:] for i, r in enumerate(rows)], begin=0)
        for i, pool in self._frames.items():
            pool.release(old[i].reshape(-1))
        self._filled = self.capacity if start + n > self.capacity else max(self._filled, start + n)

    def gather(self, slots: np.ndarray) -> list[torch.Tensor]:
        out = super().gather(slots)
        for pool in self.pools:  # one take per pool: obs and next_obs frames together
            leaves = [i for i, p in self._frames.items() if p is pool]
            stacks = pool.take(np.stack([out[i].numpy() for i in leaves]))
            for i, frames in zip(leaves, stacks):
                out[i] = torch.from_numpy(frames)
        return out

    def state(self, length: int) -> dict:
        """As :meth:`RingStorage.state`, with the frame leaves as ids and the pools under ``"frames"``."""
        out = super().state(length)
        if self._frames:
            pools = self.pools
            out["frames"] = {
                "paths": [list(self.paths[i]) for i in self._frames],
                "pool": [pools.index(pool) for pool in self._frames.values()],
                "specs": [(self.specs[i][0], self.specs[i][1].str) for i in self._frames],
                "pools": [pool.state_dict() for pool in pools],
            }
        return out

    def load(self, state: dict, where: str) -> None:
        """Restore :meth:`state`; a state without frames (a plain buffer's) is stored as frames where they apply."""
        frames = state.get("frames")
        if frames is None:
            return super().load(state, where)
        flat = {p: np.asarray(a) for p, a in flatten(state["storage"], where).items()}
        paths = [tuple(p) for p in frames["paths"]]
        leaves = dict(flat)
        for path, (shape, dtype) in zip(paths, frames["specs"]):
            leaves[path] = np.zeros((0, *shape), dtype=np.dtype(dtype))
        self.allocate(leaves, batched=True, where=where, frame_paths=paths)
        length = len(next(iter(flat.values())))
        for i, array in enumerate(self.arrays):
            array[:length] = flat[self.paths[i]]
        by_position = {paths.index(self.paths[i]): pool for i, pool in self._frames.items()}
        loaded: set[int] = set()
        for position, pool_index in enumerate(frames["pool"]):
            if pool_index not in loaded:
                by_position[position].load_state_dict(frames["pools"][pool_index])
                loaded.add(pool_index)
        self._filled = length
