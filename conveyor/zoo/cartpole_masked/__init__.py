"""Zoo entries for a partially observable CartPole: the velocities are masked out of the observation.

Importing this package registers ``MaskedCartPole-v1`` with Gymnasium, so configs name it
``"conveyor.zoo.cartpole_masked:MaskedCartPole-v1"`` (``gymnasium.make`` imports the module first).
The observation is ``(cart position, pole angle)``: a feed-forward policy cannot tell which way the
pole is falling, a recurrent one can infer it from consecutive observations.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

__all__ = ["ENV_ID", "MaskVelocity", "make_masked_cartpole"]

ENV_ID = "conveyor.zoo.cartpole_masked:MaskedCartPole-v1"
"""The env id configs use: ``module:Id`` makes ``gymnasium.make`` import this package, which registers it."""

_KEPT = [0, 2]  # cart position and pole angle; velocities (1, 3) are dropped


class MaskVelocity(gym.ObservationWrapper):
    """Keeps CartPole's cart position and pole angle, dropping both velocities."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        space = env.observation_space
        self.observation_space = gym.spaces.Box(space.low[_KEPT], space.high[_KEPT], dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[_KEPT]


def make_masked_cartpole(**kwargs: Any) -> gym.Env:
    """CartPole-v1's dynamics with :class:`MaskVelocity` applied (the time limit comes from the registration)."""
    return MaskVelocity(CartPoleEnv(**kwargs))


if "MaskedCartPole-v1" not in gym.registry:
    gym.register("MaskedCartPole-v1", entry_point=make_masked_cartpole, max_episode_steps=500,
                 reward_threshold=475.0)
