"""Actor-critic networks and the action distributions on-policy methods sample from and score.

:class:`ActorCritic` puts an actor head (logits, or a Gaussian's mean and log-std) and a critic head
(the state value) over one encoder each, or over a shared encoder, optionally reading the state of a
GRU core instead of the observation (a recurrent policy then carries a hidden state per env;
:meth:`ActorCritic.unroll` replays a sequence from a stored state, zeroing it where an episode starts).

The action distributions are small stateless objects with what PPO needs: ``sample`` (exploring: env
action, the raw action to score later, its log-probability), ``mode`` (deterministic env action), and
``log_prob_entropy`` (log-probability of stored raw actions and the entropy, in one pass). Sampling
draws its noise from a numpy ``Generator`` (the policy's seeded :attr:`~conveyor.policy.Policy.rng`)
and costs a few tensor ops: ``torch.distributions`` objects cost several times more on a batch of 8.
"""
from __future__ import annotations

import math
from typing import Any, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from conveyor.policy.continuous import ActionScaler, tanh_log_det_jacobian
from conveyor.policy.model import ACTIVATIONS, MLP, ObsShape, build_encoder, is_flat

__all__ = ["ActorCritic", "ActionDist", "CategoricalDist", "GaussianDist", "TanhGaussianDist", "make_action_dist"]

