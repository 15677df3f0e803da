"""SAC: soft actor-critic for continuous actions, with twin critics and a learned entropy temperature.

One :meth:`SACPolicy.learn_mode.forward` does, on one batch (Haarnoja et al. 2018, "SAC: Algorithms
and Applications"):

- **critics**: ``y = reward + discount * (1 - terminated) * (min_i Q'_i(s', a') - alpha * log pi(a'|s'))``
  with ``a' ~ pi(.|s')`` and target critics ``Q'``; every critic regresses on ``y`` (mean squared error,
  weighted per sample by the batch's ``weight`` under prioritized replay);
- **actor**: minimise ``alpha * log pi(a|s) - min_i Q_i(s, a)`` with ``a ~ pi(.|s)`` reparameterised;
- **temperature**: minimise ``-log_alpha * (log pi(a|s) + target_entropy)``, so ``alpha`` grows while the
  policy's entropy is below ``target_entropy`` (default ``-action_dim``) and shrinks above it;
- **targets**: Polyak averaging ``Q' <- (1 - target_theta) Q' + target_theta Q``.

``discount`` is the batch's own (``gamma**k`` after the n-step enhancer) or ``cfg.discount_factor``.
Only ``terminated`` cuts the bootstrap: a truncated episode (time limit) still bootstraps from
``next_obs``. The critics see actions in ``[-1, 1]``; the batch's ``action`` is what the env received,
in its bounds (``model.action_low`` / ``model.action_high``), and is mapped back first, so random warm-up
actions from the collector and the policy's own actions are treated alike.
"""
from __future__ import annotations

import math
from typing import Any, Hashable, Mapping

import numpy as np
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.options import cuda_graph_option, lr_option
from conveyor.policy.continuous import EnsembleQ, TanhGaussianActor
from conveyor.policy.q_actor_critic import QActorCriticPolicy
from conveyor.policy.weights import Acting
from conveyor.schema import Option

__all__ = ["SACPolicy", "SACModel", "TanhActorCriticPolicy"]


def _log_std_bounds_check(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value) \
        and value[0] < value[1]
    return None if ok else "must be [low, high] with low < high"


