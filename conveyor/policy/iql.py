"""IQL: implicit Q-learning (Kostrikov et al. 2021) for 1-D ``Box`` actions, trained from a dataset.

IQL never evaluates an action the dataset does not hold. One :meth:`IQLPolicy.learn_mode.forward` does:

- **value**: ``V(s)`` regresses on ``Q'(s, a) = min_i Q'_i(s, a)`` of the target critics at the dataset's
  action with the expectile loss ``|tau - 1(u < 0)| u^2``, ``u = Q'(s, a) - V(s)`` (:func:`expectile_loss`):
  with ``tau > 0.5`` it approaches the best action's value among those the data shows in ``s``;
- **critics**: ``Q_i(s, a)`` regress on ``reward + discount * (1 - terminated) * V(s')``;
- **actor**: advantage-weighted regression, minimising ``-w log pi(a|s)`` with
  ``w = min(exp(beta * (Q'(s, a) - V(s))), max_weight)``, ``beta`` the inverse temperature;
- **targets**: Polyak averaging of the critics.

As in the paper's code, ``pi(.|s)`` is the Gaussian ``N(tanh(mu(s)), sigma(s))`` over actions in
``[-1, 1]`` (its log-density of dataset actions at the bounds stays finite, unlike a tanh-squashed one's);
eval acts with ``tanh(mu(s))``. Only ``terminated`` cuts the bootstrap.
"""
from __future__ import annotations

import math

from typing import Any, Mapping

import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.learning import LazyOptimizer, LearnResult, fused_adam
from conveyor.policy.model import EncoderHead
from conveyor.policy.options import lr_option, offline_schema
from conveyor.policy.sac import SACModel, TanhActorCriticPolicy
from conveyor.schema import Option

__all__ = ["IQLPolicy", "IQLModel", "expectile_loss"]


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """The mean of ``|expectile - 1(diff < 0)| * diff^2``: an asymmetric squared error whose minimiser over a
    constant is the ``expectile`` of the distribution of the regressed value (0.5: the mean)."""
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return (weight * diff.pow(2)).mean()


class IQLModel(SACModel):
    """IQL's networks: SAC's actor and critics plus a state-value network ``value(obs) -> [B]``."""

    def __init__(self, actor: nn.Module, critic: nn.Module, value: nn.Module) -> None:
        super().__init__(actor, critic)
        self.value = value


def _expectile_check(value: Any) -> str | None:
    return None if 0 < value < 1 else "must be in (0, 1)"


class IQLPolicy(TanhActorCriticPolicy):
    """Implicit Q-learning (see the module doc); acting as in :class:`TanhActorCriticPolicy`.

    ``learn_mode.forward(batch)`` returns ``losses/value``, ``losses/q``, ``losses/actor``,
    ``charts/v_mean``, ``charts/q_mean``, ``charts/advantage_mean`` and ``charts/weight_mean``.
    Checkpointed: ``model`` (actor, critics, value), ``target_critic``, ``actor_optimizer``,
    ``critic_optimizer``, ``value_optimizer``, ``rng`` and ``train_iter``.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """The actor-critic options, the offline ones and IQL's (defaults: the paper's for locomotion)."""
        return schema.merge_schemas(super().config_schema(), offline_schema(50_000), {
            "learn": {
                "expectile": Option(0.7, "Expectile tau of the value loss (0.5: the mean; towards 1: the best action "
                                         "the data shows).", type=float, check=_expectile_check),
                "beta": Option(3.0, "Inverse temperature of the advantage weights exp(beta * A).", type=float,
                               check=schema.non_negative),
                "max_weight": Option(100.0, "Advantage weights are clipped to this.", type=float,
                                     check=schema.positive),
                "value_learning_rate": lr_option("value network"),
                "actor_lr_decay": Option("none", "The actor's learning rate over learn.max_train_iter steps: 'none' "
                                                 "(constant) or 'cosine' (to 0, the IQL paper's on locomotion).",
                                         choices=("none", "cosine")),
            },
        })

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """An :class:`IQLModel`: SAC's actor and critics, and an :class:`EncoderHead` value network."""
        base = super().build_model(model_cfg)
        value = EncoderHead(model_cfg.obs_shape, 1, hidden_sizes=model_cfg.hidden_sizes, encoder_kind=model_cfg.encoder)
        return IQLModel(base.actor, base.critic, value)

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        if not isinstance(getattr(self.model, "value", None), nn.Module):
            raise TypeError(f"IQLPolicy needs a model with a 'value' network (forward(obs) -> [B, 1]), such as "
                            f"IQLModel; got {type(self.model).__name__}")
        learn = self.cfg.learn
        self.value: nn.Module = self.model.value
        self.value_optimizer = LazyOptimizer(torch.optim.Adam, self.value,
                                             lr=learn.value_learning_rate or learn.learning_rate,
                                             fused=fused_adam(self.device))
        self.register_state("value_optimizer", self.value_optimizer)
        self._value_params = list(self.value.parameters())

    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """Value, critic and actor updates on one flat batch, then the soft target update."""
        learn = self.cfg.learn
        discount = self._bootstrap_discount(batch)
        action = self._data_action(batch)

        # Value: the expectile of the target critics' Q at the dataset's action.
        with torch.no_grad():
            target_q = self.target_critic(batch.obs, action).min(0).values
        v = self.value(batch.obs).squeeze(-1)
        value_loss = expectile_loss(target_q - v, learn.expectile)
        self._apply_gradients(value_loss, self.value_optimizer, self._value_params)

        # Critics: one-step bootstrap from V(s'), never from an action the data does not hold.
        with torch.no_grad():
            next_v = self.value(batch.next_obs).squeeze(-1)
            target = batch.reward + discount * (1.0 - batch.terminated.float()) * next_v
        q = self.critic(batch.obs, action)  # [critic_num, B]
        q_loss = (q - target).pow(2).sum(0).mean()
        self._apply_gradients(q_loss, self.critic_optimizer, self._critic_params)

        # Actor: advantage-weighted log-likelihood of the dataset's action.
        with torch.no_grad():
            advantage = target_q - v.detach()
            weight = torch.exp(learn.beta * advantage).clamp(max=learn.max_weight)
        mean, log_std = self.actor(batch.obs)
        log_prob = torch.distributions.Normal(torch.tanh(mean), log_std.exp()).log_prob(action).sum(-1)
        actor_loss = -(weight * log_prob).mean()
        if learn.actor_lr_decay == "cosine":  # from train_iter, which checkpoints keep: a resume decays alike
            done = min(self.train_iter, learn.max_train_iter) / learn.max_train_iter
            self.actor_optimizer.set_lr_factor(0.5 * (1.0 + math.cos(math.pi * done)))
        self._apply_gradients(actor_loss, self.actor_optimizer, self._actor_params)

        self.train_iter += 1
        self._target_sync.soft(learn.target_theta)
        return LearnResult({
            "losses/value": value_loss.item(),
            "losses/q": q_loss.item(),
            "losses/actor": actor_loss.item(),
            "charts/v_mean": v.detach().mean().item(),
            "charts/q_mean": q.detach().mean().item(),
            "charts/advantage_mean": advantage.mean().item(),
            "charts/weight_mean": weight.mean().item(),
        })
