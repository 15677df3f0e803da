"""Networks: an encoder picked from the observation shape, and the heads policies put on top.

:func:`build_encoder` maps ``cfg.model.obs_shape`` to a module: an int or a 0/1-d shape gets an
:class:`MLP`, a 3-d shape (an image, ``CHW`` or ``HWC``) a :class:`ConvEncoder`, any other shape a
flattening MLP, and a dict of shapes (a ``Dict`` observation space) a :class:`DictEncoder` with one
such encoder per key. Every encoder has an ``output_dim`` so heads can be sized without a dry run.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence, Union

import torch
from torch import nn

__all__ = ["ObsShape", "MLP", "FlattenMLP", "ConvEncoder", "DictEncoder", "build_encoder", "QNetwork", "EncoderHead"]

ObsShape = Union[int, Sequence[int], Mapping[str, Any]]
"""An observation shape: an int (a vector), a tuple, or a dict of shapes for ``Dict`` observations."""

_CHANNEL_COUNTS = (1, 2, 3, 4)


ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}
"""Hidden-layer activations an :class:`MLP` accepts by name."""


class MLP(nn.Module):
    """Linear layers with an activation (ReLU by default) after each hidden layer; an optional final
    linear ``out_dim`` layer. ``orthogonal_gain`` initialises the hidden layers orthogonally with that
    gain and zero biases (as PPO implementations do) instead of torch's default.

    With ``in_dim == 1`` scalar observations (a ``Discrete`` space) may come without their trailing
    dim: ``[N]`` is read as ``[N, 1]``; integer inputs are cast to float.
    """

    def __init__(self, in_dim: int, hidden_sizes: Sequence[int], *, out_dim: int | None = None,
                 activation: str = "relu", orthogonal_gain: float | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        layers: list[nn.Module] = []
        dim = in_dim
        for size in hidden_sizes:
            linear = nn.Linear(dim, size)
            if orthogonal_gain is not None:
                nn.init.orthogonal_(linear.weight, orthogonal_gain)
                nn.init.zeros_(linear.bias)
            layers += [linear, ACTIVATIONS[activation]()]
            dim = size
        if out_dim is not None:
            layers.append(nn.Linear(dim, out_dim))
            dim = out_dim
        self.net = nn.Sequential(*layers)
        self.output_dim = dim
        self.scalar_input = in_dim == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            x = x.float()
        if self.scalar_input and (x.ndim == 1 or x.shape[-1] != 1):
            x = x.unsqueeze(-1)
        return self.net(x)


class FlattenMLP(MLP):
    """An :class:`MLP` over observations with several trailing dims (e.g. ``(4, 10)``), flattened first."""

    def __init__(self, obs_shape: Sequence[int], hidden_sizes: Sequence[int]) -> None:
        super().__init__(math.prod(obs_shape), hidden_sizes)
        self.obs_ndim = len(obs_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-self.obs_ndim))


class ConvEncoder(nn.Module):
    """A small CNN for image observations, then an MLP; uint8 pixels are scaled to [0, 1].

    Images may be ``CHW`` or ``HWC`` (``HWC`` is assumed when the last dim looks like a channel count
    and the first does not, or when ``channels_last`` says so). Images of side >= 36 get the Nature-DQN
    stack (8x8/4, 4x4/2, 3x3/1); smaller ones (grid worlds) three 3x3 convolutions that keep detail.
    Any leading dims (``[B]``, ``[T, B]``) are kept.
    """

    def __init__(self, obs_shape: Sequence[int], hidden_sizes: Sequence[int], *,
                 channels_last: bool | None = None) -> None:
        super().__init__()
        if len(obs_shape) != 3:
            raise ValueError(f"ConvEncoder needs a 3-d image shape (CHW or HWC), got {tuple(obs_shape)}")
        if channels_last is None:
            channels_last = obs_shape[-1] in _CHANNEL_COUNTS and obs_shape[0] not in _CHANNEL_COUNTS
        self.channels_last = channels_last
        c, h, w = (obs_shape[2], obs_shape[0], obs_shape[1]) if channels_last else tuple(obs_shape)
        if min(h, w) >= 36:
            self.conv = nn.Sequential(
                nn.Conv2d(c, 32, 8, stride=4), nn.ReLU(),
                nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
                nn.Flatten(),
            )
        else:
            self.conv = nn.Sequential(
                nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(),
                nn.Conv2d(16, 32, 3, stride=2 if min(h, w) >= 8 else 1, padding=1), nn.ReLU(),
                nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                nn.Flatten(),
            )
        with torch.no_grad():
            flat_dim = self.conv(torch.zeros(1, c, h, w)).shape[-1]
        self.mlp = MLP(flat_dim, hidden_sizes)
        self.output_dim = self.mlp.output_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            x = x.float() / 255.0
        lead = x.shape[:-3]
        x = x.reshape(-1, *x.shape[-3:])
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return self.mlp(self.conv(x)).reshape(*lead, self.output_dim)


class DictEncoder(nn.Module):
    """One encoder per key of a ``Dict`` observation, outputs concatenated in the shape dict's order."""

    def __init__(self, obs_shape: Mapping[str, ObsShape], hidden_sizes: Sequence[int]) -> None:
        super().__init__()
        if not obs_shape:
            raise ValueError("DictEncoder needs at least one key in obs_shape")
        self.encoders = nn.ModuleDict({str(k): build_encoder(v, hidden_sizes) for k, v in obs_shape.items()})
        self.output_dim = sum(enc.output_dim for enc in self.encoders.values())

    def forward(self, obs: Any) -> torch.Tensor:
        """``obs`` is a dict or a ttorch tree of tensors keyed like ``obs_shape``."""
        return torch.cat([enc(obs[key]) for key, enc in self.encoders.items()], dim=-1)


