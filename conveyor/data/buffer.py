"""``DequeBuffer``: a fixed-size FIFO replay buffer, uniform or prioritized.

Transitions live in preallocated numpy ring arrays (one per leaf, see ``_storage``), so ``extend``
is a slice copy per leaf and ``sample`` a ``take`` per leaf plus one tree build. Prioritized
replay (Schaul et al., 2016) keeps ``(priority + eps) ** alpha`` per slot in a vectorised sum/min
tree (``_sumtree``), samples one transition per equal segment of the total, and returns
importance-sampling weights ``(N * P(i)) ** -beta`` divided by their largest possible value,
``(N * min_j P(j)) ** -beta``, so they only ever scale an update down.
"""
from __future__ import annotations

import functools
import math
import threading
from numbers import Integral, Real
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import treetensor.torch as ttorch

from conveyor.data._storage import RingStorage, flatten, to_array, unflatten
from conveyor.data._sumtree import SumMinTree
from conveyor.data.batch import tree_of_tensors
from conveyor.data.frames import FrameStack, FrameStorage, check_frame_stack

__all__ = ["DequeBuffer"]

_STATE_VERSION = 1


def _check_unit(name: str, value: Any, meaning: str) -> float:
    if not isinstance(value, Real) or isinstance(value, bool) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"DequeBuffer {name} must be a number in [0, 1] ({meaning}), got {value!r}")
    return float(value)


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run a buffer method under the buffer's lock, so a pusher and a learner may share it across threads."""
    @functools.wraps(method)
    def wrapper(self: "DequeBuffer", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


class DequeBuffer:
    """A FIFO replay buffer of at most ``size`` transitions; the oldest is dropped first.

    Transitions are dicts (nested dicts for Dict observations) or ttorch trees of numpy arrays,
    torch tensors or Python scalars. The first data written fixes each key's shape and dtype. With
    ``prioritized=True``, ``sample`` draws proportionally to ``(priority + eps) ** alpha`` and adds
    importance-sampling ``weight``s; feed new priorities back with ``update_priority``; their exponent ``beta``
    rises linearly to ``beta_end`` over the first ``beta_anneal_steps`` transitions added, when given. ``seed``
    makes sampling reproducible. ``frame_stack`` (``"auto"``, an int ``k``, None: see :mod:`conveyor.data.frames`)
    stores every frame of image-stack observations ``[k, H, W]`` once and stacks them again at sampling, which
    returns exactly what was written in ~1/(2k) of the memory. Thread-safe: every operation holds the buffer's lock, so in an async
    pipeline the pusher of one iteration and the learner of another can share it.
    """

    def __init__(self, size: int, *, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 eps: float = 1e-6, seed: int | None = None, beta_end: float | None = None,
                 beta_anneal_steps: int | None = None, frame_stack: FrameStack = None) -> None:
        if not isinstance(size, Integral) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"DequeBuffer size must be a positive int (the most transitions kept), got {size!r}")
        if not isinstance(eps, Real) or isinstance(eps, bool) or not 0.0 <= float(eps) < math.inf:
            raise ValueError(f"DequeBuffer eps must be a finite number >= 0 (added to every priority so "
                             f"no transition becomes unsampleable; e.g. 1e-6), got {eps!r}")
        if seed is not None and (not isinstance(seed, Integral) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"DequeBuffer seed must be None or an int >= 0, got {seed!r}")
        self._size: int = int(size)
        self._prioritized: bool = bool(prioritized)
        self._alpha: float = _check_unit("alpha", alpha, "0 samples uniformly, 1 fully in proportion to priority")
        self._beta: float = _check_unit("beta", beta, "how much of the sampling bias the weights undo; 1 = all")
        self._beta_end: float = self._beta if beta_end is None else \
            _check_unit("beta_end", beta_end, "the beta reached after beta_anneal_steps transitions; 1 undoes all bias")
        if beta_anneal_steps is not None and (not isinstance(beta_anneal_steps, Integral)
                                              or isinstance(beta_anneal_steps, bool) or beta_anneal_steps <= 0):
            raise ValueError(f"DequeBuffer beta_anneal_steps must be None or an int > 0 (transitions added over which "
                             f"beta rises to beta_end), got {beta_anneal_steps!r}")
        self._beta_steps: int | None = None if beta_anneal_steps is None else int(beta_anneal_steps)
        self._added: int = 0  # transitions ever added: the beta schedule's clock
        self._eps: float = float(eps)
        self._rng: np.random.Generator = np.random.default_rng(None if seed is None else int(seed))
        self._frame_stack: FrameStack = check_frame_stack(frame_stack, "DequeBuffer")
        self._storage: RingStorage = RingStorage(self._size) if frame_stack is None else \
            FrameStorage(self._size, frame_stack)
        self._tree: SumMinTree | None = SumMinTree(self._size) if self._prioritized else None
        self._ptr: int = 0  # the slot the next transition goes to
        self._len: int = 0
        self._max_priority: float = 1.0  # the largest priority + eps seen, given to new transitions
        self._lock = threading.RLock()

    @property
    def size(self) -> int:
        """The capacity: the most transitions kept."""
        return self._size

    @property
    def prioritized(self) -> bool:
        """Whether sampling follows priorities (and ``sample`` adds ``weight``)."""
        return self._prioritized

    @property
    def frame_stack(self) -> FrameStack:
        """How image stacks are stored: ``"auto"``, an int ``k`` (each frame once, stacked at sampling) or None."""
        return self._frame_stack

    @property
    def frame_count(self) -> int:
        """Frames held (each once) for the observations stored as frames; 0 when none are."""
        return sum(pool.live for pool in getattr(self._storage, "pools", []))

    @property
    def alpha(self) -> float:
        """How strongly priorities shape sampling (0 uniform, 1 proportional)."""
        return self._alpha

    @property
    def eps(self) -> float:
        """Added to every priority so no transition's probability is 0."""
        return self._eps

    @property
    def beta(self) -> float:
        """How much of the prioritized-sampling bias the weights correct now: with ``beta_anneal_steps``, it rises
        linearly from the start value to ``beta_end`` over that many transitions added (env steps). Setting it
        sets the start value."""
        if self._beta_steps is None:
            return self._beta
        return self._beta + (self._beta_end - self._beta) * min(1.0, self._added / self._beta_steps)

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = _check_unit("beta", value, "how much of the sampling bias the weights undo; 1 = all")

    def __len__(self) -> int:
        return self._len

    @property
    def added(self) -> int:
        """Transitions ever added (pushed or extended), those since replaced included; saved in checkpoints."""
        return self._added

    def __repr__(self) -> str:
        frames = "" if self._frame_stack is None else f", frame_stack={self._frame_stack!r}"
        return f"DequeBuffer(size={self._size}, len={self._len}, prioritized={self._prioritized}{frames})"

    @_locked
    def push(self, transition: Any) -> None:
        """Append one unbatched transition, evicting the oldest when full."""
        values = self._leaves(transition, batched=False, where="DequeBuffer.push")
        slot = self._ptr
        self._storage.write_one(slot, values)
        if self._tree is not None:
            self._tree.set_one(slot, self._max_priority ** self._alpha)
        self._ptr = (slot + 1) % self._size
        self._len = min(self._len + 1, self._size)
        self._added += 1

    @_locked
    def extend(self, batch: Any) -> None:
        """Append a batch (one leading dim on every leaf) in order; of more than ``size`` rows, the newest stay."""
        where = "DequeBuffer.extend"
        if isinstance(batch, (list, tuple)):
            raise TypeError(f"{where} takes one batch (a dict of arrays with a leading batch dim), not a "
                            f"{type(batch).__name__} of transitions: stack them with stack_nested() or push() each")
        values = self._leaves(batch, batched=True, where=where)
        n = len(values[0])
        kept = min(n, self._size)
        start = (self._ptr + n - kept) % self._size
        self._storage.write_rows(start, values, begin=n - kept)
        if self._tree is not None and kept:
            priority = self._max_priority ** self._alpha
            self._tree.fill(start, min(start + kept, self._size), priority)
            if start + kept > self._size:
                self._tree.fill(0, start + kept - self._size, priority)
        self._ptr = (self._ptr + n) % self._size
        self._len = min(self._len + n, self._size)
        self._added += n

    @_locked
    def sample(self, n: int) -> ttorch.Tensor:
        """``n`` transitions drawn with replacement, as a batch with ``index`` (and ``weight`` if prioritized)."""
        if not isinstance(n, Integral) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"DequeBuffer.sample: n must be a positive int (the batch size), got {n!r}")
        if self._len == 0:
            raise ValueError("DequeBuffer.sample: the buffer is empty; push() or extend() transitions first")
        extra: dict[str, torch.Tensor] = {}
        if self._tree is None:
            slots = self._rng.integers(0, self._len, n)
        else:
            if not self._tree.total > 0.0:
                raise ValueError("DequeBuffer.sample: every priority is 0, so nothing can be drawn; "
                                 "use eps > 0 or give some transitions a positive priority")
            slots = self._tree.find((np.arange(n) + self._rng.random(n)) / n)
            weight = (self._tree.min / self._tree.leaves[slots]) ** self.beta
            extra["weight"] = torch.from_numpy(weight.astype(np.float32))
        batch = unflatten(self._storage.paths, self._storage.gather(slots))
        batch["index"] = torch.from_numpy(slots)
        batch.update(extra)
        return tree_of_tensors(batch)

    @_locked
    def update_priority(self, index: Any, priority: Any) -> None:
        """Set the priorities (e.g. |TD error|) of the slots ``index`` of a sampled batch (``batch.index``).

        A slot overwritten since it was sampled takes the new priority too (as in the PER paper's buffer).
        """
        where = "DequeBuffer.update_priority"
        if self._tree is None:
            raise ValueError(f"{where}: this buffer samples uniformly; "
                             f"build it with DequeBuffer(size, prioritized=True) to use priorities")
        slots = to_array(index).reshape(-1)
        values = to_array(priority).astype(np.float64).reshape(-1)
        if slots.dtype.kind not in "iu":
            raise ValueError(f"{where}: index must hold integers (the 'index' of a sampled batch), got {slots.dtype}")
        if len(slots) != len(values):
            raise ValueError(f"{where}: got {len(slots)} indices but {len(values)} priorities; pass one per index")
        if not len(slots):
            return
        if slots.min() < 0 or slots.max() >= self._len:
            raise ValueError(f"{where}: index out of range [0, {self._len}) "
                             f"(min {slots.min()}, max {slots.max()}); pass the 'index' of a sampled batch")
        if not np.isfinite(values).all() or values.min() < 0.0:
            raise ValueError(f"{where}: priorities must be finite and >= 0 (e.g. |TD error|), "
                             f"got min {values.min()}, max {values.max()}")
        values += self._eps
        self._max_priority = max(self._max_priority, float(values.max()))
        self._tree.update(slots.astype(np.int64, copy=False), values ** self._alpha)

    @_locked
    def clear(self) -> None:
        """Drop every transition and the stored layout, as a fresh buffer (the RNG stream goes on)."""
        self._storage.reset()
        if self._tree is not None:
            self._tree.clear()
        self._ptr = 0
        self._len = 0
        self._max_priority = 1.0

    @_locked
    def state_dict(self) -> dict:
        """A picklable snapshot (numpy copies, counters, priorities, RNG state) for checkpoints."""
        return {
            "version": _STATE_VERSION,
            "size": self._size,
            "prioritized": self._prioritized,
            "alpha": self._alpha,
            "beta": self._beta,
            "eps": self._eps,
            "ptr": self._ptr,
            "len": self._len,
            "max_priority": self._max_priority,
            **self._storage.state(self._len),
            "tree": self._tree.state_dict() if self._tree is not None else None,
            "rng": self._rng.bit_generator.state,
            "beta_schedule": {"end": self._beta_end, "steps": self._beta_steps, "added": self._added},
        }

    @_locked
    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` exactly: contents, priorities, position in the ring and RNG stream."""
        where = "DequeBuffer.load_state_dict"
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"{where}: unknown state version {state.get('version')!r} (expected {_STATE_VERSION}); "
                             f"pass what DequeBuffer.state_dict() returned")
        if (state["size"], state["prioritized"]) != (self._size, self._prioritized):
            raise ValueError(
                f"{where}: the state was saved by DequeBuffer(size={state['size']}, "
                f"prioritized={state['prioritized']}), this buffer is DequeBuffer(size={self._size}, "
                f"prioritized={self._prioritized}); build the buffer with the same size and prioritized to load it")
        self.clear()
        self._storage.load(state, where)
        if self._tree is not None:
            self._tree.load_state_dict(state["tree"])
        self._alpha, self._beta, self._eps = state["alpha"], state["beta"], state["eps"]
        self._ptr, self._len = int(state["ptr"]), int(state["len"])
        self._max_priority = float(state["max_priority"])
        self._rng.bit_generator.state = state["rng"]
        schedule = state.get("beta_schedule", {"end": self._beta, "steps": None, "added": 0})
        self._beta_end, self._beta_steps, self._added = schedule["end"], schedule["steps"], int(schedule["added"])

    def _leaves(self, data: Any, batched: bool, where: str) -> list[np.ndarray]:
        """The data's leaves as arrays in storage order; the first data also fixes the storage layout."""
        flat = flatten(data, where)
        if self._storage.allocated:
            return self._storage.match(flat, batched=batched, where=where)
        reserved = {"index"} | ({"weight"} if self._prioritized else set())
        clash = sorted({p[0] for p in flat if p[0] in reserved})
        if clash:
            raise ValueError(f"{where}: key(s) {clash} are reserved: sample() adds 'index' (the storage slots) "
                             f"and, when prioritized, 'weight' (importance-sampling weights); rename them")
        self._storage.allocate({p: to_array(v) for p, v in flat.items()}, batched=batched, where=where)
        try:
            return self._storage.match(flat, batched=batched, where=where)
        except Exception:
            self._storage.reset()  # bad first data must not fix the layout
            raise
