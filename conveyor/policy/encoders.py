"""Image encoders chosen by ``policy.model.encoder``: the Nature-DQN CNN and the IMPALA ResNet.

Both take images ``CHW`` (or ``HWC``, see :func:`image_layout`) with any leading dims (``[B]``, ``[T, B]``),
keep uint8 pixels uint8 until they are here and divide them by 255 inside, and end in a ReLU feature layer
whose width is their ``output_dim``:

- :class:`NatureCNN` (Mnih et al. 2015; CleanRL's and Stable-Baselines3's ``NatureCNN``): conv 8x8/4 32,
  4x4/2 64, 3x3/1 64, then linear 512; images need a side of at least 36 pixels.
- :class:`ImpalaCNN` (Espeholt et al. 2018): three stacks of [conv 3x3, max-pool 3x3/2, two residual blocks]
  with 16, 32, 32 channels, then linear 256.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

__all__ = ["NatureCNN", "ImpalaCNN", "image_layout", "NATURE_MIN_SIDE"]

_CHANNEL_COUNTS = (1, 2, 3, 4)
NATURE_MIN_SIDE = 36
"""The smallest image side the Nature CNN's three valid convolutions leave a pixel of."""


def image_layout(obs_shape: Sequence[int], channels_last: bool | None = None) -> tuple[int, int, int, bool]:
    """``(channels, height, width, channels_last)`` of a 3-d image shape; ``HWC`` is assumed when the last dim
    looks like a channel count and the first does not (unless ``channels_last`` says)."""
    if len(obs_shape) != 3:
        raise ValueError(f"an image encoder needs a 3-d image shape (CHW or HWC), got {tuple(obs_shape)}")
    if channels_last is None:
        channels_last = obs_shape[-1] in _CHANNEL_COUNTS and obs_shape[0] not in _CHANNEL_COUNTS
    c, h, w = (obs_shape[2], obs_shape[0], obs_shape[1]) if channels_last else tuple(obs_shape)
    return int(c), int(h), int(w), channels_last


class ImageEncoder(nn.Module):
    """What image encoders share: pixels scaled to [0, 1] (uint8 divided by 255 here, floats as given), leading
    dims flattened around ``features`` (``[N, C, H, W] -> [N, output_dim]``), ``HWC`` images permuted.

    An encoder made with ``memory_format=torch.channels_last`` (:meth:`use_channels_last`) keeps its convolution
    weights and images in that layout, which oneDNN's CPU convolutions run faster on (about 1.2x on a Nature CNN
    training step here); uint8 images are laid out so before their conversion, which then moves 4x fewer bytes.
    """

    channels_last: bool
    output_dim: int
    memory_format: torch.memory_format | None = None
    autocast_dtype: torch.dtype | None = None

    def use_channels_last(self) -> None:
        """Lay the convolution weights out channels-last, and every image before the convolutions."""
        self.memory_format = torch.channels_last
        self.to(memory_format=torch.channels_last)

    def use_mixed_precision(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """On CUDA, run the convolutions and the feature layer under autocast in ``dtype``; the features come out
        float32, so the heads and losses after them stay full precision. bf16 keeps float32's range, so no loss
        scaling is needed."""
        self.autocast_dtype = dtype

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-3]
        x = x.reshape(-1, *x.shape[-3:])
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        if self.memory_format is not None and not x.is_contiguous(memory_format=self.memory_format):
            x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # channels-last; ~2x faster on uint8 than
            # .contiguous(memory_format=torch.channels_last), which takes another kernel
        if not x.is_floating_point():
            x = x.float().div_(255.0)
        if self.autocast_dtype is not None and x.is_cuda:
            with torch.autocast("cuda", dtype=self.autocast_dtype):
                out = self.features(x)
            return out.float().reshape(*lead, self.output_dim)
        return self.features(x).reshape(*lead, self.output_dim)


def _init(module: nn.Module, gain: float | None) -> nn.Module:
    if gain is not None:
        nn.init.orthogonal_(module.weight, gain)
        nn.init.zeros_(module.bias)
    return module


class NatureCNN(ImageEncoder):
    """The Nature-DQN convolutions and a 512-unit ReLU layer (see the module doc). ``orthogonal_gain`` initialises
    every layer orthogonally with that gain and zero biases, as CleanRL's Atari PPO (``sqrt(2)``)."""

    def __init__(self, obs_shape: Sequence[int], *, orthogonal_gain: float | None = None,
                 channels_last: bool | None = None) -> None:
        super().__init__()
        c, h, w, self.channels_last = image_layout(obs_shape, channels_last)
        if min(h, w) < NATURE_MIN_SIDE:
            raise ValueError(f"the Nature CNN needs images of at least {NATURE_MIN_SIDE}x{NATURE_MIN_SIDE} pixels, "
                             f"got {h}x{w}")
        self.conv = nn.Sequential(  # in-place ReLUs: a convolution's backward never reads its output
            _init(nn.Conv2d(c, 32, 8, stride=4), orthogonal_gain), nn.ReLU(inplace=True),
            _init(nn.Conv2d(32, 64, 4, stride=2), orthogonal_gain), nn.ReLU(inplace=True),
            _init(nn.Conv2d(64, 64, 3, stride=1), orthogonal_gain), nn.ReLU(inplace=True),
            nn.Flatten(),
        )
        side = lambda n: ((n - 8) // 4 + 1 - 4) // 2 + 1 - 2  # noqa: E731  (the three valid convolutions)
        self.linear = nn.Sequential(_init(nn.Linear(64 * side(h) * side(w), 512), orthogonal_gain),
                                    nn.ReLU(inplace=True))
        self.output_dim = 512
        self.use_channels_last()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.conv(x))


class _ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))`` with 3x3 convolutions that keep the shape."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaCNN(ImageEncoder):
    """The IMPALA ResNet (see the module doc), with torch's default initialisation (as CleanRL's procgen PPO)."""

    def __init__(self, obs_shape: Sequence[int], *, channels: Sequence[int] = (16, 32, 32), out_dim: int = 256,
                 channels_last: bool | None = None) -> None:
        super().__init__()
        c, h, w, self.channels_last = image_layout(obs_shape, channels_last)
        layers: list[nn.Module] = []
        for width in channels:
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1),
                       _ResidualBlock(width), _ResidualBlock(width)]
            c, h, w = width, math.ceil(h / 2), math.ceil(w / 2)
        layers += [nn.ReLU(), nn.Flatten()]
        self.conv = nn.Sequential(*layers)
        self.linear = nn.Sequential(nn.Linear(c * h * w, out_dim), nn.ReLU())
        self.output_dim = out_dim
        self.use_channels_last()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.conv(x))