def build_encoder(obs_shape: ObsShape, hidden_sizes: Sequence[int]) -> nn.Module:
    """The encoder for an observation shape (see the module doc); its ``output_dim`` sizes the head."""
    if isinstance(obs_shape, Mapping):
        return DictEncoder(obs_shape, hidden_sizes)
    if isinstance(obs_shape, int):
        return MLP(obs_shape, hidden_sizes)
    shape = tuple(int(d) for d in obs_shape)
    if len(shape) <= 1:
        return MLP(shape[0] if shape else 1, hidden_sizes)
    if len(shape) == 3:
        return ConvEncoder(shape, hidden_sizes)
    return FlattenMLP(shape, hidden_sizes)


class QNetwork(nn.Module):
    """Q-values for discrete actions over an encoder; ``dueling`` splits value and advantage streams.

    The dueling head computes ``Q = V + A - mean(A)``, so ``V`` is identified as the mean Q-value.
    """

    def __init__(self, obs_shape: ObsShape, action_num: int, *, hidden_sizes: Sequence[int] = (64, 64),
                 dueling: bool = False, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.encoder = encoder if encoder is not None else build_encoder(obs_shape, hidden_sizes)
        dim = self.encoder.output_dim
        self.dueling = dueling
        # Dueling: one layer outputs the value (column 0) and the advantages (columns 1..). Combining them is
        # linear, so it is one matmul with a fixed matrix: a single autograd node instead of five.
        self.head = nn.Linear(dim, action_num + 1 if dueling else action_num)
        self.action_num = action_num
        if dueling:
            combine = torch.zeros(action_num + 1, action_num)
            combine[0] = 1.0
            combine[1:] = torch.eye(action_num) - 1.0 / action_num
            self.register_buffer("dueling_combine", combine, persistent=False)

    def forward(self, obs: Any) -> torch.Tensor:
        """``[..., action_num]`` Q-values for a batch of observations."""
        out = self.head(self.encoder(obs))
        return out @ self.dueling_combine if self.dueling else out


class EncoderHead(nn.Module):
    """An encoder picked from ``obs_shape`` and one linear layer to ``out_dim`` outputs (``[..., out_dim]``):
    action logits, a regressed action, or a state value with ``out_dim=1``."""

    def __init__(self, obs_shape: ObsShape, out_dim: int, *, hidden_sizes: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        self.encoder = build_encoder(obs_shape, hidden_sizes)
        self.head = nn.Linear(self.encoder.output_dim, out_dim)

    def forward(self, obs: Any) -> torch.Tensor:
        return self.head(self.encoder(obs))
