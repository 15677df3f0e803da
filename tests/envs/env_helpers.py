"""Small envs for the env manager tests: counting, flaky, nested-space, hanging and broken ones."""
from __future__ import annotations

import threading
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class CountingEnv(gym.Env):
    """Observation ``[t, start]``: the step count and a seeded random start; terminates after ``length`` steps.

    Raises ``RuntimeError`` on every ``raise_every``-th call of ``step`` (0: never), and on its first
    ``reset`` if ``fail_first_reset``.
    """

    observation_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, length: int = 5, raise_every: int = 0, fail_first_reset: bool = False) -> None:
        self.length = length
        self.raise_every = raise_every
        self.fail_first_reset = fail_first_reset
        self.steps_called = 0
        self.t = 0
        self.start = 0.0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if self.fail_first_reset:
            self.fail_first_reset = False
            raise RuntimeError("reset failed on purpose")
        self.t = 0
        self.start = float(self.np_random.integers(0, 1000))
        return self._obs(), {"start": self.start}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self.action_space.contains(action), action
        self.steps_called += 1
        if self.raise_every and self.steps_called % self.raise_every == 0:
            raise RuntimeError(f"step {self.steps_called} failed on purpose")
        self.t += 1
        return self._obs(), float(action) + 1.0, self.t >= self.length, False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.start], np.float32)


class FirstResetFails:
    """An env factory whose first env raises in its first reset; the envs it builds later work."""

    def __init__(self) -> None:
        self.built = 0

    def __call__(self) -> CountingEnv:
        self.built += 1
        return CountingEnv(fail_first_reset=self.built == 1)


class NestedEnv(gym.Env):
    """Dict observations with a Tuple inside, and Tuple actions; values follow the step count and the seed."""

    observation_space = spaces.Dict({
        "pos": spaces.Box(-np.inf, np.inf, (2,), np.float32),
        "inner": spaces.Tuple((spaces.Discrete(10), spaces.Dict({"bits": spaces.MultiBinary(3)}))),
    })
    action_space = spaces.Tuple((spaces.Discrete(3), spaces.Box(-1.0, 1.0, (2,), np.float32)))

    def __init__(self, length: int = 4) -> None:
        self.length = length
        self.t = 0
        self.offset = 0.0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.t = 0
        self.offset = float(self.np_random.uniform(-1, 1))
        return self._obs(np.zeros(2, np.float32)), {}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        assert isinstance(action, tuple) and self.action_space.contains(action), action
        self.t += 1
        return self._obs(action[1]), float(action[0]), self.t >= self.length, False, {"t": self.t}

    def _obs(self, push: np.ndarray) -> dict:
        bits = np.array([self.t & 1, (self.t >> 1) & 1, (self.t >> 2) & 1], np.int8)
        return {"pos": np.array([self.t + self.offset, push[0]], np.float32),
                "inner": (self.t % 10, {"bits": bits})}


class HangingEnv(CountingEnv):
    """Blocks forever in its ``hang_at``-th step (a hung simulator), without sleeping."""

    def __init__(self, hang_at: int = 2) -> None:
        super().__init__(length=100)
        self.hang_at = hang_at

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.steps_called + 1 == self.hang_at:
            threading.Event().wait()
        return super().step(action)


class BrokenEnv(gym.Env):
    """Breaks several rules at once: wrong obs shape, string reward, int flags, unseeded randomness."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        return np.random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, Any, Any, Any, dict]:
        return np.zeros(4, np.float32), "1.0", 0, 0, {}


class TextObsEnv(gym.Env):
    """An observation space env managers cannot batch into arrays."""

    observation_space = spaces.Text(8)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return "a", {}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict]:
        return "b", 0.0, False, False, {}


gym.register("ConveyorTest/Counting-v0", entry_point=CountingEnv)
