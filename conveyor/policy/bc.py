"""Behaviour cloning: learn the dataset's actions from its observations, by supervised learning.

- Discrete actions (``model.action_space='discrete'``): a categorical policy, cross-entropy of the
  dataset's action under the logits.
- Continuous actions (``model.action_space='continuous'``): a deterministic policy
  ``a = tanh(f(s))`` in ``[-1, 1]`` (scaled to the env's bounds), trained by mean squared error against
  the dataset's action mapped to ``[-1, 1]``. Deterministic because what BC is judged on is the action it
  takes: the MSE minimiser is the dataset's conditional mean action, which for the one (noisy) behaviour
  policy a dataset here comes from is that policy's own action, while a Gaussian likelihood would learn the
  same mean plus a variance that nothing acts on, and lets the loss trade mean accuracy for variance.

Rewards, ``next_obs`` and episode ends are not read: BC imitates whatever made the data.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.base import Policy
from conveyor.policy.learning import LazyOptimizer, LearnResult, fused_adam
from conveyor.policy.options import action_bound_check, hidden_sizes_check, offline_schema
from conveyor.policy.continuous import ActionScaler
from conveyor.policy.model import EncoderHead
from conveyor.policy.weights import Acting
from conveyor.schema import ConfigError, Option

__all__ = ["BCPolicy"]

_KINDS = {"discrete": "Discrete", "continuous": "Box"}


class BCPolicy(Policy):
    """Behaviour cloning for ``Discrete`` or 1-D ``Box`` actions (``model.action_space``; see the module doc).

    ``eval_mode.forward(obs)`` takes the most likely action (discrete) or the regressed one (continuous);
    ``collect_mode.forward(obs)`` samples from the softmax (discrete, from the seeded :attr:`rng`) or acts
    as eval does (continuous). ``learn_mode.forward(batch)`` takes one gradient step and returns
    ``losses/bc`` and, for discrete actions, ``charts/accuracy`` (share of the batch's actions that are the
    policy's most likely ones). Checkpointed: ``model``, ``optimizer``, ``rng``, ``train_iter``.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """Base options, the offline ones, and the action head's."""
        return schema.merge_schemas(super().config_schema(), offline_schema(10_000), {
            "model": {
                "action_space": Option("discrete", "Action head: 'discrete' (categorical, cross-entropy) or "
                                                   "'continuous' (deterministic tanh action, mean squared error).",
                                       choices=tuple(_KINDS)),
                "action_shape": Option(None, "Number of discrete actions, or the action dimension of a 1-D Box "
                                             "(set from the env).", type=int, check=schema.positive),
                "action_low": Option(None, "Lower bound of continuous actions: a float or one per dim (set from the "
                                           "env; None: -1).", type=(float, list, tuple), check=action_bound_check),
                "action_high": Option(None, "Upper bound of continuous actions: a float or one per dim (set from "
                                            "the env; None: 1).", type=(float, list, tuple), check=action_bound_check),
                "hidden_sizes": Option([256, 256], "Widths of the hidden layers.", type=list,
                                       check=hidden_sizes_check),
            },
            "learn": {
                "batch_size": Option(256, "Transitions per gradient step.", check=schema.positive),
            },
        })

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """The env's action space is the kind ``model.action_space`` names."""
        head = cfg["policy"]["model"]["action_space"]
        other = next(name for name in _KINDS if name != head)
        cls._require_action_space(cfg, action_space, _KINDS[head],
                                  f"set policy.model.action_space='{other}' for it")

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """An :class:`EncoderHead` with one output per discrete action or per action dim."""
        obs_shape = cls._required(model_cfg, "obs_shape", "obs_shape=4 for CartPole")
        action_shape = cls._required(model_cfg, "action_shape", "action_shape=2 for CartPole")
        return EncoderHead(obs_shape, action_shape, hidden_sizes=model_cfg.hidden_sizes, encoder_kind=model_cfg.encoder)

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        model_cfg = self.cfg.model
        self.discrete = model_cfg.action_space == "discrete"
        self.action_dim = self._required(model_cfg, "action_shape", "action_shape=2 for CartPole")
        self.action_scaler = None
        if not self.discrete:
            try:
                self.action_scaler = ActionScaler(self.action_dim, model_cfg.action_low, model_cfg.action_high,
                                                  device=self.device)
            except ValueError as exc:
                raise ConfigError(f"policy.model.action_low/action_high: {exc}") from None
        self.optimizer = LazyOptimizer(torch.optim.Adam, self.model, lr=self.cfg.learn.learning_rate,
                                       fused=fused_adam(self.device))
        self.register_state("optimizer", self.optimizer)
        self._parameters = list(self.model.parameters())

    # --- acting ----------------------------------------------------------------------------------
    def _forward_collect(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Discrete: an action sampled from the softmax of the logits; continuous: the eval action."""
        if not self.discrete:
            return self._forward_eval(acting, obs)
        probs = torch.softmax(acting.model(obs), -1).cpu().numpy()
        u = self.rng.random((*probs.shape[:-1], 1))
        action = (probs.cumsum(-1) < u).sum(-1).clip(max=probs.shape[-1] - 1)  # inverse CDF, one draw per env
        return {"action": action}

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """Discrete: the most likely action; continuous: ``tanh(f(s))`` in the env's bounds (float32)."""
        out = acting.model(obs)
        return out.argmax(-1) if self.discrete else self.action_scaler.to_env(torch.tanh(out))

    # --- learning --------------------------------------------------------------------------------
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One gradient step of cross-entropy (discrete) or mean squared error (continuous)."""
        out = self.model(batch.obs)
        metrics: dict[str, Any] = {}
        if self.discrete:
            action = batch.action.long().reshape(-1)
            loss = F.cross_entropy(out.reshape(-1, self.action_dim), action)
            metrics["charts/accuracy"] = (out.detach().argmax(-1).reshape(-1) == action).float().mean().item()
        else:
            target = self.action_scaler.from_env(batch.action).reshape(-1, self.action_dim).clamp(-1.0, 1.0)
            loss = F.mse_loss(torch.tanh(out).reshape(-1, self.action_dim), target)
        metrics["losses/bc"] = loss.item()
        return self._gradient_step(loss, self.optimizer, self._parameters, metrics)
