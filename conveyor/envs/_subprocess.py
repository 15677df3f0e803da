"""``SubprocessEnvManager``: envs stepped in worker processes, each worker stepping a group of envs.

Workers write observations, rewards and flags straight into one shared-memory block; the parent writes
actions there too. Pipes carry only small control messages: one byte to step, and an empty reply unless
an episode ended, an env crashed or an env returned a non-empty info dict.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import weakref
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Sequence

import cloudpickle
import numpy as np

from conveyor.envs._core import (EnvCrashedError, EnvFn, EnvManager, EnvManagerStats, FailureStreaks, Timestep,
                                 _factory_name, _failures, check_env_fns)
from conveyor.envs._group import _EnvGroup
from conveyor.envs._spaces import SpaceLayout
from conveyor.processes import (GOODBYE, Child, ChildLost, attach_shared_block, create_shared_block,
                                default_start_method, pack_exception, release_shared_block, send_quietly, stop,
                                unpack_exception)

__all__ = ["SubprocessEnvManager", "default_num_workers", "default_start_method"]

_STEP = b"s"
_ALIGN = 64
_CLOSE_TIMEOUT_S = 2.0


def default_num_workers(env_num: int) -> int:
    """One worker per CPU this process may run on, and never more workers than envs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(env_num, cpus))


