"""Collection in a child process, so that in async mode it really overlaps training.

Two Python threads share one GIL, and torch hands it over around every operator: a collector thread and a
learner thread running small networks at the same time slow each other down instead of overlapping
(docs/engine.md, "When async pays"). :class:`ProcessCollector` runs the collection middleware (e.g. a
:class:`~conveyor.middleware.StepCollector` over its own env manager, then an n-step enhancer or an
advantage estimator) in a child process, with a replica of the policy that acts on the learner's
published versions: the parent only sends a request, waits on a pipe with the GIL released, and puts the
answer into the context.

What the chain collects comes back pickled, except its large numpy arrays (image observations: a PPO Atari
rollout of 8 envs x 128 steps is 29 MB): the child writes those into one shared-memory block that the parent
made (and remakes larger when a reply needs more), and the pickle holds only their places; the parent copies
them out before the next call reuses the block. The first call, and one that outgrows the block, pickles
everything and tells the parent the size it needs.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import cloudpickle
import numpy as np
import torch
import treetensor.torch as ttorch

from conveyor.data.batch import to_numpy, to_tensor
from conveyor.engine import OnlineRLContext, compose, declares, task
from conveyor.middleware.collector import EPISODE_EVENT
from conveyor.processes import (Child, ChildLost, attach_shared_block, create_shared_block, pack_exception,
                                release_shared_block, send_quietly, unpack_exception)

__all__ = ["ProcessCollector", "collection_builder"]

Chain = Sequence[Callable[[OnlineRLContext], Any]]
Builder = Callable[[], Tuple[Chain, Any, Callable[[], None]]]

_OUTPUTS = ("trajectories", "trajectory_end_idx", "episodes", "train_data")
_ALIGN = 64
_SHARED_MIN_BYTES = 1 << 16  # numpy arrays from this size on come back through shared memory
_BLOCK_ROUND = 1 << 20  # output blocks are made in whole MiB, a quarter larger than asked, so they rarely grow
_CLOSE_TIMEOUT_S = 5.0


def collection_builder(cfg: Any, policy_cls: type, collection: Callable[[Any, Any, Any], Chain]) -> Builder:
    """A builder for :class:`ProcessCollector`: in the child, a ``policy_cls`` replica, the collector env
    manager of ``cfg.env`` and ``collection(cfg, policy, env)``, the chain to run there."""
    def build() -> Tuple[Chain, Any, Callable[[], None]]:
        from conveyor.envs import make_env_manager
        policy = policy_cls(cfg.policy)
        env = make_env_manager(cfg.env, "collector", seed=cfg.seed)
        return collection(cfg, policy, env), policy, env.close
    return build


def _serve(conn: Connection, blob: bytes, weights_name: str, layout: List[Tuple[tuple, torch.dtype]],
           num_threads: int, cpus: Optional[Set[int]]) -> None:
    """The child (a :class:`conveyor.processes.Child`): build the chain, then answer the parent's requests until
    it says close or goes away."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(num_threads)  # the parent's, also where the child is not forked from its thread
    events: List[tuple] = []
    task.off(EPISODE_EVENT)  # a forked child holds copies of the parent's handlers: collect events for the parent
    task.on(EPISODE_EVENT, lambda *args: events.append(args))
    chain: Chain = []
    close: Optional[Callable[[], None]] = None
    weights = _SharedWeights(layout, weights_name)
    out = _OutputBlock()
    acting_version: Optional[int] = None
    try:
        chain, policy, close = cloudpickle.loads(blob)()
        run = compose(*chain)
        conn.send_bytes(pickle.dumps(("ok", None)))
        while True:
            command, arg = pickle.loads(conn.recv_bytes())
            if command == "close":
                return
            try:
                if command == "collect":
                    env_step, collect_kwargs, (version, extras), block_name = arg
                    out.attach(block_name)
                    if version != acting_version:
                        policy.load_acting_state({"version": version, "tensors": weights.tensors, "extras": extras})
                        acting_version = version
                    ctx = OnlineRLContext()
                    ctx.env_step, ctx.collect_kwargs = env_step, collect_kwargs
                    events.clear()
                    for _ in run(ctx):
                        pass
                    counters = {"env_step": ctx.env_step - env_step, "env_episode": ctx.env_episode}
                    outputs = {name: _portable(getattr(ctx, name)) for name in _OUTPUTS}
                    conn.send_bytes(out.dump(("ok", (counters, outputs, list(events)))))
                    continue
                if command == "state_dict":
                    reply: Any = {"chain": [mw.state_dict() if _stateful(mw) else None for mw in chain],
                             "collect": policy.collect_mode.state_dict() if _stateful(policy.collect_mode) else None}
                elif command == "load_state_dict":
                    for mw, state in zip(chain, arg["chain"], strict=True):
                        if state is not None:
                            mw.load_state_dict(state)
                    if arg["collect"] is not None:
                        policy.collect_mode.load_state_dict(arg["collect"])
                    reply = None
                else:
                    raise ValueError(f"unknown request {command!r}")
            except Exception as exc:
                conn.send_bytes(pickle.dumps(("error", pack_exception(exc))))
                continue
            conn.send_bytes(pickle.dumps(("ok", reply)))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the parent went away: nothing is left to collect for
    except BaseException as exc:
        send_quietly(conn, ("error", pack_exception(exc)))
    finally:
        if close is not None:
            close()
        weights.close(unlink=False)
        out.attach(None)
        conn.close()


