"""What both env managers share: the step result, counters, errors, and the stepping of a group of envs.

``_EnvGroup`` holds the envs one process steps (all of them for :class:`SyncEnvManager`, one worker's
share for :class:`SubprocessEnvManager`) and does auto-reset, episode bookkeeping and crash recovery.
Both managers run this same code, so they give identical trajectories for the same seed and actions.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import cloudpickle

import gymnasium as gym
import numpy as np

from conveyor.envs._spaces import SpaceLayout

__all__ = ["Timestep", "EnvManagerStats", "EnvCrashedError", "EnvManager", "EnvFn", "Restored"]

EnvFn = Callable[[], gym.Env]

log = logging.getLogger("conveyor.envs")

_RESEED = 2
"""Last element of the key of :func:`seed_for_rebuild` for envs reseeded on a resume (0: rebuild, 1: respawn)."""


@dataclass(slots=True)
class Timestep:
    """One lock-step of all envs; every field has leading dim ``env_num`` (see docs/design.md).

    ``obs`` is what to act on next (already the new episode's first observation where an episode
    ended); ``next_obs`` is the true next observation of this transition (the final observation where
    an episode ended, so truncated episodes can bootstrap). Where ``crashed`` is set the env raised, was
    rebuilt and its partial episode is dropped: that row is no transition. ``info[i]`` is env ``i``'s
    own info dict; at an episode's end it also holds ``"episode": {"r": return, "l": length}`` and
    ``"reset_info"``; on a crash it holds ``"error"``.
    """

    obs: Any
    next_obs: Any
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    crashed: np.ndarray
    info: list[dict]

    @property
    def done(self) -> np.ndarray:
        """Where an episode ended this step (terminated or truncated)."""
        return self.terminated | self.truncated


@dataclass
class EnvManagerStats:
    """Counters over a manager's life, for logging and for spotting flaky envs."""

    env_steps: int = 0
    """Env transitions stepped (``env_num`` per ``step``, crashed ones included)."""
    episodes: int = 0
    """Episodes that ended normally (terminated or truncated)."""
    crashes: int = 0
    """Env failures: each exception from an env (or its rebuild) and each env of a worker process that died."""
    dropped_episodes: int = 0
    """Partial episodes discarded because their env crashed mid-episode."""
    worker_restarts: int = 0
    """Worker processes respawned after dying (``SubprocessEnvManager`` only)."""


@dataclass
class Restored:
    """What :meth:`EnvManager.load_state_dict` gives back: the observations to act on next, and the envs
    that could not be restored (their envs did not pickle) and start a new episode instead."""

    obs: Any
    """Batched observations, as :meth:`EnvManager.reset` returns them."""
    reseeded: list[int]
    """Indices of envs that were reset with a seed derived from the saved seed and env step."""


def pickle_env(env: gym.Env) -> bytes | None:
    """The env's whole state as bytes (pickle, then cloudpickle), or None if it does not pickle.

    The bytes are those of the env after one round trip, so an env saved, restored and saved again in
    the same state gives the same bytes (a first pickling may lay out the same state differently).
    """
    for dumps in (pickle.dumps, cloudpickle.dumps):
        try:
            return dumps(pickle.loads(dumps(env)))
        except Exception:
            continue
    return None


class EnvCrashedError(RuntimeError):
    """An env kept failing after ``max_retry`` rebuilds in a row, or could not be built at all.

    The original exception is chained (``__cause__``). The manager is closed when this is raised.
    """

    def __init__(self, message: str, env_index: int, env_id: str) -> None:
        super().__init__(message)
        self.env_index = env_index
        self.env_id = env_id

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.env_index, self.env_id)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _gave_up(index: int, env_id: str, failures: int, max_retry: int, exc: BaseException) -> EnvCrashedError:
    return EnvCrashedError(
        f"env {index} ({env_id}) gave up after {_failures(failures)}, more than max_retry={max_retry} rebuilds "
        f"allow; last error: {_error_text(exc)}. Fix the env, or raise env.max_retry if its failures are "
        f"transient.", index, env_id)


def _failures(n: int) -> str:
    return f"{n} consecutive failure{'' if n == 1 else 's'}"


def _build_failed(index: int, env_id: str, exc: BaseException) -> EnvCrashedError:
    if isinstance(exc, gym.error.UnregisteredEnv):
        fix = ("If the env is registered at run time, name it 'module:EnvId' so that worker processes started "
               "with spawn or forkserver import the module that registers it.")
    else:
        fix = "Check the env id, env_kwargs, or the env factory."
    return EnvCrashedError(f"env {index} ({env_id}) could not be built: {_error_text(exc)}. {fix}", index, env_id)