Params = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
"""What the actor head outputs: logits ``[..., A]``, or ``(mean, log_std)`` each ``[..., A]``."""

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _orthogonal(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _encoder(obs_shape: ObsShape, hidden_sizes: Sequence[int], activation: str, kind: str) -> nn.Module:
    """An encoder of ``kind``; MLPs and the Nature CNN are orthogonally initialised (gain sqrt 2), as CleanRL's PPO."""
    return build_encoder(obs_shape, hidden_sizes, kind, activation=activation, orthogonal_gain=math.sqrt(2.0))


class ActorCritic(nn.Module):
    """An actor and a critic over observations of ``obs_shape``.

    - ``action_space="discrete"``: the actor outputs ``action_dim`` logits;
      otherwise a Gaussian's ``(mean, log_std)`` over ``action_dim`` dims, with ``log_std`` a learned
      parameter per dim (``state_dependent_std=False``, initialised to ``init_log_std``) or a second head.
    - Feed-forward: separate actor and critic encoders of ``encoder_kind`` (:func:`build_encoder`; MLPs of
      ``hidden_sizes`` with ``activation`` for vector observations, orthogonally initialised as the Nature CNN),
      or one shared encoder with ``share_encoder``.
    - Recurrent (``rnn_hidden_size``): a GRU cell reads the observation (vector observations directly,
      others through an encoder) and its state feeds the actor and critic MLPs of ``hidden_sizes``
      (shared with ``share_encoder``), as in Stable-Baselines3's recurrent policies.
    - Heads are orthogonally initialised with small actor gains (0.01), so the first policy is near uniform.
    """

    def __init__(self, obs_shape: ObsShape, action_dim: int, *, action_space: str = "discrete",
                 hidden_sizes: Sequence[int] = (64, 64), activation: str = "tanh", share_encoder: bool = False,
                 rnn_hidden_size: int | None = None, state_dependent_std: bool = False,
                 init_log_std: float = 0.0, encoder_kind: str = "auto") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.discrete = action_space == "discrete"
        self.action_dim = action_dim
        self.recurrent = rnn_hidden_size is not None
        self.shared = share_encoder
        self.rnn: nn.GRUCell | None = None
        if rnn_hidden_size is not None:
            widths = () if is_flat(obs_shape, encoder_kind) else hidden_sizes  # vectors go to the GRU as they are
            self.rnn_input = build_encoder(obs_shape, widths, encoder_kind, activation=activation)
            self.rnn = nn.GRUCell(self.rnn_input.output_dim, rnn_hidden_size)
            self.actor_encoder = MLP(rnn_hidden_size, hidden_sizes, activation=activation,
                                     orthogonal_gain=math.sqrt(2.0))
            self.critic_encoder = self.actor_encoder if self.shared else \
                MLP(rnn_hidden_size, hidden_sizes, activation=activation, orthogonal_gain=math.sqrt(2.0))
        else:
            self.actor_encoder = _encoder(obs_shape, hidden_sizes, activation, encoder_kind)
            self.critic_encoder = self.actor_encoder if self.shared else \
                _encoder(obs_shape, hidden_sizes, activation, encoder_kind)
        dim = self.actor_encoder.output_dim
        self.state_dependent_std = state_dependent_std and not self.discrete
        out_dim = action_dim * (2 if self.state_dependent_std else 1)
        self.actor_head = _orthogonal(nn.Linear(dim, out_dim), 0.01)
        self.critic_head = _orthogonal(nn.Linear(dim, 1), 1.0)
        if not self.discrete and not self.state_dependent_std:
            self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))

    @property
    def hidden_size(self) -> int | None:
        """Width of the recurrent state (``None`` for a feed-forward network)."""
        return self.rnn.hidden_size if self.rnn is not None else None

    def _params(self, features: torch.Tensor) -> Params:
        out = self.actor_head(features)
        if self.discrete:
            return out
        if self.state_dependent_std:
            mean, log_std = out.chunk(2, dim=-1)
            return mean, log_std.clamp(-20.0, 2.0)
        return out, self.log_std.expand_as(out)

    def _heads(self, x: torch.Tensor) -> tuple[Params, torch.Tensor]:
        """Actor params and value from the encoders' input (observations, or the GRU's states)."""
        features = self.actor_encoder(x)
        critic_features = features if self.shared else self.critic_encoder(x)
        return self._params(features), self.critic_head(critic_features).squeeze(-1)

    def forward(self, obs: Any, hidden: torch.Tensor | None = None
                ) -> tuple[Params, torch.Tensor, torch.Tensor | None]:
        """One step: ``(actor params, value, new hidden)``. Feed-forward networks take any leading dims
        and return ``None`` for the hidden state; a recurrent one takes ``[B]`` observations and the
        state ``[B, H]`` before them."""
        if self.rnn is None:
            return (*self._heads(obs), None)
        if hidden is None:
            raise ValueError("a recurrent ActorCritic needs the hidden state before the step")
        hidden = self.rnn(self.rnn_input(obs), hidden)
        return (*self._heads(hidden), hidden)

    def actor(self, obs: Any) -> Params:
        """The actor's params alone, for acting deterministically (feed-forward networks only)."""
        if self.rnn is not None:
            raise ValueError("a recurrent ActorCritic acts through forward(obs, hidden)")
        return self._params(self.actor_encoder(obs))

    def value(self, obs: Any, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The critic's value of ``obs`` (after the state ``hidden`` for a recurrent network)."""
        if self.rnn is not None:
            return self.forward(obs, hidden)[1]
        return self.critic_head(self.critic_encoder(obs)).squeeze(-1)

    def unroll(self, obs: Any, hidden: torch.Tensor, episode_start: torch.Tensor) -> tuple[Params, torch.Tensor]:
        """Replay a recurrent network over sequences: ``obs [L, B, ...]`` from the state ``hidden [B, H]``
        before the first step, with the state zeroed before every step where ``episode_start [L, B]``.
        Returns actor params and values with leading dims ``[L, B]``."""
        if self.rnn is None:
            return self._heads(obs)
        x = self.rnn_input(obs)  # everything but the GRU cell runs once over all steps
        keep = (~episode_start).unsqueeze(-1).to(x.dtype)
        states = []
        h = hidden
        for t in range(x.shape[0]):
            h = self.rnn(x[t], h * keep[t])
            states.append(h)
        return self._heads(torch.stack(states))


# --- action distributions ---------------------------------------------------------------------------
class ActionDist:
    """How a policy turns actor params into actions, and scores stored raw actions (see the module doc)."""

    raw_key: str | None = None
    """The trajectory key :meth:`log_prob` scores (``None``: ``action`` itself)."""

    def sample(self, params: Params, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(env action, raw action to store or None, log-probability [B])``, on the params' device: the caller
        brings what it keeps back to the host in one trip (:func:`~conveyor.data.to_host`)."""
        raise NotImplementedError

    def mode(self, params: Params) -> torch.Tensor:
        """The deterministic env action, on the params' device."""
        raise NotImplementedError

    def log_prob_entropy(self, params: Params, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of stored actions (the raw ones, where the distribution stores them) and the
        entropy per sample (estimated by ``-log_prob`` where it has no closed form)."""
        raise NotImplementedError


class CategoricalDist(ActionDist):
    """Discrete actions from logits; sampling by inverse CDF on one uniform draw per env."""

    def sample(self, params: Params, rng: np.random.Generator) -> tuple[torch.Tensor, None, torch.Tensor]:
        log_probs = torch.log_softmax(params, -1)
        u = torch.from_numpy(rng.random((*log_probs.shape[:-1], 1), dtype=np.float32)).to(log_probs.device)
        action = (log_probs.exp().cumsum(-1) < u).sum(-1).clamp_(max=log_probs.shape[-1] - 1)
        return action, None, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    def mode(self, params: Params) -> torch.Tensor:
        return params.argmax(-1)

    def log_prob_entropy(self, params: Params, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = torch.log_softmax(params, -1)
        log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        return log_prob, -(log_probs.exp() * log_probs).sum(-1)


def _normal_log_prob(mean: torch.Tensor, log_std: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    z = (x - mean) * torch.exp(-log_std)
    return (-0.5 * z.pow(2) - log_std - _HALF_LOG_2PI).sum(-1)


class GaussianDist(ActionDist):
    """A diagonal Gaussian; the env gets the sample clipped to ``[low, high]`` (when given), the learner
    scores the unclipped sample (``raw_action``), as Stable-Baselines3 does."""

    raw_key = "raw_action"

    def __init__(self, action_dim: int, low: Any = None, high: Any = None,
                 device: torch.device | str | None = None) -> None:
        def bound(value: Any) -> torch.Tensor | None:
            if value is None:
                return None
            return torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1).expand(action_dim).clone()
        self.low, self.high = bound(low), bound(high)

    def _noise(self, mean: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(tuple(mean.shape), dtype=np.float32)).to(mean.device)

    def _to_env(self, raw: torch.Tensor) -> torch.Tensor:
        if self.low is not None or self.high is not None:
            raw = raw.clamp(self.low, self.high)
        return raw

    def sample(self, params: Params, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_std = params
        noise = self._noise(mean, rng)
        raw = mean + torch.exp(log_std) * noise
        log_prob = (-0.5 * noise.pow(2) - log_std - _HALF_LOG_2PI).sum(-1)
        return self._to_env(raw), raw, log_prob

    def mode(self, params: Params) -> torch.Tensor:
        return self._to_env(params[0])

    def log_prob_entropy(self, params: Params, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = params
        return _normal_log_prob(mean, log_std, action), (log_std + 0.5 + _HALF_LOG_2PI).sum(-1)


class TanhGaussianDist(GaussianDist):
    """A diagonal Gaussian over ``u`` squashed by ``tanh`` and scaled to ``[low, high]`` (default
    ``[-1, 1]``); the learner scores the stored pre-squash ``u`` (``raw_action``), so no ``atanh`` is
    ever taken. The entropy has no closed form: ``-log_prob`` of the stored actions estimates it (as
    Stable-Baselines3 does)."""

    def __init__(self, action_dim: int, low: Any = None, high: Any = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(action_dim, device=device)
        self.scaler = ActionScaler(action_dim, low, high, device=device)

    def sample(self, params: Params, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_std = params
        noise = self._noise(mean, rng)
        raw = mean + torch.exp(log_std) * noise
        log_prob = (-0.5 * noise.pow(2) - log_std - _HALF_LOG_2PI - tanh_log_det_jacobian(raw)).sum(-1)
        return self._to_env(raw), raw, log_prob

    def _to_env(self, raw: torch.Tensor) -> torch.Tensor:
        return self.scaler.to_env(torch.tanh(raw))

    def log_prob_entropy(self, params: Params, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = params
        log_prob = _normal_log_prob(mean, log_std, action) - tanh_log_det_jacobian(action).sum(-1)
        return log_prob, -log_prob


def make_action_dist(action_space: str, action_dim: int, low: Any = None, high: Any = None,
                     device: torch.device | str | None = None) -> ActionDist:
    """The distribution for ``action_space`` (``"discrete"``, ``"gaussian"`` or ``"tanh_gaussian"``)."""
    if action_space == "discrete":
        return CategoricalDist()
    if action_space == "gaussian":
        return GaussianDist(action_dim, low, high, device)
    if action_space == "tanh_gaussian":
        return TanhGaussianDist(action_dim, low, high, device)
    raise ValueError(f"action_space must be 'discrete', 'gaussian' or 'tanh_gaussian', got {action_space!r}")