class _Shared:
    """Numpy views of the shared-memory block: batch arrays for all envs, laid out the same in every process."""

    def __init__(self, buf: memoryview | None, obs_layout: SpaceLayout, act_layout: SpaceLayout, n: int,
                 reward_shape: tuple[int, ...]) -> None:
        self.nbytes = 0

        def take(shape: tuple, dtype: np.dtype) -> np.ndarray | None:
            offset = -(-self.nbytes // _ALIGN) * _ALIGN
            self.nbytes = offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            return None if buf is None else np.ndarray(shape, dtype, buffer=buf, offset=offset)

        self.obs = [take((n, *s), d) for s, d in zip(obs_layout.shapes, obs_layout.dtypes)]
        self.next_obs = [take((n, *s), d) for s, d in zip(obs_layout.shapes, obs_layout.dtypes)]
        self.reward = take((n, *reward_shape), np.dtype(np.float32))
        self.terminated = take((n,), np.dtype(np.bool_))
        self.truncated = take((n,), np.dtype(np.bool_))
        self.crashed = take((n,), np.dtype(np.bool_))
        self.action = [take((n, *s), d) for s, d in zip(act_layout.shapes, act_layout.dtypes)]


def _worker(conn: Connection, fns_blob: bytes, first_index: int, max_retry: int, env_id: str | None) -> None:
    """A worker process (a :class:`conveyor.processes.Child`): builds its envs, then steps them on command,
    writing results into shared memory."""
    group = shm = None
    try:
        stats = EnvManagerStats()
        group = _EnvGroup(cloudpickle.loads(fns_blob), first_index, max_retry, env_id, stats)
        conn.send_bytes(pickle.dumps(("ready", group.observation_space, group.action_space, group.reward_shape,
                                      group.env_id)))
        command, arg = pickle.loads(conn.recv_bytes())
        if command == "attach":
            shm = attach_shared_block(arg[0])
            _serve(conn, group, stats, _Shared(shm.buf, group.obs_layout, group.act_layout, arg[1], group.reward_shape))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the parent went away or is shutting down
    except EnvCrashedError as exc:
        send_quietly(conn, ("crashed", exc.args[0], exc.env_index, exc.env_id, pack_exception(exc.__cause__ or exc)))
    except BaseException as exc:
        send_quietly(conn, ("error", pack_exception(exc)))
    finally:
        if group is not None:
            group.close()
        if shm is not None:
            release_shared_block(shm, unlink=False)
        conn.close()


def _serve(conn: Connection, group: _EnvGroup, stats: EnvManagerStats, shared: _Shared) -> None:
    """Answer the parent's commands until it says close: one byte to step, pickled tuples otherwise."""
    rows = slice(group.first_index, group.first_index + len(group.envs))
    obs = [a[rows] for a in shared.obs]
    outputs = (obs, [a[rows] for a in shared.next_obs], shared.reward[rows], shared.terminated[rows],
               shared.truncated[rows], shared.crashed[rows])
    actions = [a[rows] for a in shared.action]
    reported = (0, 0, 0)
    while True:
        data = conn.recv_bytes()
        if data == _STEP:
            infos, events = group.step(actions, *outputs)
            if not events and not any(infos):
                conn.send_bytes(b"")
                continue
        else:
            command, arg = pickle.loads(data)
            infos = result = None
            if command == "close":
                return
            if command == "state":
                result = group.state_dict()
            elif command == "load":
                result = group.load_state_dict(*arg, obs)
            else:
                group.reset(arg[0], obs, respawn=arg[1])
        counts = (stats.episodes, stats.crashes, stats.dropped_episodes)
        deltas = tuple(now - before for now, before in zip(counts, reported))
        conn.send_bytes(pickle.dumps(("ok", infos, deltas) if result is None else ("ok", infos, deltas, result)))
        reported = counts


class _Resources:
    """What a manager must release: its worker processes and shared memory (kept apart for ``weakref.finalize``)."""

    def __init__(self, num_workers: int) -> None:
        self.children: list[Child | None] = [None] * num_workers
        self.shm: SharedMemory | None = None

    def release(self) -> None:
        """Ask workers to stop, kill those that do not, close the pipes and free the shared memory."""
        children = [child for child in self.children if child is not None]
        stop(children, _CLOSE_TIMEOUT_S, GOODBYE)
        for child in children:
            child.close()
        if self.shm is not None:
            release_shared_block(self.shm, unlink=True)
            self.shm = None


class SubprocessEnvManager(EnvManager):
    """Steps envs in ``num_workers`` processes, each stepping ``env_num / num_workers`` envs in turn.

    Pays off for envs that take a millisecond or more per step; for cheap envs the process round trip
    costs more than it saves (use :class:`SyncEnvManager`). A worker process that dies (e.g. killed
    by a signal) or, with ``step_timeout``, hangs is replaced, and its envs' partial episodes are
    dropped (``crashed`` set on that step); ``max_retry`` bounds the deaths in a row per worker too.
    Env factories are sent to the workers with cloudpickle, so lambdas work.

    ``start_method`` defaults to multiprocessing's default ("fork" on Linux before Python 3.14: workers
    start in ~20 ms and scripts need no ``if __name__ == "__main__"`` guard). Pass "forkserver" or
    "spawn" if the envs use threads or libraries that break when forked (e.g. torch, CUDA) in a parent
    that already uses them; those re-import the env's modules in each worker (~0.5 s per start here).
    A parent that has initialised CUDA gets "spawn" by default (:func:`default_start_method`).
    """

    def __init__(self, env_fns: Sequence[EnvFn], *, num_workers: int | None = None, seed: int | None = None,
                 max_retry: int = 3, start_method: str | None = None, step_timeout: float | None = None,
                 env_id: str | None = None) -> None:
        env_fns = check_env_fns(env_fns)
        n = len(env_fns)
        super().__init__(n, seed, max_retry)
        if num_workers is None:
            num_workers = default_num_workers(n)
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or not 1 <= num_workers <= n:
            raise ValueError(f"num_workers must be an int from 1 to the number of envs ({n}), got {num_workers!r}")
        if start_method is not None and start_method not in mp.get_all_start_methods():
            raise ValueError(f"start_method must be one of {mp.get_all_start_methods()}, got {start_method!r}")
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be a number of seconds > 0 or None, got {step_timeout!r}")
        self._start_method = start_method
        self._step_timeout = step_timeout
        edges = np.linspace(0, n, num_workers + 1).round().astype(int).tolist()
        self._bounds = list(zip(edges[:-1], edges[1:]))
        try:
            self._blobs = [cloudpickle.dumps(env_fns[a:b]) for a, b in self._bounds]
        except Exception as exc:
            raise TypeError(f"env factories cannot be pickled for the worker processes ({type(exc).__name__}: "
                            f"{exc}); make them plain functions or conveyor.envs.EnvFactory objects") from exc
        self.env_id = env_id or _factory_name(env_fns[0])
        self._given_env_id = env_id
        self._res = _Resources(num_workers)
        self._finalizer = weakref.finalize(self, self._res.release)
        self._shared: _Shared | None = None
        self._seed: int | None = None
        self._t = 0
        self._respawns = [0] * num_workers
        self._deaths = FailureStreaks(num_workers)
        try:
            for w in range(num_workers):
                self._start(w)
            for w in range(num_workers):
                try:
                    obs_space, act_space, reward_shape, found_id = self._handshake(w)
                except ChildLost as lost:
                    raise RuntimeError(f"{lost} while building envs {self._env_range(w)}") from None
                if w == 0:
                    self.observation_space, self.action_space, self.env_id = obs_space, act_space, found_id
                    self.reward_shape = reward_shape
                else:
                    self._check_spaces(w, obs_space, act_space, reward_shape)
            self._obs_layout = SpaceLayout(self.observation_space, "observation")
            self._act_layout = SpaceLayout(self.action_space, "action")
            size = _Shared(None, self._obs_layout, self._act_layout, n, self.reward_shape).nbytes
            self._res.shm = create_shared_block(size)
            self._shared = _Shared(self._res.shm.buf, self._obs_layout, self._act_layout, n, self.reward_shape)
            for w in range(num_workers):
                self._attach(w)
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        """How many worker processes step the envs."""
        return len(self._bounds)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the current workers (they change when a dead worker is replaced)."""
        return [child.pid for child in self._res.children]  # type: ignore[union-attr]

    def _start(self, w: int) -> None:
        args = (self._blobs[w], self._bounds[w][0], self._max_retry, self._given_env_id)
        self._res.children[w] = Child(_worker, args, name=f"conveyor-env-worker-{w}", label=f"worker process {w}",
                                      start_method=self._start_method)

    def _child(self, w: int) -> Child:
        child = self._res.children[w]
        assert child is not None
        return child

    def _handshake(self, w: int) -> tuple[Any, Any, tuple[int, ...], str]:
        """Wait until worker ``w`` has built its envs; return their spaces, reward shape and env id."""
        _, obs_space, act_space, reward_shape, env_id = self._reply(w, None)
        return obs_space, act_space, reward_shape, env_id

    def _check_spaces(self, w: int, obs_space: Any, act_space: Any, reward_shape: tuple[int, ...]) -> None:
        if (obs_space, act_space, reward_shape) != (self.observation_space, self.action_space, self.reward_shape):
            raise ValueError(f"env {self._bounds[w][0]} has spaces ({obs_space}, {act_space}) but env 0 has "
                             f"({self.observation_space}, {self.action_space}): all envs of a manager must share "
                             f"their observation and action spaces")

    def _attach(self, w: int) -> None:
        assert self._res.shm is not None
        self._send(w, pickle.dumps(("attach", (self._res.shm.name, self._env_num))))

    def _send(self, w: int, data: bytes) -> bool:
        """Send to worker ``w``; False if its pipe is broken (the worker died)."""
        return self._child(w).send_bytes(data)

    def _lost(self, w: int) -> ChildLost:
        """Why worker ``w``'s pipe broke: how its process ended."""
        return self._child(w).lost()

    def _reply(self, w: int, timeout: float | None) -> Any:
        """Worker ``w``'s decoded reply (``None`` for an empty one); raises what the worker reported (and
        :class:`ChildLost` if it died or, with ``timeout``, did not answer in time)."""
        data = self._child(w).recv_bytes(timeout, "step_timeout")
        if not data:
            return None
        reply = pickle.loads(data)
        if reply[0] == "crashed":
            _, message, index, env_id, cause = reply
            self.close()
            raise EnvCrashedError(message, index, env_id) from unpack_exception(cause)
        if reply[0] == "error":
            self.close()
            raise unpack_exception(reply[1])
        return reply

    def _env_range(self, w: int) -> str:
        a, b = self._bounds[w]
        return f"{a}-{b - 1}" if b - a > 1 else str(a)

    def _reset(self, seed: int | None) -> Any:
        self._seed = seed
        shared = self._shared
        assert shared is not None
        command = pickle.dumps(("reset", (seed, 0)))
        sent = [self._send(w, command) for w in range(self.num_workers)]
        for w in range(self.num_workers):
            try:
                if not sent[w]:
                    raise self._lost(w)
                self._count(self._reply(w, None))
            except ChildLost as lost:
                self._replace(w, str(lost))
        return self._obs_layout.nest([a.copy() for a in shared.obs])

    def _step(self, action: Any) -> Timestep:
        shared = self._shared
        assert shared is not None
        self._t += 1
        for buf, leaf in zip(shared.action, self._actions(action)):
            buf[...] = leaf
        sent = [self._send(w, _STEP) for w in range(self.num_workers)]
        infos: list[dict] = [{} for _ in range(self._env_num)]
        for w in range(self.num_workers):
            try:
                if not sent[w]:
                    raise self._lost(w)
                reply = self._reply(w, self._step_timeout)
            except ChildLost as lost:
                self._replace(w, str(lost))
                self._mark_crashed(w, str(lost), infos)
                continue
            if reply is not None:
                a, b = self._bounds[w]
                infos[a:b] = reply[1]
                self._count(reply)
        self.stats.env_steps += self._env_num
        layout = self._obs_layout
        return Timestep(layout.nest([a.copy() for a in shared.obs]), layout.nest([a.copy() for a in shared.next_obs]),
                        shared.reward.copy(), shared.terminated.copy(), shared.truncated.copy(),
                        shared.crashed.copy(), infos)

    def _count(self, reply: Any) -> None:
        if reply is not None:
            episodes, crashes, dropped = reply[2]
            self.stats.episodes += episodes
            self.stats.crashes += crashes
            self.stats.dropped_episodes += dropped

    def _mark_crashed(self, w: int, reason: str, infos: list[dict]) -> None:
        """The rows of a replaced worker's envs: no transition, the new episodes' first observations."""
        shared = self._shared
        assert shared is not None
        a, b = self._bounds[w]
        for obs, next_obs in zip(shared.obs, shared.next_obs):
            next_obs[a:b] = obs[a:b]
        shared.reward[a:b] = 0.0
        shared.terminated[a:b] = False
        shared.truncated[a:b] = False
        shared.crashed[a:b] = True
        infos[a:b] = [{"error": reason} for _ in range(a, b)]
        self.stats.dropped_episodes += b - a

    def _replace(self, w: int, reason: str) -> None:
        """Start a new worker in place of dead worker ``w`` and reset its envs (with seeds derived for the respawn)."""
        a, b = self._bounds[w]
        while True:
            in_a_row = self._deaths.fail(w, self._t)
            self.stats.crashes += b - a
            child = self._child(w)
            child.kill()
            child.wait()
            child.close()
            if in_a_row > self._max_retry:
                self.close()
                raise EnvCrashedError(
                    f"envs {self._env_range(w)} ({self.env_id}) gave up after {_failures(in_a_row)} of their worker "
                    f"process, more than max_retry={self._max_retry} restarts allow; last: {reason}. Find out what "
                    f"kills the process (memory, signals), or raise env.max_retry.", a, self.env_id
                ) from ChildLost(reason)
            self._respawns[w] += 1
            self.stats.worker_restarts += 1
            try:
                self._start(w)
                self._check_spaces(w, *self._handshake(w)[:3])
                self._attach(w)
                if not self._send(w, pickle.dumps(("reset", (self._seed, self._respawns[w])))):
                    raise self._lost(w)
                self._count(self._reply(w, None))
                return
            except ChildLost as lost:
                reason = str(lost)
            except BaseException:
                self.close()
                raise

    def _ask_all(self, commands: list[bytes], what: str) -> list[Any]:
        """Send each worker its command and gather the results; a lost worker is an error (no respawn here)."""
        sent = [self._send(w, command) for w, command in enumerate(commands)]
        results = []
        for w in range(self.num_workers):
            try:
                if not sent[w]:
                    raise self._lost(w)
                reply = self._reply(w, None)
            except ChildLost as lost:
                self.close()
                raise RuntimeError(f"{lost} while {what} envs {self._env_range(w)}") from None
            self._count(reply)
            results.append(reply[3])
        return results

    def _env_states(self) -> dict[str, list]:
        merged: dict[str, list] = {}
        for part in self._ask_all([pickle.dumps(("state", None))] * self.num_workers, "saving the state of"):
            for key, values in part.items():
                merged.setdefault(key, []).extend(values)
        return merged

    def _load_env_states(self, per_env: dict[str, list], t: int, seed: int | None, env_step: int) -> list[int]:
        self._t, self._seed = t, seed
        commands = [pickle.dumps(("load", ({key: values[a:b] for key, values in per_env.items()}, t, seed, env_step)))
                    for a, b in self._bounds]
        return [i for part in self._ask_all(commands, "restoring") for i in part]

    def _reseeded_rows(self) -> list[np.ndarray]:
        assert self._shared is not None
        return [a.copy() for a in self._shared.obs]

    def _step_count(self) -> int:
        return self._t

    def _current_seed(self) -> int | None:
        return self._seed

    def _close(self) -> None:
        self._shared = None
        self._finalizer()