def _factory_name(fn: EnvFn) -> str:
    """A name for the envs a factory builds, for messages before any env exists."""
    env_id = getattr(fn, "env_id", None)
    if isinstance(env_id, str):
        return env_id
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__qualname__", type(fn).__name__)


def check_env_fns(env_fns: Any) -> list[EnvFn]:
    """Validate a manager's ``env_fns`` argument: a non-empty sequence of zero-argument env factories."""
    if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence) or not env_fns:
        raise TypeError(f"env_fns must be a non-empty list of env factories (e.g. [lambda: gym.make('CartPole-v1')] "
                        f"* 4), got {env_fns!r}")
    for i, fn in enumerate(env_fns):
        if isinstance(fn, gym.Env):
            raise TypeError(f"env_fns[{i}] is an env ({fn}), not a factory: pass a function that makes one, "
                            f"e.g. lambda: gym.make('CartPole-v1')")
        if not callable(fn):
            raise TypeError(f"env_fns[{i}] must be a callable returning a gymnasium.Env, got {fn!r}")
    return list(env_fns)


def seed_for_rebuild(base: int | None, *key: int) -> int | None:
    """A deterministic seed for a rebuilt env, from the manager's seed and a key such as (index, rebuild count)."""
    if base is None:
        return None
    return int(np.random.SeedSequence([base, *key]).generate_state(1)[0])


class FailureStreaks:
    """Consecutive failures per env (or per worker): a failure in the same or the next step as the last one
    continues the streak; a failure after a successful step starts a new one."""

    def __init__(self, n: int) -> None:
        self._count = [0] * n
        self._at = [-2] * n

    def fail(self, i: int, t: int) -> int:
        """Record a failure of ``i`` at step ``t``; return how many failures in a row ``i`` has had."""
        self._count[i] = self._count[i] + 1 if self._at[i] >= t - 1 else 1
        self._at[i] = t
        return self._count[i]


