"""Networks: the encoder ``policy.model.encoder`` names, and the heads policies put on top.

:func:`build_encoder` is the one encoder factory. With ``kind="auto"`` it picks from ``cfg.model.obs_shape``:
an int or a 0/1-d shape gets an :class:`MLP`, a 3-d shape (an image, ``CHW`` or ``HWC``) a
:class:`ConvEncoder`, any other shape a flattening MLP, and a dict of shapes (a ``Dict`` observation space) a
:class:`DictEncoder` with one such encoder per key. ``"mlp"`` flattens any array observation into an MLP;
``"nature"`` and ``"impala"`` are the image encoders of :mod:`conveyor.policy.encoders`. Every encoder has an
``output_dim`` so heads can be sized without a dry run.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence, Union

import torch
from torch import nn

from conveyor.policy.encoders import NATURE_MIN_SIDE, ImageEncoder, ImpalaCNN, NatureCNN, image_layout
from conveyor.policy.options import ENCODER_KINDS as ENCODERS
from conveyor.schema import ConfigError

__all__ = ["ObsShape", "MLP", "FlattenMLP", "ConvEncoder", "DictEncoder", "build_encoder", "QNetwork", "EncoderHead",
           "NatureCNN", "ImpalaCNN", "ENCODERS"]

ObsShape = Union[int, Sequence[int], Mapping[str, Any]]
"""An observation shape: an int (a vector), a tuple, or a dict of shapes for ``Dict`` observations."""



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

    def __init__(self, obs_shape: Sequence[int], hidden_sizes: Sequence[int], *, activation: str = "relu",
                 orthogonal_gain: float | None = None) -> None:
        super().__init__(math.prod(obs_shape), hidden_sizes, activation=activation, orthogonal_gain=orthogonal_gain)
        self.obs_ndim = len(obs_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-self.obs_ndim))


class ConvEncoder(ImageEncoder):
    """A small CNN for image observations, then an MLP; uint8 pixels are scaled to [0, 1] (``encoder="auto"``).

    Images may be ``CHW`` or ``HWC`` (see :func:`~conveyor.policy.encoders.image_layout`). Images of side >= 36
    get the Nature-DQN stack (8x8/4, 4x4/2, 3x3/1); smaller ones (grid worlds) three 3x3 convolutions that keep
    detail. Any leading dims (``[B]``, ``[T, B]``) are kept.
    """

    def __init__(self, obs_shape: Sequence[int], hidden_sizes: Sequence[int], *,
                 channels_last: bool | None = None) -> None:
        super().__init__()
        c, h, w, self.channels_last = image_layout(obs_shape, channels_last)
        if min(h, w) >= NATURE_MIN_SIDE:
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
            conv_dim = self.conv(torch.zeros(1, c, h, w)).shape[-1]
        self.mlp = MLP(conv_dim, hidden_sizes)
        self.output_dim = self.mlp.output_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.conv(x))


class DictEncoder(nn.Module):
    """One encoder per key of a ``Dict`` observation, outputs concatenated in the shape dict's order. An image
    encoder kind (``"nature"``, ``"impala"``) applies to the image keys; the other keys get ``"auto"``'s."""

    def __init__(self, obs_shape: Mapping[str, ObsShape], hidden_sizes: Sequence[int], kind: str = "auto") -> None:
        super().__init__()
        if not obs_shape:
            raise ValueError("DictEncoder needs at least one key in obs_shape")
        self.encoders = nn.ModuleDict({
            str(k): build_encoder(v, hidden_sizes, kind if kind == "mlp" or _is_image(v) else "auto")
            for k, v in obs_shape.items()})
        self.output_dim = sum(enc.output_dim for enc in self.encoders.values())

    def forward(self, obs: Any) -> torch.Tensor:
        """``obs`` is a dict or a ttorch tree of tensors keyed like ``obs_shape``."""
        return torch.cat([enc(obs[key]) for key, enc in self.encoders.items()], dim=-1)


def _is_image(obs_shape: ObsShape) -> bool:
    return not isinstance(obs_shape, (int, Mapping)) and len(tuple(obs_shape)) == 3


