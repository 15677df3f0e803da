"""Hand-set models and batch builders shared by the policy tests."""
from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import treetensor.torch as ttorch
from torch import nn


class TableQ(nn.Module):
    """Q-values looked up from a table by integer state: ``forward(obs[B]) -> table[obs] ([B, A])``."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.tensor(table, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.table[obs.long()]


class TableActorCritic(nn.Module):
    """Logits and values looked up by integer state: ``forward(obs[B]) -> (logits[obs], values[obs], None)``."""

    recurrent = False

    def __init__(self, logits, values):
        super().__init__()
        self.logits = nn.Parameter(torch.tensor(logits, dtype=torch.float32))
        self.values = nn.Parameter(torch.tensor(values, dtype=torch.float32))

    def forward(self, obs, hidden=None):
        s = obs.long()
        return self.logits[s], self.values[s], None

    def actor(self, obs):
        return self.logits[obs.long()]

    def value(self, obs, hidden=None):
        return self.values[obs.long()]


def transitions(**fields) -> ttorch.Tensor:
    """A batch tree from lists: ints for ``obs``/``next_obs``/``action``, floats, bools."""
    out = {}
    for key, value in fields.items():
        if key in ("terminated", "truncated"):
            out[key] = torch.tensor(value, dtype=torch.bool)
        elif key in ("obs", "next_obs", "action"):
            out[key] = torch.tensor(value, dtype=torch.int64)
        else:
            out[key] = torch.tensor(value, dtype=torch.float32)
    return ttorch.Tensor(out)


def through_bytes(state: Any) -> Any:
    """``state`` saved with ``torch.save`` and loaded back, as a checkpoint on disk would be."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def offline_batch(seed: int, n: int = 32, obs_dim: int = 3, action_shape: int = 2, *, discrete: bool = False,
                  low: float = -1.0, high: float = 1.0) -> ttorch.Tensor:
    """A random batch shaped like ``DequeBuffer.sample``'s: ``action_shape`` discrete actions (``int64 [n]``)
    or a continuous action of that dimension in ``[low, high]`` (``float32 [n, action_shape]``)."""
    g = torch.Generator().manual_seed(seed)
    action = torch.randint(0, action_shape, (n,), generator=g) if discrete else \
        low + (high - low) * torch.rand(n, action_shape, generator=g)
    return ttorch.Tensor({
        "obs": torch.randn(n, obs_dim, generator=g), "next_obs": torch.randn(n, obs_dim, generator=g),
        "action": action, "reward": torch.randn(n, generator=g), "terminated": torch.rand(n, generator=g) < 0.2,
        "truncated": torch.zeros(n, dtype=torch.bool), "index": torch.arange(n)})


class TeamMatching:
    """A test double of a team env manager: ``env_num`` envs of two agents; each agent sees a one-hot target and
    earns 1 for choosing it; one other action is masked; agent 1 leaves after step 1; episodes last 4 steps.
    Observations are the mapping a team env manager hands out (``obs``, ``state``, ``action_mask``, ``agent_mask``)."""

    env_num, agents, actions, length = 4, 2, 3, 4
    action_space = SimpleNamespace(seed=lambda seed: None)  # seeded by the collector; random actions are not used

    def reset(self, seed=None):
        self.rng = np.random.default_rng(seed)
        self.t = np.zeros(self.env_num, int)
        self.target = self.rng.integers(0, self.actions, (self.env_num, self.agents))
        return self._obs()

    def _obs(self):
        obs = np.eye(self.actions, dtype=np.float32)[self.target]
        action_mask = np.ones((self.env_num, self.agents, self.actions), bool)
        action_mask[..., 0] = self.target == 0  # action 0 is allowed only where it is the target
        return {"obs": obs, "state": obs.reshape(self.env_num, -1), "action_mask": action_mask,
                "agent_mask": np.stack([np.ones(self.env_num, bool), self.t < 2], -1)}

    def step(self, action):
        assert not (action == 0)[self.target != 0].any()  # a masked action never reaches the env
        alive = self._obs()["agent_mask"]
        reward = ((action == self.target) & alive).astype(np.float32)
        self.t += 1
        self.target = self.rng.integers(0, self.actions, (self.env_num, self.agents))
        terminated = self.t >= self.length
        next_obs = self._obs()
        self.t[terminated] = 0
        none = np.zeros(self.env_num, bool)
        return SimpleNamespace(obs=self._obs(), next_obs=next_obs, reward=reward, terminated=terminated,
                               truncated=none, crashed=none, info=[{}] * self.env_num)


def greedy_reward(policy, steps=8):
    """The share of present agents' steps on which ``policy``'s greedy team chose right, on a fresh env."""
    env = TeamMatching()
    obs, earned, present = env.reset(seed=1), 0.0, 0
    for _ in range(steps):
        present += int(obs["agent_mask"].sum())
        ts = env.step(policy.eval_mode.forward(obs)["action"])
        earned += float(ts.reward.sum())
        obs = ts.obs
    return earned / present