class _EnvGroup:
    """The envs of one process: steps them with same-step auto-reset and rebuilds the ones that raise.

    ``max_retry`` counts consecutive failures of one env: an env may be rebuilt ``max_retry`` times in
    a row without a successful step in between; the next failure raises :class:`EnvCrashedError`.
    A successful step between two failures starts the count again.
    """

    def __init__(self, env_fns: Sequence[EnvFn], first_index: int, max_retry: int, env_id: str | None,
                 stats: EnvManagerStats) -> None:
        self.env_fns = list(env_fns)
        self.first_index = first_index
        self.max_retry = max_retry
        self.stats = stats
        self.envs: list[gym.Env] = []
        self.env_id = env_id or _factory_name(self.env_fns[0])
        try:
            for j in range(len(self.env_fns)):
                self.envs.append(self._make(j))
                if env_id is None and j == 0:
                    self.env_id = _env_id_of(self.envs[0])
        except BaseException:
            self.close()
            raise
        first = self.envs[0]
        for j, env in enumerate(self.envs[1:], 1):
            if env.observation_space != first.observation_space or env.action_space != first.action_space:
                self.close()
                raise ValueError(
                    f"env {first_index + j} has spaces ({env.observation_space}, {env.action_space}) but env "
                    f"{first_index} has ({first.observation_space}, {first.action_space}): all envs of a manager "
                    f"must share their observation and action spaces")
        self.observation_space = first.observation_space
        self.action_space = first.action_space
        self.obs_layout = SpaceLayout(self.observation_space, "observation")
        self.act_layout = SpaceLayout(self.action_space, "action")
        n = len(self.envs)
        self._returns = [0.0] * n
        self._lengths = [0] * n
        self._rebuilds = [0] * n
        self._streaks = FailureStreaks(n)
        self._t = 0
        self._seed: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """Per env of the group: the pickled env (None where it does not pickle), return and length so far,
        rebuild count."""
        return {"envs": [pickle_env(env) for env in self.envs], "returns": list(self._returns),
                "lengths": list(self._lengths), "rebuilds": list(self._rebuilds)}

    def load_state_dict(self, state: dict[str, Any], t: int, seed: int | None, env_step: int,
                        obs: list[np.ndarray]) -> list[int]:
        """Put back the envs of :meth:`state_dict` (this group's rows); returns the indices of envs that did not
        unpickle: those are reset with a seed derived from ``seed``, their index and ``env_step`` (never the
        initial seed), and their first observation is written into ``obs``."""
        self._t, self._seed = t, seed
        reseeded = []
        for j, blob in enumerate(state["envs"]):
            env = None
            if blob is not None:
                try:
                    env = pickle.loads(blob)
                except Exception:
                    env = None
            self._returns[j] = float(state["returns"][j])
            self._lengths[j] = int(state["lengths"][j])
            self._rebuilds[j] = int(state["rebuilds"][j])
            if env is not None:
                _close_quietly(self.envs[j])
                self.envs[j] = env
                continue
            index = self.first_index + j
            reseeded.append(index)
            self._returns[j], self._lengths[j] = 0.0, 0
            try:
                o, _ = self.envs[j].reset(seed=seed_for_rebuild(seed, index, env_step, _RESEED))
            except Exception as exc:
                o = self._rebuild(j, exc)
            self.obs_layout.write(obs, j, o)
        return reseeded

    def _make(self, j: int) -> gym.Env:
        index = self.first_index + j
        try:
            env = self.env_fns[j]()
        except Exception as exc:
            raise _build_failed(index, self.env_id, exc) from exc
        if not isinstance(env, gym.Env):
            raise TypeError(f"env factory {index} returned {type(env).__name__}, not a gymnasium.Env: make the "
                            f"factory return gym.make(...) or an Env instance")
        return env

    def reset(self, seed: int | None, obs: list[np.ndarray], respawn: int = 0) -> None:
        """Reset every env and write the observations into ``obs``.

        Env ``i`` is seeded with ``seed + i``, or, in a worker process started in place of a dead one
        (``respawn`` > 0), with a seed derived from ``seed``, ``i`` and ``respawn``.
        """
        self._seed = seed
        layout = self.obs_layout
        for j, env in enumerate(self.envs):
            index = self.first_index + j
            if seed is None:
                env_seed = None
            else:
                env_seed = seed_for_rebuild(seed, index, respawn, 1) if respawn else seed + index
            try:
                o, _ = env.reset(seed=env_seed)
                layout.write(obs, j, o)
            except Exception as exc:
                layout.write(obs, j, self._rebuild(j, exc))
            self._returns[j] = 0.0
            self._lengths[j] = 0

    def step(self, actions: list[np.ndarray], obs: list[np.ndarray], next_obs: list[np.ndarray],
             reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
             crashed: np.ndarray) -> tuple[list[dict], bool]:
        """Step every env with its row of ``actions`` (leaf arrays) and write the results into the arrays.

        ``obs`` and ``next_obs`` are leaf arrays; every array has one row per env of this group.
        Returns the info dicts and whether anything beyond plain steps happened (an episode ended or
        an env crashed), so a worker knows when its counters changed.
        """
        self._t += 1
        obs_layout = self.obs_layout
        act_layout = self.act_layout
        flat_obs = obs_layout.flat
        next0 = next_obs[0] if flat_obs else None
        rows = actions[0] if act_layout.flat else None  # numpy scalars: Discrete.contains checks them faster than ints
        returns = self._returns
        lengths = self._lengths
        infos: list[dict] = [None] * len(self.envs)  # type: ignore[list-item]
        first_obs: list[tuple[int, Any]] = []  # (row, first obs of a new episode) where an env was reset
        crashed.fill(False)
        for j, env in enumerate(self.envs):
            try:
                o, r, term, trunc, info = env.step(rows[j] if rows is not None else act_layout.item(actions, j))
                reward[j] = r
                terminated[j] = term
                truncated[j] = trunc
                if flat_obs:
                    next0[j] = o
                else:
                    obs_layout.write(next_obs, j, o)
            except Exception as exc:
                o = self._rebuild(j, exc)
                obs_layout.write(next_obs, j, o)
                first_obs.append((j, o))
                reward[j] = 0.0
                terminated[j] = False
                truncated[j] = False
                crashed[j] = True
                returns[j] = 0.0
                lengths[j] = 0
                self.stats.dropped_episodes += 1
                infos[j] = {"error": _error_text(exc)}
                continue
            returns[j] += r
            lengths[j] += 1
            if term or trunc:
                info = self._end_episode(j, env, info, first_obs)
            infos[j] = info
        for leaf, next_leaf in zip(obs, next_obs):
            np.copyto(leaf, next_leaf)
        for j, o in first_obs:
            obs_layout.write(obs, j, o)
        return infos, bool(first_obs)

    def _end_episode(self, j: int, env: gym.Env, info: dict, first_obs: list[tuple[int, Any]]) -> dict:
        info = dict(info)
        info["episode"] = {"r": float(self._returns[j]), "l": self._lengths[j]}
        self._returns[j] = 0.0
        self._lengths[j] = 0
        self.stats.episodes += 1
        try:
            o, info["reset_info"] = env.reset()
        except Exception as exc:
            info["reset_info"] = {}
            o = self._rebuild(j, exc)
        first_obs.append((j, o))
        return info

    def _rebuild(self, j: int, exc: Exception) -> Any:
        """Replace env ``j`` after it raised ``exc``; return the new env's first observation."""
        index = self.first_index + j
        while True:
            self.stats.crashes += 1
            failures = self._streaks.fail(j, self._t)
            if failures > self.max_retry:
                self.close()
                raise _gave_up(index, self.env_id, failures, self.max_retry, exc) from exc
            _close_quietly(self.envs[j])
            self._rebuilds[j] += 1
            try:
                self.envs[j] = self._make(j)
                o, _ = self.envs[j].reset(seed=seed_for_rebuild(self._seed, index, self._rebuilds[j], 0))
                return o
            except Exception as again:
                exc = again.__cause__ if isinstance(again, EnvCrashedError) else again  # type: ignore[assignment]

    def close(self) -> None:
        """Close every env, ignoring errors from envs that are already broken."""
        for env in self.envs:
            _close_quietly(env)
        self.envs = []


