"""``check_env``: a smoke test of an env against what Conveyor's env managers rely on."""
from __future__ import annotations

import copy
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from conveyor.envs._config import EnvFactory, check_env_id
from conveyor.envs._core import EnvFn, reward_shape_of
from conveyor.envs._spaces import SpaceLayout
from conveyor.envs._subprocess import SubprocessEnvManager
from conveyor.envs._sync import SyncEnvManager
from conveyor.schema import ConfigError

__all__ = ["EnvCheckError", "check_env"]


class EnvCheckError(Exception):
    """An env failed :func:`check_env`; ``problems`` lists every problem found, one line each."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.name = name
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"env {name} failed {len(self.problems)} check(s):\n{lines}")

    def __reduce__(self) -> tuple:
        return type(self), (self.name, self.problems)


class _Copies:
    """A picklable factory of copies of one env instance (for the manager round trip)."""

    def __init__(self, env: gym.Env) -> None:
        self.env = env

    def __call__(self) -> gym.Env:
        return copy.deepcopy(self.env)


def check_env(env_or_id: gym.Env | str | EnvFn, *, seed: int = 0, steps: int = 30) -> None:
    """Smoke-test an env (an id, a factory or an instance); return ``None`` or raise :class:`EnvCheckError`.

    Checks that the spaces are valid and batchable, that ``reset`` and ``step`` return Gymnasium's
    tuples with observations in the observation space and correctly typed rewards and flags, that the
    same seed and actions give the same trajectory, and that ``SyncEnvManager`` and
    ``SubprocessEnvManager`` reproduce the single env's observations. Every problem found is listed
    in one error, not just the first. An instance passed in is stepped but not closed.
    """
    problems: list[str] = []
    name, env, factory, owned = _resolve(env_or_id)
    try:
        if not _check_spaces(env, problems):
            raise EnvCheckError(name, problems)
        batchable = not problems
        actions = _sample_actions(env.action_space, seed, steps)
        first = _rollout(env, seed, actions, problems, report=True)
        second = _rollout(env, seed, actions, problems, report=False)
        if first is not None and second is not None:
            _compare_rollouts(first, second, problems)
        if factory is not None and first is not None and batchable:
            _check_managers(factory, env.observation_space, env.action_space, seed, first, problems)
    finally:
        if owned:
            env.close()
    if problems:
        raise EnvCheckError(name, problems)


def _resolve(env_or_id: Any) -> tuple[str, gym.Env, Callable[[], gym.Env] | None, bool]:
    """The env to check, a factory of more like it (for the managers), and whether we own the env."""
    if isinstance(env_or_id, str):
        try:
            check_env_id(env_or_id)
        except ConfigError as exc:
            raise EnvCheckError(repr(env_or_id), [str(exc)]) from None
        factory: Callable[[], gym.Env] | None = EnvFactory(env_or_id)
        name = repr(env_or_id)
    elif isinstance(env_or_id, gym.Env):
        name = str(env_or_id)
        try:
            factory = _Copies(copy.deepcopy(env_or_id))
        except Exception:
            factory = None  # cannot copy it: the manager round trip needs an id or a factory
        return name, env_or_id, factory, False
    elif callable(env_or_id):
        factory = env_or_id
        name = getattr(env_or_id, "__qualname__", repr(env_or_id))
    else:
        raise TypeError(f"check_env takes an env id, an env factory or a gymnasium.Env, got {env_or_id!r}")
    try:
        env = factory()
    except Exception as exc:
        raise EnvCheckError(name, [f"building the env failed: {type(exc).__name__}: {exc}"]) from exc
    if not isinstance(env, gym.Env):
        raise EnvCheckError(name, [f"the factory returned {type(env).__name__}, not a gymnasium.Env"])
    return name, env, factory, True


def _check_spaces(env: gym.Env, problems: list[str]) -> bool:
    """Record space problems; False if a space is not a Space at all (then nothing else can be checked)."""
    usable = True
    for what in ("observation", "action"):
        space = getattr(env, f"{what}_space", None)
        if not isinstance(space, gym.spaces.Space):
            problems.append(f"{what}_space is {space!r}, not a gymnasium.spaces.Space: set self.{what}_space in "
                            f"the env's __init__")
            usable = False
            continue
        try:
            SpaceLayout(space, what)
        except TypeError as exc:
            problems.append(str(exc))
    return usable


def _sample_actions(space: gym.Space, seed: int, steps: int) -> list[Any]:
    sampler = copy.deepcopy(space)
    sampler.seed(seed)
    return [sampler.sample() for _ in range(steps)]


def _rollout(env: gym.Env, seed: int, actions: list[Any], problems: list[str], report: bool) -> list[tuple] | None:
    """Reset with ``seed`` and step through ``actions``: [(obs, reward, terminated, truncated), ...].

    With ``report``, records each kind of problem once; returns None if the env could not be run.
    """
    found: dict[str, str] = {}

    def note(key: str, problem: str) -> None:
        if report:
            found.setdefault(key, problem)

    space = env.observation_space
    reward_shape = reward_shape_of(env)
    trajectory: list[tuple] = []
    try:
        result = env.reset(seed=seed)
        if not (isinstance(result, tuple) and len(result) == 2):
            note("reset", f"reset() returned {_short(result)}; Gymnasium envs return (obs, info)")
            problems.extend(found.values())
            return None
        obs, info = result
        if not isinstance(info, dict):
            note("reset info", f"reset() returned info of type {type(info).__name__}, expected a dict")
        if not space.contains(obs):
            note("reset obs", f"reset() returned an observation outside observation_space: {_mismatch(space, obs)}")
        trajectory.append((obs, 0.0, False, False))
        for t, action in enumerate(actions):
            result = env.step(action)
            if not (isinstance(result, tuple) and len(result) == 5):
                note("step", f"step() returned {_short(result)}; Gymnasium envs return (obs, reward, terminated, "
                             f"truncated, info) (an old Gym env returns 4 values: port it or use a compatibility "
                             f"wrapper)")
                break
            obs, reward, terminated, truncated, info = result
            if not space.contains(obs):
                note("step obs", f"step() returned an observation outside observation_space at step {t}: "
                                 f"{_mismatch(space, obs)}")
            if reward_shape:
                if not (isinstance(reward, np.ndarray) and reward.shape == reward_shape
                        and np.issubdtype(reward.dtype, np.floating)):
                    note("reward", f"step() returned reward {reward!r}, expected a float array of the env's "
                                   f"reward_shape {reward_shape}")
            elif isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.integer, np.floating)):
                note("reward", f"step() returned reward {reward!r} of type {type(reward).__name__}, expected a float")
            for flag, value in (("terminated", terminated), ("truncated", truncated)):
                if not isinstance(value, (bool, np.bool_)):
                    note(flag, f"step() returned {flag}={value!r} of type {type(value).__name__}, expected a bool")
            if not isinstance(info, dict):
                note("step info", f"step() returned info of type {type(info).__name__}, expected a dict")
            trajectory.append((obs, reward, terminated, truncated))
            if terminated or truncated:
                obs, _ = env.reset()
                trajectory.append((obs, 0.0, False, False))
    except Exception as exc:
        note("raised", f"the env raised {type(exc).__name__}: {exc} after {len(trajectory)} calls")
        problems.extend(found.values())
        return None
    problems.extend(found.values())
    return trajectory


def _compare_rollouts(first: list[tuple], second: list[tuple], problems: list[str]) -> None:
    if not _same(first[0][0], second[0][0]):
        problems.append("reset(seed=...) twice with the same seed gave different observations: call "
                        "super().reset(seed=seed) and draw randomness from self.np_random")
        return
    if len(first) != len(second) or not all(_same(a, b) for a, b in zip(first, second)):
        problems.append("the same seed and actions gave different trajectories: draw all randomness from "
                        "self.np_random (seeded by super().reset(seed=seed))")


def _check_managers(factory: Callable[[], gym.Env], obs_space: gym.Space, action_space: gym.Space, seed: int,
                    trajectory: list[tuple], problems: list[str]) -> None:
    """Step two copies through SyncEnvManager and SubprocessEnvManager; both must match the single env."""
    obs_layout = SpaceLayout(obs_space)
    act_layout = SpaceLayout(action_space, "action")
    sampler = copy.deepcopy(action_space)
    sampler.seed(seed)
    batches = []
    for _ in range(5):
        rows = [act_layout.leaves_of(sampler.sample()) for _ in range(2)]
        batches.append(act_layout.nest([np.stack(leaf) for leaf in zip(*rows)]))
    results: dict[str, list[np.ndarray]] = {}
    for manager in (SyncEnvManager, SubprocessEnvManager):
        kwargs = {"num_workers": 1} if manager is SubprocessEnvManager else {}
        try:
            with manager([factory, factory], max_retry=0, **kwargs) as envs:
                if envs.observation_space != obs_space:
                    problems.append(f"{manager.__name__} built envs with observation space {envs.observation_space}, "
                                    f"not {obs_space}: the factory should build the same env each time")
                    continue
                first_obs = envs.reset(seed=seed)
                single = [np.asarray(leaf, dtype) for leaf, dtype in
                          zip(obs_layout.leaves_of(trajectory[0][0]), obs_layout.dtypes)]
                batched = [leaf[0] for leaf in obs_layout.leaves_of(first_obs)]
                if manager is SyncEnvManager and not all(_equal(a, b) for a, b in zip(single, batched)):
                    problems.append("SyncEnvManager.reset(seed=s) gave env 0 another first observation than "
                                    "reset(seed=s) on one env: the env's reset depends on more than its seed")
                frames = list(obs_layout.leaves_of(first_obs))
                for batch in batches:
                    step = envs.step(batch)
                    frames += [*obs_layout.leaves_of(step.obs), *obs_layout.leaves_of(step.next_obs), step.reward,
                               step.terminated, step.truncated]
                results[manager.__name__] = frames
        except Exception as exc:
            problems.append(f"{manager.__name__} round trip failed: {type(exc).__name__}: {exc}")
    if len(results) == 2 and not all(_equal(a, b) for a, b in zip(*results.values())):
        problems.append("SubprocessEnvManager and SyncEnvManager gave different results for the same seed and "
                        "actions: the env depends on process state (global RNG, time, files)")


def _same(a: Any, b: Any) -> bool:
    """Equal (nested) observations: dicts, tuples or arrays."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return _equal(a, b)


def _equal(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f"))


def _mismatch(space: gym.Space, obs: Any) -> str:
    if isinstance(space, gym.spaces.Box):
        array = np.asarray(obs)
        if array.shape != space.shape:
            return f"shape {array.shape}, expected {space.shape}"
        if not np.can_cast(array.dtype, space.dtype):
            return f"dtype {array.dtype}, expected {space.dtype}"
        return f"values outside [{space.low.min()}, {space.high.max()}] (got min {array.min()}, max {array.max()})"
    return f"{_short(obs)} is not in {space}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
