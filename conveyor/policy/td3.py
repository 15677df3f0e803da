"""TD3: twin delayed deep deterministic policy gradient, for continuous actions (Fujimoto et al. 2018,
"Addressing Function Approximation Error in Actor-Critic Methods").

One :meth:`TD3Policy.learn_mode.forward` does, on one batch:

- **critics** (every call): ``y = reward + discount * (1 - terminated) * min_i Q'_i(s', a')`` with the
  smoothed target action ``a' = clip(mu'(s') + clip(N(0, target_noise), -noise_clip, noise_clip), -1, 1)``
  (clipped double Q-learning and target policy smoothing); every critic regresses on ``y``;
- **actor and targets** (every ``policy_delay``-th call, the first included): maximise ``Q_1(s, mu(s))``, then
  Polyak-average the target actor ``mu'`` and the target critics ``Q'`` by ``target_theta``.

Actions are in ``[-1, 1]`` inside the policy (``target_noise``, ``noise_clip`` and ``exploration_noise`` are
fractions of the half-range of the env's bounds); the batch's actions, in the env's bounds, are mapped back
first, as SAC does. Defaults are the paper's and CleanRL's ``td3_continuous_action``.
"""
from __future__ import annotations

from typing import Any, Hashable, Mapping

import numpy as np
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.continuous import DeterministicActor, EnsembleQ
from conveyor.policy.learning import TargetSync, make_target
from conveyor.policy.options import cuda_graph_option
from conveyor.policy.q_actor_critic import QActorCriticPolicy
from conveyor.policy.sac import SACModel
from conveyor.policy.weights import Acting
from conveyor.schema import Option

__all__ = ["TD3Policy"]


class TD3Policy(QActorCriticPolicy):
    """TD3 for 1-D ``Box`` action spaces (see the module doc for the losses).

    ``collect_mode.forward(obs)`` acts with ``mu(s)`` plus Gaussian noise of std ``collect.exploration_noise``
    (from the seeded :attr:`rng`), clipped to the bounds; ``eval_mode.forward(obs)`` with ``mu(s)``. Both
    return actions in the env's bounds. ``learn_mode.forward(batch)`` returns ``losses/q``,
    ``charts/q_mean``, ``charts/target_q_mean`` and, on the steps that update the actor, ``losses/actor``;
    ``priorities`` with a prioritized batch. Checkpointed: ``model``, ``target_critic``, ``target_actor``,
    ``actor_optimizer``, ``critic_optimizer``, the exploration ``rng``, the learner's ``learn_rng`` and
    ``train_iter`` (which counts critic steps and so times the delayed updates).
    """

    @classmethod
    def config_schema(cls) -> dict:
        """The actor-critic options plus TD3's delay and noises (defaults: the TD3 paper's)."""
        return schema.merge_schemas(super().config_schema(), {
            "learn": {
                "policy_delay": Option(2, "Critic steps per actor step; the target networks are updated with the "
                                          "actor.", check=schema.positive),
                "target_noise": Option(0.2, "Std of the Gaussian noise on the target actor's action (target policy "
                                            "smoothing), as a fraction of the action half-range.",
                                       type=float, check=schema.non_negative),
                "noise_clip": Option(0.5, "The target noise is clipped to [-noise_clip, noise_clip] (a fraction of "
                                          "the action half-range).", type=float, check=schema.non_negative),
                "cuda_graph": cuda_graph_option(),
            },
            "collect": {
                "exploration_noise": Option(0.1, "Std of the Gaussian noise added to the actor's action when "
                                                 "collecting, as a fraction of the action half-range.",
                                            type=float, check=schema.non_negative),
            },
        })

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """A :class:`SACModel` of a :class:`DeterministicActor` and an :class:`EnsembleQ` of ``critic_num`` critics."""
        obs_shape = cls._required(model_cfg, "obs_shape", "obs_shape=3 for Pendulum")
        action_dim = cls._required(model_cfg, "action_shape", "action_shape=1 for Pendulum")
        hidden = model_cfg.hidden_sizes
        kind = model_cfg.encoder
        return SACModel(DeterministicActor(obs_shape, action_dim, hidden_sizes=hidden, encoder_kind=kind),
                        EnsembleQ(obs_shape, action_dim, hidden_sizes=hidden, ensemble_size=model_cfg.critic_num,
                                  encoder_kind=kind))

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        self.target_actor = make_target(self.actor)
        self._target_actor_sync = TargetSync(self.target_actor, self.actor)
        self.register_state("target_actor", self.target_actor)
        self._learn_generator = self._learn_rng()

    # --- acting ----------------------------------------------------------------------------------
    def _forward_collect(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """``mu(s)`` plus exploration noise, clipped to the bounds, in the env's bounds as float32 numpy."""
        action = acting.model.actor(obs)
        noise = self.rng.standard_normal(action.shape, dtype=np.float32) * self.cfg.collect.exploration_noise
        action = (action + torch.from_numpy(noise).to(action.device)).clamp(-1.0, 1.0)
        return {"action": self.action_scaler.to_env(action).cpu().numpy()}

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """The deterministic actions ``mu(s)`` in the env's bounds (float32)."""
        return self.action_scaler.to_env(acting.model.actor(obs))

    # --- learning --------------------------------------------------------------------------------
    def target_action(self, next_obs: Any) -> torch.Tensor:
        """The smoothed target action ``clip(mu'(s') + clip(noise, -noise_clip, noise_clip), -1, 1)`` in ``[-1, 1]``,
        its noise drawn from the learner's generator."""
        learn = self.cfg.learn
        with torch.no_grad():
            action = self.target_actor(next_obs)
            noise = torch.randn(action.shape, generator=self._learn_generator, device=action.device)
            noise = (noise * learn.target_noise).clamp(-learn.noise_clip, learn.noise_clip)
            return (action + noise).clamp(-1.0, 1.0)

    def _learn_variant(self) -> bool:
        """Whether the actor steps this time: every ``policy_delay``-th step."""
        return self.train_iter % self.cfg.learn.policy_delay == 0

    def _learn_tensors(self, batch: ttorch.Tensor,
                       variant: Hashable) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A critic step; when ``variant`` (every ``policy_delay``-th step) also an actor step and the soft target
        updates."""
        learn = self.cfg.learn
        discount = self._bootstrap_discount(batch)
        with torch.no_grad():
            next_q = self.target_critic(batch.next_obs, self.target_action(batch.next_obs)).min(0).values
            target_q = batch.reward + discount * (1.0 - batch.terminated.float()) * next_q
        q, td_error, losses, critic_grad_norm = self._critic_step(batch, self._data_action(batch), target_q)
        metrics = {**losses, "charts/q_mean": q.mean(), "charts/target_q_mean": target_q.mean()}
        if critic_grad_norm is not None:
            metrics["charts/critic_grad_norm"] = critic_grad_norm
        if variant:
            with self._critic_frozen():
                actor_loss = -self.critic(batch.obs, self.actor(batch.obs))[0].mean()
                actor_grad_norm = self._apply_gradients(actor_loss, self.actor_optimizer, self._actor_params)
            self._target_sync.soft(learn.target_theta)
            self._target_actor_sync.soft(learn.target_theta)
            metrics["losses/actor"] = actor_loss.detach()
            if actor_grad_norm is not None:
                metrics["charts/actor_grad_norm"] = actor_grad_norm
        return metrics, td_error
