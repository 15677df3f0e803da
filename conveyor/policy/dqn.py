"""DQN: double Q-learning, dueling heads, n-step targets, prioritized-replay weights, eps-greedy acting.

The TD target of a transition is ``reward + discount * (1 - terminated) * Q_target(next_obs, a*)`` with
``a* = argmax_a Q_online(next_obs, a)`` for double DQN (``argmax_a Q_target`` otherwise). ``discount``
is the batch's own (``gamma**k`` after an n-step enhancer) or ``cfg.policy.discount_factor``. Only
``terminated`` cuts the bootstrap: a truncated episode (time limit) still bootstraps from ``next_obs``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.base import GeneratorState, Policy
from conveyor.policy.learning import LazyOptimizer, LearnResult, TargetSync, fused_adam, make_target
from conveyor.policy.options import nstep_option, replay_buffer_schema
from conveyor.policy.model import QNetwork
from conveyor.policy.weights import Acting
from conveyor.schema import ConfigError, Option

__all__ = ["DQNPolicy"]


def _theta_check(value: Any) -> str | None:
    return None if value is None or 0 < value <= 1 else "must be in (0, 1] (or None for hard updates)"


def _action_num_check(value: Any) -> str | None:
    return None if value is None or (isinstance(value, int) and value > 1) else \
        "must be the number of discrete actions (an int > 1)"


class DQNPolicy(Policy):
    """Deep Q-learning for discrete actions (Mnih et al. 2015) with the usual Rainbow-lite options.

    ``collect_mode.forward(obs, eps=...)`` acts eps-greedily (vectorised over envs, drawing from the
    seeded :attr:`rng`); ``eval_mode.forward(obs)`` is greedy. ``learn_mode.forward(batch)`` takes one
    gradient step; its :class:`~conveyor.policy.LearnResult` has the metrics ``losses/td``, ``charts/q_mean``,
    ``charts/target_q_mean`` and, when the batch carries importance ``weight`` (prioritized replay),
    ``priorities`` (``|TD error|`` per sample).
    """

    @classmethod
    def config_schema(cls) -> dict:
        """Base options plus DQN's (defaults suit CartPole)."""
        return schema.merge_schemas(super().config_schema(), {
            "nstep": nstep_option(),
            "model": {
                "action_shape": Option(None, "Number of discrete actions (set from the env).", type=int,
                                       check=_action_num_check),
                "dueling": Option(True, "Dueling head: Q = V + A - mean(A)."),
            },
            "learn": {
                "update_per_collect": Option(4, "Gradient steps per collection round.", check=schema.positive),
                "double": Option(True, "Double DQN: pick the next action with the online net, value it with the "
                                       "target net."),
                "loss": Option("huber", "Per-sample TD loss.", choices=("huber", "mse")),
                "target_update_freq": Option(100, "Hard target update every this many gradient steps "
                                                  "(when target_theta is None).", check=schema.positive),
                "target_theta": Option(None, "Soft target update rate per gradient step (None: hard updates).",
                                       type=float, check=_theta_check),
            },
            "collect": {
                "n_sample": Option(32, "Transitions collected per collection round (over all envs).",
                                   check=schema.positive),
            },
            "eval": {
                "eps": Option(0.0, "Exploration rate of evaluation episodes (0: greedy). Atari entries use 0.05, as "
                                   "Mnih et al. 2015 did, so a deterministic policy cannot loop until the time limit.",
                              type=float, check=schema.unit_interval),
            },
            "other": {
                "eps": {
                    "kind": Option("exp", "Shape of the exploration schedule over env steps (the pipeline's eps "
                                          "handler reads these keys and passes eps to collect_mode.forward).",
                                   choices=("exp", "linear")),
                    "start": Option(1.0, "Exploration rate at the first env step.", type=float,
                                    check=schema.unit_interval),
                    "end": Option(0.05, "Final exploration rate.", type=float, check=schema.unit_interval),
                    "decay": Option(5000, "Env steps of decay (time constant for 'exp', length for 'linear').",
                                    check=schema.positive),
                },
                "replay_buffer": replay_buffer_schema(20000),
            },
        })

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """A Discrete action space, and an exploration rate that decays (``eps.start >= eps.end``)."""
        cls._require_action_space(cfg, action_space, "Discrete", "use a continuous-action algorithm for it "
                                  "(SAC, or PPO with policy.model.action_space='gaussian')")
        eps = cfg["policy"]["other"]["eps"]
        if eps["start"] < eps["end"]:
            raise ConfigError(f"config key 'policy.other.eps.start' ({eps['start']}) is below 'policy.other.eps.end' "
                              f"({eps['end']}): exploration decays from start to end, so set start >= end")

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """A :class:`QNetwork` over the encoder ``model_cfg.encoder`` names for ``model_cfg.obs_shape``."""
        obs_shape = cls._required(model_cfg, "obs_shape", "obs_shape=4 for CartPole")
        action_num = cls._required(model_cfg, "action_shape", "action_shape=2 for CartPole")
        return QNetwork(obs_shape, action_num, hidden_sizes=model_cfg.hidden_sizes, dueling=model_cfg.dueling,
                        encoder_kind=model_cfg.encoder)

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        learn = self.cfg.learn
        self.target_model = make_target(self.model)
        self._target_sync = TargetSync(self.target_model, self.model)
        self.optimizer = LazyOptimizer(torch.optim.Adam, self.model, lr=learn.learning_rate,
                                       fused=fused_adam(self.device))
        self.register_state("target_model", self.target_model)
        self.register_state("optimizer", self.optimizer)
        self._parameters = list(self.model.parameters())
        self._loss_fn: Callable[..., torch.Tensor] = F.huber_loss if learn.loss == "huber" else F.mse_loss
        self.eval_rng: np.random.Generator | None = None  # evaluation's own draws: collecting's stream is untouched
        if self.cfg.eval.eps > 0:
            self.eval_rng = self.rng.spawn(1)[0]
            self.register_state("eval_rng", GeneratorState(self.eval_rng))

    # --- acting ----------------------------------------------------------------------------------
    def _forward_collect(self, acting: Acting, obs: Any, *, eps: float) -> dict[str, Any]:
        """Eps-greedy actions: each env independently acts uniformly at random with probability ``eps``."""
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"DQNPolicy.collect_mode.forward: eps must be in [0, 1], got {eps!r}")
        return {"action": _eps_greedy(acting.model(obs), eps, self.rng)}

    def _forward_eval(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Greedy actions (:meth:`_greedy`), or eps-greedy with ``eval.eps`` (drawn from :attr:`eval_rng`)."""
        if self.eval_rng is None:
            return super()._forward_eval(acting, obs)
        return {"action": _eps_greedy(acting.model(obs), self.cfg.eval.eps, self.eval_rng)}

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """The action of the highest Q-value."""
        return acting.model(obs).argmax(-1)

    # --- learning --------------------------------------------------------------------------------
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One gradient step of (double) DQN on a flat batch of transitions."""
        discount = self._bootstrap_discount(batch)
        q_all = self.model(batch.obs)
        q = q_all.gather(-1, batch.action.long().reshape(*q_all.shape[:-1], 1)).squeeze(-1)

        with torch.no_grad():
            next_q_target = self.target_model(batch.next_obs)
            next_q_select = self.model(batch.next_obs) if self.cfg.learn.double else next_q_target
            next_action = next_q_select.argmax(-1, keepdim=True)
            next_value = next_q_target.gather(-1, next_action).squeeze(-1)
            target = batch.reward + discount * (1.0 - batch.terminated.float()) * next_value

        prioritized = "weight" in batch
        if prioritized:
            td_loss = (self._loss_fn(q, target, reduction="none") * batch.weight).mean()
        else:
            td_loss = self._loss_fn(q, target)
        extra = self._extra_losses(batch, q_all, q)
        loss = td_loss + sum(extra.values()) if extra else td_loss

        grad_norm = self._apply_gradients(loss, self.optimizer, self._parameters)
        self.train_iter += 1
        self._update_target()

        q = q.detach()
        out: dict[str, Any] = {
            "losses/td": td_loss.item(),
            **{name: term.item() for name, term in extra.items()},
            "charts/q_mean": q.mean().item(),
            "charts/target_q_mean": target.mean().item(),
        }
        if grad_norm is not None:
            out["charts/grad_norm"] = grad_norm.item()
        return LearnResult(out, priorities=(q - target).abs().cpu().numpy() if prioritized else None)

    def _extra_losses(self, batch: ttorch.Tensor, q_all: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss terms added to the TD loss, by metric name, from the batch's Q-values ``q_all`` ``[B, A]`` and
        those of its actions ``q`` ``[B]`` (DQN adds none; conservative Q-learning adds its penalty)."""
        return {}

    def _update_target(self) -> None:
        """Soft update every step when ``target_theta`` is set, else a hard copy every ``target_update_freq``."""
        self._target_sync.after_step(self.train_iter, self.cfg.learn.target_theta, self.cfg.learn.target_update_freq)


def _eps_greedy(q: torch.Tensor, eps: float, rng: np.random.Generator) -> np.ndarray:
    """The argmax of each row of ``q``, replaced by a uniform action with probability ``eps``: one draw per env
    decides whether it explores, a second which action it takes."""
    greedy = q.argmax(-1).cpu().numpy()
    u = rng.random((2, *greedy.shape))
    random_action = (u[1] * q.shape[-1]).astype(greedy.dtype)
    return np.where(u[0] < eps, random_action, greedy)
