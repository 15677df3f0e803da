"""``EnvpoolEnvManager``: envpool's batched C++ envs (Atari, MuJoCo) behind the lock-step manager protocol.

envpool resets an env on the step *after* its episode ended (that step returns the new episode's first
observation and ignores its action). The protocol wants that observation on the step that ended the
episode, so after a step with ended episodes the manager steps just those envs once more (envpool's
``env_id`` argument), which is the reset envpool would do next anyway; other envs wait for that call only.
"""
from __future__ import annotations

import difflib
from typing import Any, Mapping

import gymnasium as gym
import numpy as np

from conveyor.envs._atari import is_atari_id, require_extra
from conveyor.envs._core import EnvManager, Timestep, seed_for_rebuild
from conveyor.envs._spaces import SpaceLayout
from conveyor.schema import ConfigError

__all__ = ["EnvpoolEnvManager", "envpool_task_id", "envpool_atari_kwargs"]

_RESEED = 2
"""Last element of the key of :func:`seed_for_rebuild` for a pool reseeded on a resume (as the other managers)."""

_INT32_MAX = 2**31 - 1
"""envpool takes seeds below this; a run's seed (below 2**32) and a rebuilt pool's are folded into that range."""


def envpool_task_id(env_id: str) -> str:
    """envpool's name for a Gymnasium id (``ALE/Breakout-v5`` -> ``Breakout-v5``); a one-line error if it has none."""
    require_extra("envpool", "envpool", why="env.manager 'envpool'")
    import envpool

    task_id = env_id[len("ALE/"):] if is_atari_id(env_id) else env_id
    known = envpool.list_all_envs()
    if task_id not in known:
        hint = difflib.get_close_matches(task_id, known, n=1)
        raise ConfigError(f"config key 'env.env_id' is {env_id!r}, which envpool does not provide (as {task_id!r})"
                          f"{f': did you mean {hint[0]!r}?' if hint else ''}; use manager 'sync' or 'subprocess'")
    return task_id


def envpool_atari_kwargs(atari: Mapping[str, Any], collector: bool) -> dict[str, Any]:
    """envpool's own Atari preprocessing set from ``cfg.env.atari`` (life loss and clipping for collectors only)."""
    return {"frame_skip": atari["frame_skip"], "img_height": atari["screen_size"], "img_width": atari["screen_size"],
            "stack_num": atari["frame_stack"], "noop_max": atari["noop_max"],
            "repeat_action_probability": atari["repeat_action_probability"],
            "episodic_life": collector and atari["terminal_on_life_loss"],
            "reward_clip": collector and atari["clip_reward"], "use_fire_reset": atari["fire_reset"]}


