"""Pieces for continuous (``Box``) actions, shared by the policies that act in them (SAC, TD3, PPO, ...).

- :class:`ActionScaler` maps actions between the squashed range ``[-1, 1]`` and an env's bounds.
- :class:`TanhGaussianActor` is a diagonal Gaussian over pre-squash actions ``u`` followed by
  ``a = tanh(u)``; :meth:`TanhGaussianActor.sample` draws reparameterised actions with their exact
  log-density, and :func:`tanh_gaussian_log_prob` evaluates the log-density of given actions.
- :class:`DeterministicActor` is the deterministic ``a = tanh(mu(s))`` of TD3.
- :class:`EnsembleQ` evaluates several Q(obs, action) networks in one batched pass (``E`` matrices
  multiplied at once by ``torch.baddbmm``): SAC's twin critics cost one forward, not two.

The log-density of a squashed action follows from the change of variables ``a = tanh(u)``::

    log pi(a) = log N(u; mean, std) - sum_i log(1 - tanh(u_i)^2)
    log(1 - tanh(u)^2) = 2 * (log 2 - u - softplus(-2u))        (stable for large |u|)

Densities are over the squashed range ``[-1, 1]``; scaling to the env's bounds is a constant shift
that SAC's temperature update does not need, so entropy targets read the same on every env.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.policy.model import ObsShape, build_encoder, flat_dim, is_flat

__all__ = ["ActionScaler", "TanhGaussianActor", "DeterministicActor", "tanh_gaussian_log_prob", "tanh_log_det_jacobian",
           "EnsembleLinear", "EnsembleQ"]

_LOG2 = math.log(2.0)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class ActionScaler:
    """Affine map between squashed actions in ``[-1, 1]`` and an env's bounds ``[low, high]`` per dim.

    ``low``/``high`` are a float (every dim) or one value per dim; ``None`` means ``-1`` / ``1``.
    Bounds must be finite with ``low < high``: wrap an unbounded env in
    ``gymnasium.wrappers.RescaleAction`` (or ``ClipAction``) first.
    """

    def __init__(self, action_dim: int, low: Any = None, high: Any = None, *,
                 device: torch.device | str | None = None) -> None:
        self.action_dim = action_dim
        self.low = self._bound(-1.0 if low is None else low, "low", device)
        self.high = self._bound(1.0 if high is None else high, "high", device)
        if not bool(torch.isfinite(self.low).all() and torch.isfinite(self.high).all()):
            raise ValueError(f"action bounds must be finite for a squashed policy, got low={self.low.tolist()} "
                             f"high={self.high.tolist()}: wrap the env in gymnasium.wrappers.RescaleAction")
        if not bool((self.low < self.high).all()):
            raise ValueError(f"action bounds need low < high in every dim, got low={self.low.tolist()} "
                             f"high={self.high.tolist()}")
        self.scale = (self.high - self.low) / 2.0
        self.center = (self.high + self.low) / 2.0
        self.identity = bool((self.scale == 1.0).all() and (self.center == 0.0).all())

    def _bound(self, value: Any, name: str, device: Any) -> torch.Tensor:
        t = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(self.action_dim).clone()
        if t.numel() != self.action_dim:
            raise ValueError(f"action bound '{name}' has {t.numel()} values for {self.action_dim} action dims: give "
                             f"one float or one value per dim")
        return t

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        """``[-1, 1]`` to ``[low, high]`` (clamped, so rounding never steps outside the bounds)."""
        if self.identity:
            return action
        return torch.minimum(torch.maximum(torch.addcmul(self.center, action, self.scale), self.low), self.high)

    def from_env(self, action: torch.Tensor) -> torch.Tensor:
        """``[low, high]`` to ``[-1, 1]`` (float32)."""
        action = action.float()
        return action if self.identity else (action - self.center) / self.scale

    def __repr__(self) -> str:
        return f"ActionScaler(low={self.low.tolist()}, high={self.high.tolist()})"


def tanh_log_det_jacobian(u: torch.Tensor) -> torch.Tensor:
    """``log(1 - tanh(u)^2)`` elementwise, computed without cancellation for large ``|u|``."""
    return 2.0 * (_LOG2 - u - F.softplus(-2.0 * u))


def tanh_gaussian_log_prob(mean: torch.Tensor, log_std: torch.Tensor, action: torch.Tensor, *,
                           eps: float = 1e-6) -> torch.Tensor:
    """Log-density (summed over the last dim) of squashed ``action`` in ``(-1, 1)`` under ``tanh(N(mean, std))``.

    The pre-squash value is recovered with ``atanh``, so actions are clamped ``eps`` inside the bounds.
    """
    action = action.clamp(-1.0 + eps, 1.0 - eps)
    u = torch.atanh(action)
    z = (u - mean) * torch.exp(-log_std)
    return (-0.5 * z.pow(2) - log_std - _HALF_LOG_2PI - tanh_log_det_jacobian(u)).sum(-1)


class TanhGaussianActor(nn.Module):
    """A tanh-squashed diagonal Gaussian policy head over an encoder (``encoder``, or one of ``encoder_kind``).

    ``forward(obs) -> (mean, log_std)`` of the pre-squash Gaussian. With ``state_dependent_std`` the
    head outputs both (SAC); otherwise ``log_std`` is one learned parameter per action dim (PPO-style).
    ``log_std`` is squashed smoothly into ``log_std_bounds`` so its gradient never vanishes at a clamp.
    """

    def __init__(self, obs_shape: ObsShape, action_dim: int, *, hidden_sizes: Sequence[int] = (256, 256),
                 log_std_bounds: Sequence[float] = (-5.0, 2.0), state_dependent_std: bool = True,
                 encoder: nn.Module | None = None, encoder_kind: str = "auto") -> None:
        super().__init__()
        low, high = (float(b) for b in log_std_bounds)
        if not low < high:
            raise ValueError(f"log_std_bounds must be (low, high) with low < high, got {tuple(log_std_bounds)}")
        self.encoder = encoder if encoder is not None else build_encoder(obs_shape, hidden_sizes, encoder_kind)
        self.action_dim = action_dim
        self.state_dependent_std = state_dependent_std
        self.head = nn.Linear(self.encoder.output_dim, 2 * action_dim if state_dependent_std else action_dim)
        if not state_dependent_std:
            self.log_std_param = nn.Parameter(torch.zeros(action_dim))
        self._log_std_low = low
        self._log_std_half_range = 0.5 * (high - low)

    def forward(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.encoder(obs))
        if self.state_dependent_std:
            mean, raw = out.chunk(2, dim=-1)
        else:
            mean, raw = out, self.log_std_param.expand_as(out)
        log_std = self._log_std_low + self._log_std_half_range * (torch.tanh(raw) + 1.0)
        return mean, log_std

    def sample(self, obs: Any, *, generator: torch.Generator | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised squashed actions in ``(-1, 1)`` and their log-density (summed over action dims).

        ``noise`` (standard normal, the actions' shape) is drawn from ``generator`` when not given.
        """
        mean, log_std = self(obs)
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        u = mean + torch.exp(log_std) * noise
        log_prob = (-0.5 * noise.pow(2) - log_std - _HALF_LOG_2PI - tanh_log_det_jacobian(u)).sum(-1)
        return torch.tanh(u), log_prob

    def mode(self, obs: Any) -> torch.Tensor:
        """The deterministic action ``tanh(mean)`` in ``(-1, 1)``."""
        return torch.tanh(self(obs)[0])


