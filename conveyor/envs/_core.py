"""What both env managers share: the step result, counters, errors and the :class:`EnvManager` base.

The stepping of a group of envs, which both managers run, is in :mod:`conveyor.envs._group`.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import pickle
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence

import cloudpickle

import gymnasium as gym
import numpy as np

from conveyor.envs._spaces import AgentSpaces, SpaceLayout, agent_spaces

__all__ = ["GAME_INFO", "Timestep", "EnvManagerStats", "EnvCrashedError", "EnvManager", "EnvFn", "Restored"]

EnvFn = Callable[[], gym.Env]

log = logging.getLogger("conveyor.envs")

GAME_INFO = "game"
"""The info key by which an env whose episodes are parts of a game (Atari with life loss) reports the game at each
episode end: ``{"over": bool, "r": unclipped game return, "l": agent steps}``. Managers then put
``info["episode"]`` only at game over, holding the game's figures, and drop this key."""

@dataclass(slots=True)
class Timestep:
    """One lock-step of all envs; every field has leading dim ``env_num`` (see docs/design.md).

    ``obs`` is what to act on next (already the new episode's first observation where an episode
    ended); ``next_obs`` is the true next observation of this transition (the final observation where
    an episode ended, so truncated episodes can bootstrap). Where ``crashed`` is set the env raised, was
    rebuilt and its partial episode is dropped: that row is no transition. ``info[i]`` is env ``i``'s
    own info dict; at an episode's end it also holds ``"episode": {"r": return, "l": length}`` and
    ``"reset_info"``; on a crash it holds ``"error"``. For envs that report games (:data:`GAME_INFO`, e.g.
    Atari ending training episodes on a life loss) ``"episode"`` comes only at game over, with the whole
    game's unclipped return and length.

    ``reward`` is ``[env_num]``, or ``[env_num, *reward_shape]`` for envs that declare a ``reward_shape`` (see
    :func:`reward_shape_of`): a team's :class:`~conveyor.envs.MultiAgentEnv` gives ``[env_num, N_agent]``, its
    ``"episode"`` holds the team return ``"r"`` (the sum over agents) and ``"agent_r"``, the return of each agent.
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


def agent_returns(episode: Mapping[str, Any]) -> Optional[List[float]]:
    """Each agent's return from a team episode's ``info["episode"]`` (its ``agent_r``); None for one agent's."""
    if "agent_r" not in episode:
        return None
    return [float(r) for r in np.asarray(episode["agent_r"]).reshape(-1)]


@dataclass
class EnvManagerStats:
    """Counters over a manager's life, for logging and for spotting flaky envs."""

    env_steps: int = 0
    """Env transitions stepped (``env_num`` per ``step``, crashed ones included)."""
    episodes: int = 0
    """Episodes that ended normally (terminated or truncated); whole games for envs that report games."""
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


def reward_shape_of(env: gym.Env) -> tuple[int, ...]:
    """The shape of one env's reward: ``()`` for Gymnasium envs, ``reward_shape`` where the unwrapped env declares
    one (``(N_agent,)`` for :class:`~conveyor.envs.MultiAgentEnv`)."""
    return tuple(getattr(env.unwrapped, "reward_shape", ()))


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
    reward_shape: tuple[int, ...] = ()
    """The shape of one env's reward (``Timestep.reward`` is ``[env_num, *reward_shape]``): ``(N_agent,)`` for teams."""
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
        self._unpicklable: list[int] = []
        self.stats = EnvManagerStats()

    @property
    def env_num(self) -> int:
        """How many envs step in lock step (the leading dim of every batch)."""
        return self._env_num

    @property
    def agent_spaces(self) -> AgentSpaces:
        """For a team's envs: ``N_agent``, one agent's observation and action space, the state size (raises
        ValueError for single-agent envs)."""
        return agent_spaces(self.observation_space, self.action_space)

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
        if failed and failed != self._unpicklable:  # once per manager, not at every checkpoint
            log.warning("envs %s (%s) do not pickle: a resume will reseed them from the run seed and env step",
                        failed, self.env_id)
        self._unpicklable = failed
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