def _close_quietly(env: gym.Env) -> None:
    try:
        env.close()
    except Exception:
        pass


def _env_id_of(env: gym.Env) -> str:
    spec = getattr(env, "spec", None)
    return spec.id if spec is not None else type(env.unwrapped).__name__


class EnvManager(abc.ABC):
    """Steps ``env_num`` Gymnasium envs in lock step (the protocol in docs/design.md).

    Use as a context manager, or call :meth:`close`. ``reset(seed=s)`` seeds env ``i`` with ``s + i``;
    a ``seed`` given to the constructor is used by the first :meth:`reset` called without one.

    An env that raises in ``reset`` or ``step`` is closed, rebuilt from its factory and reset (with a
    seed derived from the last seed, its index and its rebuild count); on that step its row has
    ``crashed`` set. ``max_retry`` is how many times one env may be rebuilt in a row: a failure in the
    step right after a rebuild continues the streak, a successful step ends it. One failure more raises
    :class:`EnvCrashedError` (naming the env, with the env's exception chained) and closes the manager.
    """

    env_id: str
    observation_space: gym.Space
    action_space: gym.Space
    stats: EnvManagerStats
    _obs_layout: SpaceLayout
    _act_layout: SpaceLayout

    def __init__(self, env_num: int, seed: int | None, max_retry: int) -> None:
        if not isinstance(max_retry, int) or isinstance(max_retry, bool) or max_retry < 0:
            raise ValueError(f"max_retry must be an int >= 0 (rebuilds allowed in a row per env), got {max_retry!r}")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
        self._env_num = env_num
        self._initial_seed = seed
        self._max_retry = max_retry
        self._needs_reset = True
        self._closed = False
        self._last_obs: Any = None
        self.stats = EnvManagerStats()

    @property
    def env_num(self) -> int:
        """How many envs step in lock step (the leading dim of every batch)."""
        return self._env_num

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or an :class:`EnvCrashedError` closed the manager)."""
        return self._closed

    def reset(self, seed: int | None = None) -> Any:
        """Reset all envs (env ``i`` seeded with ``seed + i`` when given) and return the batched first observation."""
        self._check_open("reset")
        if seed is None:
            seed, self._initial_seed = self._initial_seed, None
        elif not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
        obs = self._last_obs = self._reset(None if seed is None else int(seed))
        self._needs_reset = False
        return obs

    def step(self, action: Any) -> Timestep:
        """Step every env with its row of ``action`` (``[env_num, ...]``; nested dicts for Dict/Tuple spaces)."""
        if self._needs_reset:
            self._check_open("step")
            raise RuntimeError(f"{type(self).__name__}.step() called before reset(): call reset() first")
        ts = self._step(action)
        self._last_obs = ts.obs
        return ts

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything to go on exactly where the envs are: each env pickled (None where it does not pickle),
        per-env episode bookkeeping, the observations last returned, counters and the action space's RNG.

        Only after :meth:`reset`. A state loads into a manager of either kind with the same number of envs.
        """
        if self._needs_reset:
            self._check_open("state_dict")
            raise RuntimeError(f"{type(self).__name__}.state_dict() called before reset(): nothing to save yet")
        per_env = self._env_states()
        failed = [i for i, blob in enumerate(per_env["envs"]) if blob is None]
        if failed:
            log.warning("envs %s (%s) do not pickle: a resume will reseed them from the run seed and env step",
                        failed, self.env_id)
        rng = getattr(self.action_space, "np_random", None)
        return {"env_num": self._env_num, "per_env": per_env, "obs": self._last_obs, "t": self._step_count(),
                "seed": self._current_seed(), "stats": dataclasses.asdict(self.stats),
                "action_space_rng": rng.bit_generator.state if rng is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> Restored:
        """Restore a :meth:`state_dict`; returns the observations to act on next.

        Envs whose state did not pickle are reset instead, with seeds derived from the saved seed, their
        index and the env step (so a resume never replays the initial episodes); this is logged and they
        are listed in :attr:`Restored.reseeded`.
        """
        self._check_open("load_state_dict")
        if state.get("env_num") != self._env_num:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state holds {state.get('env_num')} envs, "
                             f"this manager has {self._env_num}; resume with the same env count")
        for key, value in state["stats"].items():  # in place: env groups count into this same object
            setattr(self.stats, key, value)
        reseeded = self._load_env_states(state["per_env"], int(state["t"]), state["seed"], self.stats.env_steps)
        obs = self._merge_reseeded(state["obs"], reseeded)
        if state.get("action_space_rng") is not None and getattr(self.action_space, "np_random", None) is not None:
            self.action_space.np_random.bit_generator.state = state["action_space_rng"]
        if reseeded:
            log.warning("envs %s (%s) could not be restored from the checkpoint (they do not pickle): they start "
                        "new episodes seeded from the run seed and env step %d", reseeded, self.env_id,
                        self.stats.env_steps)
        self._initial_seed = None
        self._needs_reset = False
        self._last_obs = obs
        return Restored(obs, reseeded)

    @abc.abstractmethod
    def _env_states(self) -> dict[str, list]: ...

    @abc.abstractmethod
    def _load_env_states(self, per_env: dict[str, list], t: int, seed: int | None, env_step: int) -> list[int]: ...

    @abc.abstractmethod
    def _reseeded_rows(self) -> list[np.ndarray]:
        """Leaf arrays holding, at the rows of reseeded envs, their new first observations."""

    def _merge_reseeded(self, obs: Any, reseeded: list[int]) -> Any:
        """``obs`` with the rows of reseeded envs replaced by their new first observations."""
        if not reseeded:
            return obs
        layout = self._obs_layout
        leaves = [np.array(leaf, copy=True) for leaf in layout.leaves_of(obs)]
        for leaf, new in zip(leaves, self._reseeded_rows()):
            leaf[reseeded] = new[reseeded]
        return layout.nest(leaves)

    @abc.abstractmethod
    def _step_count(self) -> int: ...

    @abc.abstractmethod
    def _current_seed(self) -> int | None: ...

    def close(self) -> None:
        """Close every env (and worker process); safe to call twice."""
        if not self._closed:
            self._closed = True
            self._needs_reset = True
            self._close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.{what}() called on a closed manager: build a new one")

    def _actions(self, action: Any) -> list[np.ndarray]:
        """The leaf arrays of a batched action, cast to the action space's dtypes and checked for shape."""
        layout = self._act_layout
        if layout.flat:
            leaves = [action]
        else:
            try:
                leaves = layout.leaves_of(action)
            except (KeyError, IndexError, TypeError) as exc:
                raise ValueError(f"action {action!r} does not match the action space {self.action_space}: "
                                 f"no part {exc}") from None
        out = []
        for leaf, shape, dtype in zip(leaves, layout.shapes, layout.dtypes):
            array = np.asarray(leaf, dtype=dtype)
            if array.shape[:1] != (self._env_num,) or array.shape[1:] != shape:
                raise ValueError(f"action has shape {array.shape}, expected {(self._env_num, *shape)}: one row per "
                                 f"env of the action space {self.action_space}")
            out.append(array)
        return out

    def __enter__(self) -> "EnvManager":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<{type(self).__name__} {self.env_id} x{self._env_num}{state}>"

    @abc.abstractmethod
    def _reset(self, seed: int | None) -> Any: ...

    @abc.abstractmethod
    def _step(self, action: Any) -> Timestep: ...

    @abc.abstractmethod
    def _close(self) -> None: ...
