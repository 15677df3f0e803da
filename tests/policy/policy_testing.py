"""Hand-set models and batch builders shared by the policy tests."""
from __future__ import annotations

import io
from typing import Any

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