def _stateful(mw: Any) -> bool:
    return callable(getattr(mw, "state_dict", None)) and callable(getattr(mw, "load_state_dict", None))


def _portable(value: Any) -> Any:
    """A collector's output with its trees as nested dicts of numpy arrays, which pickle by value."""
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return to_numpy(value) if isinstance(value, ttorch.Tensor) else value


def _restore(value: Any) -> Any:
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return to_tensor(value) if isinstance(value, dict) else value


class _OutputBlock:
    """One side's view of the shared block that large output arrays travel in (see the module docstring)."""

    def __init__(self) -> None:
        self.shm: Any = None

    def attach(self, name: Optional[str]) -> None:
        """The child: map the block ``name`` (None: unmap), letting go of the one it had."""
        if self.shm is not None and self.shm.name != name:
            release_shared_block(self.shm, unlink=False)
            self.shm = None
        if name is not None and self.shm is None:
            self.shm = attach_shared_block(name)

    def dump(self, message: Any) -> bytes:
        """The child: ``message`` pickled, its large arrays written into the block if they fit it (else everything
        pickled, as ``("grow", (bytes needed, message))``)."""
        buffer = io.BytesIO()
        pickler = _BlockPickler(buffer)
        pickler.dump(message)
        if not pickler.arrays:
            return buffer.getvalue()
        if self.shm is None or self.shm.size < pickler.size:
            return pickle.dumps(("grow", (pickler.size, message)))
        for offset, array in pickler.arrays:
            np.copyto(np.ndarray(array.shape, array.dtype, buffer=self.shm.buf, offset=offset), array)
        return buffer.getvalue()

    def load(self, data: bytes) -> Any:
        """The parent: a reply unpickled, its arrays copied out of the block (the next call overwrites it)."""
        return _BlockUnpickler(io.BytesIO(data), self.shm).load()

    def grow(self, size: int) -> None:
        """The parent: replace the block by one of at least ``size`` bytes; the child maps it on the next call."""
        self.close()
        self.shm = create_shared_block(-(-size * 5 // 4 // _BLOCK_ROUND) * _BLOCK_ROUND)

    def close(self) -> None:
        """The parent: free the block."""
        if self.shm is not None:
            release_shared_block(self.shm, unlink=True)
            self.shm = None


class _BlockPickler(pickle.Pickler):
    """Pickles large plain numpy arrays as their place in the output block: ``(offset, shape, dtype)``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.arrays: List[Tuple[int, np.ndarray]] = []
        self.size = 0
        self._placed: Dict[int, tuple] = {}  # id(array) -> its place: an array met twice is written once

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if type(obj) is not np.ndarray or obj.nbytes < _SHARED_MIN_BYTES or obj.dtype.fields is not None \
                or obj.dtype.hasobject:
            return None
        place = self._placed.get(id(obj))
        if place is None:
            place = self._placed[id(obj)] = (self.size, obj.shape, obj.dtype.str)
            self.arrays.append((self.size, obj))
            self.size += -(-obj.nbytes // _ALIGN) * _ALIGN
        return place


class _BlockUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shm: Any) -> None:
        super().__init__(file)
        self.shm = shm
        self._loaded: Dict[int, np.ndarray] = {}

    def persistent_load(self, pid: tuple) -> np.ndarray:
        offset, shape, dtype = pid
        if offset not in self._loaded:
            self._loaded[offset] = np.ndarray(shape, np.dtype(dtype), buffer=self.shm.buf, offset=offset).copy()
        return self._loaded[offset]


class _SharedWeights:
    """The acting weights in one shared-memory block, as tensors laid out like the model's. The parent writes a
    version into it just before a request and the child reads it while answering, never both at once, so no
    weights are pickled (torch tensors pickle about 20x slower than they copy)."""

    def __init__(self, layout: List[Tuple[tuple, torch.dtype]], name: Optional[str] = None) -> None:
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout]
        offsets = [sum(-(-n // _ALIGN) * _ALIGN for n in sizes[:k]) for k in range(len(sizes))]
        total = (offsets[-1] + sizes[-1]) if sizes else 1
        self.layout = layout
        self.shm = create_shared_block(total) if name is None else attach_shared_block(name)
        self.tensors = [torch.frombuffer(self.shm.buf, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)
                        for (shape, dtype), offset in zip(layout, offsets)]

    def close(self, unlink: bool) -> None:
        """Drop the tensors, unmap the block, and (its creator) free it."""
        self.tensors = []
        release_shared_block(self.shm, unlink)


_SPLITS: Dict[int, List[Any]] = {}  # thread id -> [its CPUs before, the children's CPUs, collectors sharing them]
_SPLITS_LOCK = threading.Lock()


def _split_cpus(split: Optional[bool]) -> Optional[Tuple[int, Set[int]]]:
    """With ``split`` (None: when :func:`_two_free_cpus`), pin the calling thread to the CPU it runs on and return
    ``(its thread id, the CPUs for the child: the others)``; else None. A thread already split for another
    collector stays as it is, and the new child shares the other CPUs.

    Why: the learner and the threads that hand it data pass the GIL between them; on different CPUs every
    handover wakes a thread across CPUs and the learner loses its cache, which on two CPUs cost cartpole/dqn
    more than async mode gained (docs/engine.md, "When async pays"). With two free CPUs and two busy processes,
    one each costs the scheduler no freedom; with more, or with other work on them, it is left alone unless asked.
    """
    if split is False or not hasattr(os, "sched_getaffinity"):  # Linux only
        return None
    tid = threading.get_native_id()
    with _SPLITS_LOCK:
        shared = _SPLITS.get(tid)
        if shared is not None:
            shared[2] += 1
            return tid, shared[1]
        allowed = os.sched_getaffinity(0)
        if (split is None and not _two_free_cpus(allowed)) or len(allowed) < 2:
            return None
        with open("/proc/thread-self/stat") as f:
            here = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor": the CPU it last ran on
        here = here if here in allowed else min(allowed)
        os.sched_setaffinity(0, {here})
        _SPLITS[tid] = [allowed, allowed - {here}, 1]
        return tid, allowed - {here}


def _two_free_cpus(allowed: Set[int]) -> bool:
    """Whether this process may use exactly two CPUs, the machine's all, and no other process's thread is running
    or waiting for a CPU now (``/proc/loadavg``'s count of runnable threads, less this process's): a pinned thread
    could not move off a CPU another process keeps busy (cartpole/impala async beside a CPU hog: median 12.8 s
    pinned against 8.4 s free; docs/engine.md). Unknown (no /proc): not free."""
    if not len(allowed) == 2 == os.cpu_count():
        return False
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        own = 0
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                own += f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, ValueError, IndexError):
        return False
    return runnable <= own


def _unsplit(tid: int) -> None:
    """Give thread ``tid`` its CPUs back once the last collector that split them is closed."""
    with _SPLITS_LOCK:
        shared = _SPLITS[tid]
        shared[2] -= 1
        if shared[2]:
            return
        del _SPLITS[tid]
    try:
        os.sched_setaffinity(tid, shared[0])
    except OSError:  # that thread has ended
        pass


class _Child:
    """The process, the parent's end of its pipe, the shared weights and the CPUs to give back (kept apart from
    the collector for ``weakref.finalize``)."""

    def __init__(self, weights: _SharedWeights) -> None:
        self.weights = weights
        self.outputs = _OutputBlock()
        self.child: Optional[Child] = None
        self.pinned: Optional[int] = None  # the id of the thread it split CPUs with, until closed

    def close(self) -> None:
        """Ask the child to stop; kill it if it does not within a few seconds; free the shared weights."""
        if self.child is not None:
            self.child.stop(_CLOSE_TIMEOUT_S)
        self.weights.close(unlink=True)
        self.outputs.close()
        if self.pinned is not None:
            tid, self.pinned = self.pinned, None
            _unsplit(tid)


@declares(reads=("env_step", "env_episode", "collect_kwargs"), optional=("collect_kwargs",),
          writes=_OUTPUTS + ("env_step", "env_episode"))
class ProcessCollector:
    """Runs collection middleware in a child process; acts like that chain run here.

    ``build`` (sent with cloudpickle, so a closure works) makes ``(chain, policy, close)`` in the child:
    the middleware to run there in order (a collector first), the policy replica they act with, and what
    releases their envs; :func:`collection_builder` makes one. Before a call, the newest version of ``policy`` (the learner's)
    is copied into shared memory (``policy.acting_state(out=...)``) and the child's replica, when the
    number changed, acts on it under the same number, so collected rows record the version that produced them. What the
    chain writes comes back pickled, its numpy arrays of 64 KB or more (image batches) through a shared-memory block
    reused from call to call (see the module docstring). Episode events
    of the child are emitted here. A child that dies ends the run with an error saying how it ended;
    ``close()`` (or leaving a ``with`` block) stops it. ``state_dict()`` / ``load_state_dict()`` gather
    the chain's (env states, current observations, carried n-step rows) and the replica's collect state
    (its exploration generator, a recurrent policy's hidden state per env), so checkpoints and resume work
    as with the chain in-process. ``start_method``: multiprocessing's, by default its default, or "spawn"
    once this process has initialised CUDA (a forked child could not use it). ``split_cpus``: run this
    thread (and the threads it starts from now on, such as an async pipeline's) on the CPU it is on and
    the child on the others, until closed; None (the default) does so where this process may use exactly
    two CPUs, the machine's, and no other process runs or waits for a CPU as the collector starts.

    Reads ctx: ``env_step``, ``collect_kwargs``.
    Writes ctx: what the chain writes of ``trajectories``, ``trajectory_end_idx``, ``episodes``,
    ``train_data``, and the ``env_step`` / ``env_episode`` it adds.
    """

    def __init__(self, build: Builder, policy: Any, *, start_method: Optional[str] = None,
                 split_cpus: Optional[bool] = None) -> None:
        if not callable(getattr(policy, "acting_state", None)):
            raise TypeError(f"ProcessCollector needs the learner's policy (with acting_state()), got {policy!r}: "
                            f"pass the Policy object, not one of its views")
        self._policy = policy
        self._sent: Optional[int] = None
        layout = [(tuple(t.shape), t.dtype) for t in policy.acting_state()["tensors"]]
        self._child = _Child(_SharedWeights(layout))
        self._finalizer = weakref.finalize(self, self._child.close)
        try:
            split = _split_cpus(split_cpus)
            if split is not None:
                self._child.pinned = split[0]
            args = (cloudpickle.dumps(build), self._child.weights.shm.name, layout, torch.get_num_threads(),
                    None if split is None else split[1])
            self._child.child = Child(_serve, args, name="conveyor-collector",
                                      label="the collector process (pid {pid})", start_method=start_method)
            self._request(None)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"ProcessCollector(pid={self.pid})"

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._child.child.pid

    def __call__(self, ctx: OnlineRLContext) -> None:
        self._check_open()
        version: Tuple[int, Any] = (self._sent, None)  # the child already holds this one
        if self._policy.version != self._sent:  # a new one: into shared memory, which the child reads on this call
            acting = self._policy.acting_state(out=self._child.weights.tensors)
            version = (acting["version"], acting["extras"])
            self._sent = acting["version"]
        outputs_block = self._child.outputs
        block_name = None if outputs_block.shm is None else outputs_block.shm.name
        counters, outputs, events = self._request(("collect", (ctx.env_step, dict(ctx.collect_kwargs), version,
                                                               block_name)))
        for name, value in outputs.items():
            setattr(ctx, name, _restore(value))
        for name, delta in counters.items():
            setattr(ctx, name, getattr(ctx, name) + delta)
        for args in events:
            task.emit(EPISODE_EVENT, *args)

    def state_dict(self) -> Dict[str, Any]:
        """``chain``: the state of each middleware of the child's chain (None for those without state);
        ``collect``: the replica's ``collect_mode.state_dict()`` (None if it has none)."""
        return self._request(("state_dict", None))

    def load_state_dict(self, state: Any) -> None:
        """Restore the child's chain and collect state from :meth:`state_dict` (a list: the chain's only, as
        checkpoints written before the collect state was saved hold it)."""
        self._request(("load_state_dict", {"chain": state, "collect": None} if isinstance(state, list) else state))

    def close(self) -> None:
        """Stop the child process (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "ProcessCollector":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("ProcessCollector is closed: build a new one")

    def _request(self, message: Optional[tuple]) -> Any:
        """Send ``message`` (None: only wait for the child's first answer) and return the child's reply."""
        self._check_open()
        child = self._child.child
        try:
            if message is not None and not child.send_bytes(pickle.dumps(message)):
                raise child.lost()
            status, reply = self._child.outputs.load(child.recv_bytes())
        except ChildLost as lost:
            raise RuntimeError(f"{lost}: its envs and episodes in progress are lost; see its output above") from None
        if status == "error":
            raise unpack_exception(reply)
        if status == "grow":  # its arrays did not fit the output block: they came pickled, the next call has room
            size, (status, reply) = reply
            self._child.outputs.grow(size)
        return reply
