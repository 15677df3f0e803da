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
from typing import Any, Mapping

import numpy as np
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.base import Acting, Policy
from conveyor.policy.learning import LazyOptimizer, LearnResult, TargetSync, fused_adam, make_target
from conveyor.policy.options import _hidden_sizes_check, lr_option, nstep_option, replay_buffer_schema, with_defaults
from conveyor.policy.continuous import ActionScaler, EnsembleQ, TanhGaussianActor
from conveyor.schema import ConfigError, Option

__all__ = ["SACPolicy", "SACModel", "TanhActorCriticPolicy"]


def _theta_check(value: Any) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def _action_dim_check(value: Any) -> str | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    return None if ok else "must be the action dimension of a 1-D Box action space (an int > 0)"


def _bound_check(value: Any) -> str | None:
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    ok = isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value)
    return None if ok else "must be a float, a list of floats (one per action dim), or None"


def _log_std_bounds_check(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value) \
        and value[0] < value[1]
    return None if ok else "must be [low, high] with low < high"


class SACModel(nn.Module):
    """SAC's networks: a :class:`TanhGaussianActor` and an :class:`EnsembleQ` of ``critic_num`` critics."""

    def __init__(self, actor: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic


class _TorchGeneratorState:
    """Checkpoints a ``torch.Generator`` (the learner's sampling noise) so a resumed run continues exactly."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.generator.set_state(state_dict["state"])


class _Temperature(nn.Module):
    """The learned ``log_alpha`` (a module, so it is checkpointed and moved with the policy)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(math.log(alpha), dtype=torch.float32))


