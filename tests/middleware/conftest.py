"""Shared pieces for middleware tests: a small DQN config, env managers and a crashing env."""
import gymnasium as gym
import numpy as np
import pytest
from easydict import EasyDict

from conveyor.config import compile_config
from conveyor.envs import SyncEnvManager
from conveyor.policy import DQNPolicy


class CrashEveryK(gym.Env):
    """CartPole-shaped env that raises on every k-th step it takes (counted over its life)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, k: int, episode_len: int = 5):
        self.k, self.episode_len, self.steps, self.t = k, episode_len, 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps % self.k == 0:
            raise RuntimeError("simulated env failure")
        self.t += 1
        obs = np.full(4, self.t / 10, np.float32)
        return obs, 1.0, False, self.t >= self.episode_len, {}


@pytest.fixture
def cfg():
    return compile_config(EasyDict(dict(
        exp_name="test", seed=0,
        env=dict(env_id="CartPole-v1", collector_env_num=4, evaluator_env_num=2, n_evaluator_episode=4,
                 stop_value=500.0),
        policy=dict(nstep=1, collect=dict(n_sample=16), learn=dict(batch_size=8, update_per_collect=2),
                    model=dict(hidden_sizes=[16])),
    )), policy=DQNPolicy)


@pytest.fixture
def cartpole_envs(request):
    def make(n):
        env = SyncEnvManager([lambda: gym.make("CartPole-v1")] * n, seed=0)
        request.addfinalizer(env.close)
        return env
    return make


@pytest.fixture
def policy(cfg):
    return DQNPolicy(cfg.policy, seed=0)