class SACModel(nn.Module):
    """An actor and an :class:`EnsembleQ` of ``critic_num`` critics: SAC's actor is a :class:`TanhGaussianActor`,
    TD3's a :class:`~conveyor.policy.continuous.DeterministicActor`."""

    def __init__(self, actor: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic


class _Temperature(nn.Module):
    """The learned ``log_alpha`` (a module, so it is checkpointed and moved with the policy)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(math.log(alpha), dtype=torch.float32))


class TanhActorCriticPolicy(QActorCriticPolicy):
    """The :class:`QActorCriticPolicy` whose actor is a :class:`TanhGaussianActor` (SAC, IQL, continuous CQL).

    ``collect_mode.forward(obs)`` samples ``a ~ pi(.|s)`` (noise from the seeded :attr:`rng`);
    ``eval_mode.forward(obs)`` acts with the mean ``tanh(mu(s))``. Both return actions scaled to the
    bounds ``model.action_low`` / ``model.action_high``. Subclasses write ``_forward_learn``.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """The actor-critic options plus the Gaussian actor's log-std range."""
        return schema.merge_schemas(super().config_schema(), {
            "model": {
                "log_std_bounds": Option([-5.0, 2.0], "Range [low, high] the actor's log-std is squashed into.",
                                         type=list, check=_log_std_bounds_check),
            },
        })

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """A :class:`SACModel` from ``model_cfg``: actor and critics share no weights."""
        obs_shape = cls._required(model_cfg, "obs_shape", "obs_shape=3 for Pendulum")
        action_dim = cls._required(model_cfg, "action_shape", "action_shape=1 for Pendulum")
        hidden = model_cfg.hidden_sizes
        actor = TanhGaussianActor(obs_shape, action_dim, hidden_sizes=hidden, log_std_bounds=model_cfg.log_std_bounds,
                                  encoder_kind=model_cfg.encoder)
        critic = EnsembleQ(obs_shape, action_dim, hidden_sizes=hidden, ensemble_size=model_cfg.critic_num,
                           encoder_kind=model_cfg.encoder)
        return SACModel(actor, critic)

    # --- acting ----------------------------------------------------------------------------------
    def _forward_collect(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Sampled actions ``tanh(mu + sigma * noise)`` in the env's bounds, as float32 numpy."""
        mean, log_std = acting.model.actor(obs)
        noise = torch.from_numpy(self.rng.standard_normal(mean.shape, dtype=np.float32)).to(mean.device)
        action = torch.tanh(mean + log_std.exp() * noise)
        return {"action": self.action_scaler.to_env(action).cpu().numpy()}

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """The deterministic actions ``tanh(mu)`` in the env's bounds (float32)."""
        return self.action_scaler.to_env(acting.model.actor.mode(obs))


class SACPolicy(TanhActorCriticPolicy):
    """Soft actor-critic for 1-D ``Box`` action spaces (see the module doc for the losses; acting as in
    :class:`TanhActorCriticPolicy`).

    ``learn_mode.forward(batch)`` updates the critics, the actor and (with ``learn.auto_alpha``) the
    temperature, then the target critics, and returns ``losses/q``, ``losses/actor``, ``losses/alpha``,
    ``charts/alpha``, ``charts/entropy``, ``charts/q_mean``, ``charts/target_q_mean`` and, when the
    batch has importance ``weight`` (prioritized replay), ``priorities`` (mean ``|TD error|`` of the critics).

    Checkpointed: ``model`` (actor and critics), ``target_critic``, ``actor_optimizer``,
    ``critic_optimizer``, ``temperature`` (log-alpha), ``alpha_optimizer``, the exploration ``rng``, the
    learner's ``learn_rng`` and ``train_iter``.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """The actor-critic options plus the entropy temperature's."""
        return schema.merge_schemas(super().config_schema(), {
            "learn": {
                "alpha_learning_rate": lr_option("temperature"),
                "auto_alpha": Option(True, "Learn the entropy temperature alpha against target_entropy; False "
                                           "keeps alpha fixed."),
                "alpha": Option(0.2, "Entropy temperature: its fixed value, or the initial one with auto_alpha.",
                                type=float, check=schema.positive),
                "target_entropy": Option(None, "Entropy the temperature steers the policy to, in nats of the "
                                               "[-1, 1]-squashed action (None: -action_dim).", type=float),
                "cuda_graph": cuda_graph_option(),
            },
        })

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        learn = self.cfg.learn
        self.target_entropy = float(-self.action_dim if learn.target_entropy is None else learn.target_entropy)
        self.temperature = _Temperature(learn.alpha).to(self.device)
        self.temperature.requires_grad_(learn.auto_alpha)
        self.alpha_optimizer = self._adam(self.temperature, learn.alpha_learning_rate or learn.learning_rate)
        self._learn_generator = self._learn_rng()
        self.register_state("temperature", self.temperature)
        self.register_state("alpha_optimizer", self.alpha_optimizer)

    @property
    def alpha(self) -> float:
        """The current entropy temperature."""
        return float(self.temperature.log_alpha.detach().exp())

    # --- learning --------------------------------------------------------------------------------
    def _actor_loss(self, batch: ttorch.Tensor, action: torch.Tensor, log_prob: torch.Tensor, q_pi: torch.Tensor,
                    alpha: torch.Tensor) -> torch.Tensor:
        """The actor's loss, ``mean(alpha * log pi(a~|s) - min_i Q_i(s, a~))`` for the reparameterised actions ``a~``
        (``action``: the batch's own actions, for a subclass that clones them)."""
        return (alpha * log_prob - q_pi).mean()

    def _learn_tensors(self, batch: ttorch.Tensor,
                       variant: Hashable) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Critic, actor and temperature updates on one flat batch, then the soft target update."""
        discount = self._bootstrap_discount(batch)
        log_alpha = self.temperature.log_alpha
        alpha = log_alpha.detach().exp()
        action = self._data_action(batch)
        generator = self._learn_generator

        # Critics: regress every Q_i(s, a) on the entropy-regularised bootstrap of the target critics.
        with torch.no_grad():
            next_action, next_log_prob = self.actor.sample(batch.next_obs, generator=generator)
            next_q = self.target_critic(batch.next_obs, next_action).min(0).values
            not_done = 1.0 - batch.terminated.float()
            target_q = batch.reward + discount * not_done * (next_q - alpha * next_log_prob)
        q, td_error, losses, critic_grad_norm = self._critic_step(batch, action, target_q)

        # Actor: maximise min_i Q_i(s, a) + alpha * entropy, with a ~ pi(.|s) reparameterised. The
        # critics' weights take no gradient from this loss.
        with self._critic_frozen():
            new_action, log_prob = self.actor.sample(batch.obs, generator=generator)
            q_pi = self.critic(batch.obs, new_action).min(0).values
            actor_loss = self._actor_loss(batch, action, log_prob, q_pi, alpha)
            actor_grad_norm = self._apply_gradients(actor_loss, self.actor_optimizer, self._actor_params)

        # Temperature: alpha rises while the entropy -log pi is below target_entropy, falls above it.
        log_prob = log_prob.detach()
        alpha_loss = -(log_alpha * (log_prob + self.target_entropy)).mean()
        if self.cfg.learn.auto_alpha:
            self.alpha_optimizer.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self._average_gradients([log_alpha])
            self.alpha_optimizer.step()

        self._target_sync.soft(self.cfg.learn.target_theta)

        metrics = {
            **losses,
            "losses/actor": actor_loss.detach(),
            "losses/alpha": alpha_loss.detach(),
            "charts/alpha": alpha,
            "charts/entropy": -log_prob.mean(),
            "charts/q_mean": q.mean(),
            "charts/target_q_mean": target_q.mean(),
        }
        if critic_grad_norm is not None:
            metrics["charts/critic_grad_norm"] = critic_grad_norm
            metrics["charts/actor_grad_norm"] = actor_grad_norm
        return metrics, td_error