class TanhActorCriticPolicy(Policy):
    """What the actor-critic policies for 1-D ``Box`` actions share (SAC, IQL, continuous CQL): a
    :class:`TanhGaussianActor`, an :class:`EnsembleQ` of critics with a Polyak-averaged target copy, the
    env's action bounds, one Adam optimizer for the actor and one for the critics, and acting.

    ``collect_mode.forward(obs)`` samples ``a ~ pi(.|s)`` (noise from the seeded :attr:`rng`);
    ``eval_mode.forward(obs)`` acts with the mean ``tanh(mu(s))``. Both return actions scaled to the
    bounds ``model.action_low`` / ``model.action_high`` (``compile_config`` fills them from the env).
    Subclasses write ``_forward_learn``. Checkpointed: ``model``, ``target_critic``, ``actor_optimizer``,
    ``critic_optimizer``, the exploration ``rng`` and ``train_iter``.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """Base options plus the actor's and critics' (defaults are the SAC paper's: 256x256, lr 3e-4, batch 256)."""
        base = super().config_schema()
        changed = with_defaults(base, {"learn": {"batch_size": 256, "learning_starts": 1000},
                                       "collect": {"n_sample": 8}})
        return schema.merge_schemas(base, changed, {
            "nstep": nstep_option(),
            "model": {
                "action_shape": Option(None, "Action dimension of the 1-D Box action space (set from the env).",
                                       type=int, check=_action_dim_check),
                "action_low": Option(None, "Lower action bound: a float or one per dim (set from the env; None: -1).",
                                     type=(float, list, tuple), check=_bound_check),
                "action_high": Option(None, "Upper action bound: a float or one per dim (set from the env; None: 1).",
                                      type=(float, list, tuple), check=_bound_check),
                "hidden_sizes": Option([256, 256], "Widths of the hidden layers of the actor and of each critic.",
                                       type=list, check=_hidden_sizes_check),
                "critic_num": Option(2, "Critics in the ensemble; targets and the actor use their minimum.",
                                     check=schema.positive),
                "log_std_bounds": Option([-5.0, 2.0], "Range [low, high] the actor's log-std is squashed into.",
                                         type=list, check=_log_std_bounds_check),
            },
            "learn": {
                "learning_rate": Option(3e-4, "Adam learning rate of every network (unless set apiece below).",
                                        type=float, check=schema.positive),
                "actor_learning_rate": lr_option("actor"),
                "critic_learning_rate": lr_option("critic"),
                "target_theta": Option(0.005, "Soft target update rate of the critics per gradient step.",
                                       type=float, check=_theta_check),
            },
            "collect": {
                "random_collect_size": Option(5000, "Env steps of uniformly random actions before the policy acts "
                                                    "(the pipeline passes it to StepCollector).",
                                              check=schema.non_negative),
            },
            "other": {
                "replay_buffer": replay_buffer_schema(1_000_000),
            },
        })

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """A 1-D Box action space."""
        cls._require_action_space(cfg, action_space, "Box", "use DQN or PPO for discrete actions")

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """A :class:`SACModel` from ``model_cfg``: actor and critics share no weights."""
        obs_shape = cls._required(model_cfg, "obs_shape", "obs_shape=3 for Pendulum")
        action_dim = cls._required(model_cfg, "action_shape", "action_shape=1 for Pendulum")
        hidden = model_cfg.hidden_sizes
        actor = TanhGaussianActor(obs_shape, action_dim, hidden_sizes=hidden,
                                  log_std_bounds=model_cfg.log_std_bounds)
        critic = EnsembleQ(obs_shape, action_dim, hidden_sizes=hidden, ensemble_size=model_cfg.critic_num)
        return SACModel(actor, critic)

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        learn, model_cfg = self.cfg.learn, self.cfg.model
        if not (isinstance(getattr(self.model, "actor", None), nn.Module)
                and isinstance(getattr(self.model, "critic", None), nn.Module)):
            raise TypeError(f"{type(self).__name__} needs a model with an 'actor' (sample, mode, forward -> "
                            f"(mean, log_std)) and a 'critic' (forward(obs, action) -> [critic_num, B]), such as "
                            f"SACModel; got {type(self.model).__name__}")
        self.actor: nn.Module = self.model.actor
        self.critic: nn.Module = self.model.critic
        self.target_critic = make_target(self.critic)
        self._target_sync = TargetSync(self.target_critic, self.critic)
        action_dim = self._required(model_cfg, "action_shape", "action_shape=1 for Pendulum")
        try:
            self.action_scaler = ActionScaler(action_dim, model_cfg.action_low, model_cfg.action_high,
                                              device=self.device)
        except ValueError as exc:
            raise ConfigError(f"policy.model.action_low/action_high: {exc}") from None
        self.action_dim = action_dim
        lr = learn.learning_rate
        self.actor_optimizer = LazyOptimizer(torch.optim.Adam, self.actor, lr=learn.actor_learning_rate or lr,
                                             fused=fused_adam(self.device))
        self.critic_optimizer = LazyOptimizer(torch.optim.Adam, self.critic, lr=learn.critic_learning_rate or lr,
                                              fused=fused_adam(self.device))
        self.register_state("target_critic", self.target_critic)
        self.register_state("actor_optimizer", self.actor_optimizer)
        self.register_state("critic_optimizer", self.critic_optimizer)
        self._actor_params = list(self.actor.parameters())
        self._critic_params = list(self.critic.parameters())

    def _data_action(self, batch: ttorch.Tensor) -> torch.Tensor:
        """The batch's actions (in the env's bounds) mapped to ``[-1, 1]``, as ``[B, action_dim]``."""
        return self.action_scaler.from_env(batch.action).reshape(-1, self.action_dim)

    # --- acting ----------------------------------------------------------------------------------
    def _forward_collect(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Sampled actions ``tanh(mu + sigma * noise)`` in the env's bounds, as float32 numpy."""
        mean, log_std = acting.model.actor(obs)
        noise = torch.from_numpy(self.rng.standard_normal(mean.shape, dtype=np.float32)).to(mean.device)
        action = torch.tanh(mean + log_std.exp() * noise)
        return {"action": self.action_scaler.to_env(action).cpu().numpy()}

    def _forward_eval(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """The deterministic actions ``tanh(mu)`` in the env's bounds, as float32 numpy."""
        return {"action": self.action_scaler.to_env(acting.model.actor.mode(obs)).cpu().numpy()}


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
            },
        })

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        learn = self.cfg.learn
        self.target_entropy = float(-self.action_dim if learn.target_entropy is None else learn.target_entropy)
        self.temperature = _Temperature(learn.alpha).to(self.device)
        self.temperature.requires_grad_(learn.auto_alpha)
        self.alpha_optimizer = LazyOptimizer(torch.optim.Adam, self.temperature,
                                             lr=learn.alpha_learning_rate or learn.learning_rate,
                                             fused=fused_adam(self.device))
        self._learn_generator = torch.Generator(device=self.device)
        self._learn_generator.manual_seed(int(self.rng.integers(0, 2**62)))
        self.register_state("temperature", self.temperature)
        self.register_state("alpha_optimizer", self.alpha_optimizer)
        self.register_state("learn_rng", _TorchGeneratorState(self._learn_generator))

    @property
    def alpha(self) -> float:
        """The current entropy temperature."""
        return float(self.temperature.log_alpha.detach().exp())

    # --- learning --------------------------------------------------------------------------------
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
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
        q = self.critic(batch.obs, action)  # [critic_num, B]
        td_error = q - target_q
        prioritized = "weight" in batch
        per_sample = td_error.pow(2).sum(0)  # each critic's squared error, summed over critics
        q_loss = (per_sample * batch.weight).mean() if prioritized else per_sample.mean()
        extra = self._extra_critic_losses(batch, action, q)
        critic_loss = q_loss + sum(extra.values()) if extra else q_loss
        critic_grad_norm = self._apply_gradients(critic_loss, self.critic_optimizer, self._critic_params)

        # Actor: maximise min_i Q_i(s, a) + alpha * entropy, with a ~ pi(.|s) reparameterised. The
        # critics' weights take no gradient from this loss.
        self.critic.requires_grad_(False)
        try:
            new_action, log_prob = self.actor.sample(batch.obs, generator=generator)
            q_pi = self.critic(batch.obs, new_action).min(0).values
            actor_loss = (alpha * log_prob - q_pi).mean()
            actor_grad_norm = self._apply_gradients(actor_loss, self.actor_optimizer, self._actor_params)
        finally:
            self.critic.requires_grad_(True)

        # Temperature: alpha rises while the entropy -log pi is below target_entropy, falls above it.
        log_prob = log_prob.detach()
        alpha_loss = -(log_alpha * (log_prob + self.target_entropy)).mean()
        if self.cfg.learn.auto_alpha:
            self.alpha_optimizer.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_optimizer.step()

        self.train_iter += 1
        self._target_sync.soft(self.cfg.learn.target_theta)

        td_error = td_error.detach()
        out: dict[str, Any] = {
            "losses/q": q_loss.item(),
            **{name: term.item() for name, term in extra.items()},
            "losses/actor": actor_loss.item(),
            "losses/alpha": alpha_loss.item(),
            "charts/alpha": alpha.item(),
            "charts/entropy": -log_prob.mean().item(),
            "charts/q_mean": q.detach().mean().item(),
            "charts/target_q_mean": target_q.mean().item(),
        }
        if critic_grad_norm is not None:
            out["charts/critic_grad_norm"] = critic_grad_norm.item()
            out["charts/actor_grad_norm"] = actor_grad_norm.item()
        return LearnResult(out, priorities=td_error.abs().mean(0).cpu().numpy() if prioritized else None)

    def _extra_critic_losses(self, batch: ttorch.Tensor, action: torch.Tensor,
                             q: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss terms added to the critics' TD loss, by metric name, from the batch, its actions in ``[-1, 1]``
        and their Q-values ``q`` ``[critic_num, B]`` (SAC adds none; conservative Q-learning adds its penalty)."""
        return {}