class EnvpoolEnvManager(EnvManager):
    """Steps ``env_num`` envs of one envpool pool in lock step (``batch_size == env_num``).

    ``task_id`` is envpool's env name; ``envpool_kwargs`` go to ``envpool.make`` (e.g. Atari preprocessing).
    Env ``i`` of a pool seeded ``s`` is seeded ``s + i`` by envpool; a ``reset(seed)`` with another seed
    builds a new pool with it. Atari pools report full games: ``info["episode"]`` comes at game over with
    the unclipped return, also when life loss ends training episodes. Envs never crash here.

    envpool envs cannot be pickled: a checkpoint holds the episode bookkeeping only, and a resume starts
    new episodes in a pool seeded from the saved seed and env step (all envs are listed as reseeded).
    """

    def __init__(self, task_id: str, env_num: int, *, seed: int | None = None, num_threads: int | None = None,
                 env_id: str | None = None, **envpool_kwargs: Any) -> None:
        require_extra("envpool", "envpool", why="env.manager 'envpool'")
        if not isinstance(env_num, int) or env_num < 1:
            raise ValueError(f"env_num must be an int >= 1, got {env_num!r}")
        super().__init__(env_num, seed, max_retry=0)
        self._task_id = task_id
        self._make_kwargs = dict(envpool_kwargs, num_threads=num_threads or 0)
        self.env_id = env_id or task_id
        self._pool: Any = None
        self._pool_seed = -1
        self._fresh = False
        self._seed: int | None = None
        self._build(_seed_or_random(seed))
        self.observation_space: gym.Space = self._pool.single_observation_space
        self.action_space: gym.Space = self._pool.single_action_space
        self._obs_layout = SpaceLayout(self.observation_space, "observation")
        self._act_layout = SpaceLayout(self.action_space, "action")
        if not (self._obs_layout.flat and self._act_layout.flat):
            self.close()
            raise ValueError(f"envpool env {task_id} has nested spaces, which EnvpoolEnvManager does not support")
        self._ids = np.arange(env_num, dtype=np.int32)
        self._idle_action = np.zeros((env_num, *self.action_space.shape), self.action_space.dtype)
        self._returns = np.zeros(env_num, np.float64)
        self._lengths = np.zeros(env_num, np.int64)
        self._t = 0
        self._new_rows: Any = None

    def _build(self, seed: int) -> None:
        import envpool

        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._pool = envpool.make(self._task_id, env_type="gymnasium", num_envs=self._env_num,
                                  batch_size=self._env_num, seed=seed % _INT32_MAX, **self._make_kwargs)
        self._pool_seed = seed
        self._fresh = True

    def _reset_pool(self, seed: int | None) -> np.ndarray:
        """Reset every env; a seed other than that of a pool not yet reset builds a new pool (envpool seeds its
        envs once, when it builds them)."""
        if seed is not None and not (self._fresh and seed == self._pool_seed):
            self._build(seed)
        self._fresh = False
        obs, info = self._pool.reset()
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return _in_env_order(obs, info["env_id"])

    def _reset(self, seed: int | None) -> Any:
        self._seed, self._t = seed, 0
        return self._reset_pool(seed)

    def _step(self, action: Any) -> Timestep:
        actions = self._actions(action)[0]
        next_obs, reward, terminated, truncated, info = self._pool.step(actions, self._ids)
        self._t += 1
        self.stats.env_steps += self._env_num
        raw = info.get("reward", reward)  # Atari: the unclipped reward
        self._returns += raw
        self._lengths += 1
        terminated = terminated.astype(np.bool_, copy=False)
        truncated = truncated.astype(np.bool_, copy=False)
        done = terminated | truncated
        infos: list[dict] = [{} for _ in range(self._env_num)]
        obs = next_obs
        if done.any():
            ended = np.flatnonzero(done)
            game_over = done if "terminated" not in info else (info["terminated"].astype(bool) | truncated)
            for i in ended.tolist():
                if game_over[i]:
                    infos[i]["episode"] = {"r": float(self._returns[i]), "l": int(self._lengths[i])}
                    self._returns[i] = 0.0
                    self._lengths[i] = 0
                    self.stats.episodes += 1
                infos[i]["reset_info"] = {}
            first, _, _, _, reset_info = self._pool.step(self._idle_action[: len(ended)], ended.astype(np.int32))
            obs = next_obs.copy()
            obs[reset_info["env_id"]] = first
        return Timestep(obs, next_obs, reward.astype(np.float32, copy=False), terminated, truncated,
                        np.zeros(self._env_num, np.bool_), infos)

    def _env_states(self) -> dict[str, list]:
        return {"envs": [None] * self._env_num, "returns": self._returns.tolist(), "lengths": self._lengths.tolist()}

    def _load_env_states(self, per_env: dict[str, list], t: int, seed: int | None, env_step: int) -> list[int]:
        self._new_rows = [self._reset_pool(seed_for_rebuild(_seed_or_random(seed), env_step, _RESEED))]
        self._seed, self._t = seed, t
        return list(range(self._env_num))

    def _reseeded_rows(self) -> list[np.ndarray]:
        return self._new_rows

    def _step_count(self) -> int:
        return self._t

    def _current_seed(self) -> int | None:
        return self._seed

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _seed_or_random(seed: int | None) -> int:
    return int(np.random.SeedSequence().generate_state(1)[0] >> 1) if seed is None else int(seed)


def _in_env_order(obs: np.ndarray, env_id: np.ndarray) -> np.ndarray:
    if (env_id[1:] > env_id[:-1]).all():
        return obs
    out = np.empty_like(obs)
    out[env_id] = obs
    return out
