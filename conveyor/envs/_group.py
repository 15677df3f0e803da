"""``_EnvGroup``: the envs one process steps (all of them for :class:`SyncEnvManager`, one worker's share for
:class:`SubprocessEnvManager`), with auto-reset, episode bookkeeping and crash recovery. Both managers run this
same code, so they give identical trajectories for the same seed and actions.
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

import gymnasium as gym
import numpy as np

from conveyor.envs._core import (GAME_INFO, EnvCrashedError, EnvFn, EnvManagerStats, FailureStreaks, _build_failed,
                                 _error_text, _factory_name, _gave_up, pickle_env, reward_shape_of,
                                 seed_for_rebuild)
from conveyor.envs._spaces import SpaceLayout

_RESEED = 2
"""Last element of the key of :func:`seed_for_rebuild` for envs reseeded on a resume (0: rebuild, 1: respawn)."""


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
        self.reward_shape = reward_shape_of(first)
        self.obs_layout = SpaceLayout(self.observation_space, "observation")
        self.act_layout = SpaceLayout(self.action_space, "action")
        n = len(self.envs)
        self._returns = np.zeros((n, *self.reward_shape))
        self._lengths = [0] * n
        self._rebuilds = [0] * n
        self._streaks = FailureStreaks(n)
        self._t = 0
        self._seed: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """Per env of the group: the pickled env (None where it does not pickle), return and length so far,
        rebuild count."""
        return {"envs": [pickle_env(env) for env in self.envs], "returns": self._returns.tolist(),
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
            self._returns[j] = state["returns"][j]
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
        """Record the episode (or the game, see :data:`~conveyor.envs._core.GAME_INFO`) and reset the env."""
        info = dict(info)
        game = info.pop(GAME_INFO, None)
        if game is None:
            info["episode"] = {"r": float(self._returns[j].sum()), "l": self._lengths[j]}
            if self.reward_shape:
                info["episode"]["agent_r"] = self._returns[j].tolist()
        elif game["over"]:
            info["episode"] = {"r": float(game["r"]), "l": int(game["l"])}
        if "episode" in info:
            self.stats.episodes += 1
        self._returns[j] = 0.0
        self._lengths[j] = 0
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