def is_flat(obs_shape: ObsShape, kind: str = "auto") -> bool:
    """Whether ``kind`` encodes ``obs_shape`` as one flat vector (an :class:`MLP` input): a vector observation
    under ``"auto"`` or ``"mlp"``, any array observation under ``"mlp"``."""
    if isinstance(obs_shape, Mapping) or kind not in ("auto", "mlp"):
        return False
    return kind == "mlp" or isinstance(obs_shape, int) or len(tuple(obs_shape)) <= 1


def flat_dim(obs_shape: ObsShape) -> int:
    """The width of an array observation flattened (an int shape is its own width; a 0-d shape is 1)."""
    return obs_shape if isinstance(obs_shape, int) else math.prod(int(d) for d in obs_shape)


def build_encoder(obs_shape: ObsShape, hidden_sizes: Sequence[int], kind: str = "auto", *,
                  activation: str = "relu", orthogonal_gain: float | None = None) -> nn.Module:
    """The encoder ``kind`` names for an observation shape (see the module doc); its ``output_dim`` sizes the head.

    ``activation`` and ``orthogonal_gain`` shape the MLPs of vector observations and ``"mlp"`` (``"auto"``'s
    image and Dict encoders keep their own); ``orthogonal_gain`` also initialises the Nature CNN. A kind that
    does not fit the shape is a :class:`~conveyor.schema.ConfigError` naming ``policy.model.encoder``.
    """
    if kind not in ENCODERS:
        raise ConfigError(f"policy.model.encoder={kind!r} is not an encoder: set it to one of {list(ENCODERS)}")
    if isinstance(obs_shape, Mapping):
        return DictEncoder(obs_shape, hidden_sizes, kind)
    shape = (obs_shape,) if isinstance(obs_shape, int) else tuple(int(d) for d in obs_shape)
    if is_flat(shape, kind):
        if len(shape) <= 1:
            return MLP(flat_dim(shape), hidden_sizes, activation=activation, orthogonal_gain=orthogonal_gain)
        return FlattenMLP(shape, hidden_sizes, activation=activation, orthogonal_gain=orthogonal_gain)
    if kind == "auto":
        return ConvEncoder(shape, hidden_sizes) if len(shape) == 3 else FlattenMLP(shape, hidden_sizes)
    if len(shape) != 3:
        raise ConfigError(f"policy.model.encoder={kind!r} needs image observations [C, H, W] (or HWC), got "
                          f"obs_shape={obs_shape!r}: set policy.model.encoder='mlp' (or 'auto')")
    if kind == "impala":
        return ImpalaCNN(shape)
    if min(image_layout(shape)[1:3]) < NATURE_MIN_SIDE:
        raise ConfigError(f"policy.model.encoder='nature' needs images of at least {NATURE_MIN_SIDE}x{NATURE_MIN_SIDE} "
                          f"pixels, got obs_shape={obs_shape!r}: set policy.model.encoder='impala' (or 'auto')")
    return NatureCNN(shape, orthogonal_gain=orthogonal_gain)


class QNetwork(nn.Module):
    """Q-values for discrete actions over an encoder; ``dueling`` splits value and advantage streams.

    The dueling head computes ``Q = V + A - mean(A)``, so ``V`` is identified as the mean Q-value.
    """

    def __init__(self, obs_shape: ObsShape, action_num: int, *, hidden_sizes: Sequence[int] = (64, 64),
                 dueling: bool = False, encoder: nn.Module | None = None, encoder_kind: str = "auto") -> None:
        super().__init__()
        self.encoder = encoder if encoder is not None else build_encoder(obs_shape, hidden_sizes, encoder_kind)
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
    """An encoder (``encoder_kind``, see :func:`build_encoder`) and one linear layer to ``out_dim`` outputs
    (``[..., out_dim]``): action logits, a regressed action, or a state value with ``out_dim=1``."""

    def __init__(self, obs_shape: ObsShape, out_dim: int, *, hidden_sizes: Sequence[int] = (256, 256),
                 encoder_kind: str = "auto") -> None:
        super().__init__()
        self.encoder = build_encoder(obs_shape, hidden_sizes, encoder_kind)
        self.head = nn.Linear(self.encoder.output_dim, out_dim)

    def forward(self, obs: Any) -> torch.Tensor:
        return self.head(self.encoder(obs))