class DeterministicActor(nn.Module):
    """A deterministic policy ``a = tanh(head(encoder(obs)))`` in ``(-1, 1)`` (TD3, DDPG), over an encoder
    (``encoder``, or one of ``encoder_kind``); exploration noise is added by the policy that acts with it."""

    def __init__(self, obs_shape: ObsShape, action_dim: int, *, hidden_sizes: Sequence[int] = (256, 256),
                 encoder: nn.Module | None = None, encoder_kind: str = "auto") -> None:
        super().__init__()
        self.encoder = encoder if encoder is not None else build_encoder(obs_shape, hidden_sizes, encoder_kind)
        self.action_dim = action_dim
        self.head = nn.Linear(self.encoder.output_dim, action_dim)

    def forward(self, obs: Any) -> torch.Tensor:
        return torch.tanh(self.head(self.encoder(obs)))

    def mode(self, obs: Any) -> torch.Tensor:
        """The action itself (as :meth:`TanhGaussianActor.mode`, so evaluation reads both alike)."""
        return self(obs)


class EnsembleLinear(nn.Module):
    """``E`` independent linear layers applied at once: ``[E, B, in] -> [E, B, out]`` (or ``[B, in]`` shared).

    Initialised like ``nn.Linear`` (uniform in ``+-1/sqrt(in)``), member by member.
    """

    def __init__(self, ensemble_size: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = nn.Parameter(torch.empty(ensemble_size, in_dim, out_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(ensemble_size, 1, out_dim).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:
            x = x.expand(self.weight.shape[0], *x.shape)
        return torch.baddbmm(self.bias, x, self.weight)

    def extra_repr(self) -> str:
        e, i, o = self.weight.shape
        return f"ensemble_size={e}, in_dim={i}, out_dim={o}"


class EnsembleQ(nn.Module):
    """``ensemble_size`` Q(obs, action) networks evaluated in one pass; ``forward -> [E, *batch]``.

    Observations the encoder kind reads flat (:func:`~conveyor.policy.model.is_flat`: vectors, or any array under
    ``"mlp"``) are concatenated with the action and fed to an ensemble MLP directly. Other observations (images,
    ``Dict`` spaces) first go through one encoder per member (:func:`~conveyor.policy.model.build_encoder` of
    ``encoder_kind`` with the first hidden width), whose features then join the action in the ensemble MLP over
    the remaining widths.
    """

    def __init__(self, obs_shape: ObsShape, action_dim: int, *, hidden_sizes: Sequence[int] = (256, 256),
                 ensemble_size: int = 2, encoder_kind: str = "auto") -> None:
        super().__init__()
        if ensemble_size < 1:
            raise ValueError(f"EnsembleQ needs ensemble_size >= 1, got {ensemble_size}")
        self.ensemble_size = ensemble_size
        if is_flat(obs_shape, encoder_kind):
            self.encoders = None
            obs_dim = flat_dim(obs_shape)
            self._obs_dim = obs_dim
            widths = list(hidden_sizes)
        else:
            self.encoders = nn.ModuleList(build_encoder(obs_shape, list(hidden_sizes[:1]), encoder_kind)
                                          for _ in range(ensemble_size))
            obs_dim = self.encoders[0].output_dim
            widths = list(hidden_sizes[1:])
        layers: list[nn.Module] = []
        dim = obs_dim + action_dim
        for width in widths:
            layers += [EnsembleLinear(ensemble_size, dim, width), nn.ReLU()]
            dim = width
        layers.append(EnsembleLinear(ensemble_size, dim, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: Any, action: torch.Tensor) -> torch.Tensor:
        lead = action.shape[:-1]
        action = action.reshape(-1, action.shape[-1])
        if self.encoders is None:
            obs = obs if obs.is_floating_point() else obs.float()
            x = torch.cat([obs.reshape(-1, self._obs_dim), action], dim=-1)  # [B, in], shared by all members
        else:
            x = torch.stack([torch.cat([enc(obs).reshape(action.shape[0], -1), action], dim=-1)
                             for enc in self.encoders])
        return self.net(x).reshape(self.ensemble_size, *lead)

