"""Conservative Q-learning (Kumar et al. 2020, "CQL(H)"): the learner's own TD loss plus a penalty that
pushes Q down on actions the policy could pick and up on the dataset's actions,

    penalty = alpha * mean_s( log sum_a exp Q(s, a) - Q(s, a_data) ),

so actions the data never shows cannot look better than those it does.

Two classes, because a config schema is fixed before the env is known and the two learners' schemas differ:

- :class:`DiscreteCQLPolicy` is DQN (:class:`~conveyor.policy.dqn.DQNPolicy`) plus the penalty, whose
  ``log sum_a`` runs over every action exactly (:func:`discrete_cql_penalty`).
- :class:`CQLPolicy` (continuous, 1-D ``Box``) is SAC (:class:`~conveyor.policy.sac.SACPolicy`) plus the
  penalty on every critic, with ``log sum_a exp Q`` estimated by importance sampling as in the paper's
  appendix F: ``n_actions`` actions per state from each of three proposals (uniform on ``[-1, 1]``, the
  policy at ``s``, the policy at ``s'``), each weighted by ``1 / proposal density``
  (:func:`continuous_cql_penalty`). Sampled actions carry no gradient; the penalty trains only the critics.

``alpha`` (``learn.cql_alpha``) is fixed: the paper's Lagrangian variant, which tunes it against a target
gap, is not implemented. Both are trained from a dataset (``policy.other.dataset``) by the offline pipeline.
"""
from __future__ import annotations

import math
import torch
import treetensor.torch as ttorch

from conveyor import schema
from conveyor.policy.continuous import tanh_gaussian_log_prob
from conveyor.policy.options import offline_schema
from conveyor.policy.dqn import DQNPolicy
from conveyor.policy.sac import SACPolicy
from conveyor.schema import Option

__all__ = ["CQLPolicy", "DiscreteCQLPolicy", "discrete_cql_penalty", "continuous_cql_penalty"]


def discrete_cql_penalty(q_all: torch.Tensor, q_data: torch.Tensor) -> torch.Tensor:
    """``mean_b(logsumexp_a q_all[b, a] - q_data[b])`` for Q-values ``q_all`` ``[B, A]`` and those of the
    dataset's actions ``q_data`` ``[B]``."""
    return (torch.logsumexp(q_all, dim=-1) - q_data).mean()


def continuous_cql_penalty(q_sampled: torch.Tensor, log_density: torch.Tensor, q_data: torch.Tensor) -> torch.Tensor:
    """The CQL(H) penalty with ``log sum_a exp Q(s, a)`` estimated from sampled actions, summed over critics.

    ``q_sampled`` ``[E, B, M]``: each of ``E`` critics' Q-values of ``M`` sampled actions per state;
    ``log_density`` ``[B, M]``: the log-density of each under the proposal it was drawn from (drawn in equal
    numbers from each proposal); ``q_data`` ``[E, B]``: the Q-values of the dataset's actions. The estimate
    is ``log(1/M sum_m exp(Q_m - log_density_m))``.
    """
    log_sum_exp = torch.logsumexp(q_sampled - log_density, dim=-1) - math.log(q_sampled.shape[-1])
    return (log_sum_exp - q_data).mean(-1).sum()


def _alpha_option(default: float) -> dict:
    return {"learn": {"cql_alpha": Option(default, "Weight alpha of the conservative penalty (fixed).", type=float,
                                          check=schema.non_negative)}}


class DiscreteCQLPolicy(DQNPolicy):
    """CQL for ``Discrete`` actions: DQN's TD loss plus ``alpha`` times :func:`discrete_cql_penalty`.

    As :class:`~conveyor.policy.dqn.DQNPolicy` (acting, targets, checkpoint); ``learn_mode.forward`` also
    returns ``losses/cql`` (the weighted penalty). Defaults suit offline training: one-step returns.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """DQN's options, the offline ones and ``learn.cql_alpha``."""
        return schema.merge_schemas(super().config_schema(), offline_schema(20_000), _alpha_option(1.0))

    def _extra_losses(self, batch: ttorch.Tensor, q_all: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
        """The conservative penalty, weighted by ``learn.cql_alpha``."""
        return {"losses/cql": self.cfg.learn.cql_alpha * discrete_cql_penalty(q_all, q)}


class CQLPolicy(SACPolicy):
    """CQL for 1-D ``Box`` actions: SAC with ``alpha`` times :func:`continuous_cql_penalty` added to the
    critics' loss (``learn.cql_n_actions`` actions per proposal and state, drawn with the learner's
    generator, so a resumed run draws the same ones).

    As :class:`~conveyor.policy.sac.SACPolicy` (acting, actor and temperature updates, checkpoint), except that
    for the first ``learn.bc_warmup_steps`` gradient steps the actor clones the dataset's actions;
    ``learn_mode.forward`` also returns ``losses/cql`` (the weighted penalty).
    """

    @classmethod
    def config_schema(cls) -> dict:
        """SAC's options, the offline ones, ``learn.cql_alpha`` and ``learn.cql_n_actions``."""
        return schema.merge_schemas(super().config_schema(), offline_schema(50_000), _alpha_option(1.0), {
            "learn": {
                "cql_n_actions": Option(10, "Actions sampled per state from each of the three proposals to estimate "
                                            "log sum_a exp Q(s, a).", check=schema.positive),
                "bc_warmup_steps": Option(0, "First gradient steps in which the actor clones the dataset's actions "
                                             "(maximises their log-likelihood, with the entropy term) instead of "
                                             "maximising Q: the paper's policy_eval_start (40k on D4RL Gym).",
                                          check=schema.non_negative),
            },
        })

    def _learn_variant(self) -> bool:
        """Whether the behaviour-cloning warm-up is over (the actor's loss differs before)."""
        return self.train_iter >= self.cfg.learn.bc_warmup_steps

    def _actor_loss(self, batch: ttorch.Tensor, action: torch.Tensor, log_prob: torch.Tensor, q_pi: torch.Tensor,
                    alpha: torch.Tensor) -> torch.Tensor:
        """SAC's actor loss, or during the first ``learn.bc_warmup_steps`` steps behaviour cloning:
        ``mean(alpha * log pi(a~|s) - log pi(a_data|s))``."""
        if self._learn_variant():
            return super()._actor_loss(batch, action, log_prob, q_pi, alpha)
        mean, log_std = self.actor(batch.obs)
        return (alpha * log_prob - tanh_gaussian_log_prob(mean, log_std, action)).mean()

    def _extra_critic_losses(self, batch: ttorch.Tensor, action: torch.Tensor,
                             q: torch.Tensor) -> dict[str, torch.Tensor]:
        """The conservative penalty on every critic, weighted by ``learn.cql_alpha``."""
        n, batch_size = self.cfg.learn.cql_n_actions, action.shape[0]
        generator = self._learn_generator
        per_state = torch.arange(batch_size * n, device=action.device) // n  # [B * n]: 0 0 .. 1 1 ..; graph-safe
        with torch.no_grad():
            uniform = torch.rand((batch_size * n, self.action_dim), generator=generator, device=action.device)
            policy_action, policy_log_prob = self.actor.sample(batch.obs[per_state], generator=generator)
            next_action, next_log_prob = self.actor.sample(batch.next_obs[per_state], generator=generator)
            sampled = torch.cat([2.0 * uniform - 1.0, policy_action, next_action])  # [3 * B * n, A]
            uniform_log_density = torch.full_like(policy_log_prob, -self.action_dim * math.log(2.0))
            log_density = torch.stack([uniform_log_density, policy_log_prob, next_log_prob])  # [3, B * n]
            log_density = log_density.reshape(3, batch_size, n).permute(1, 0, 2).reshape(batch_size, 3 * n)
        # Every sampled action is valued at s, the state it was drawn for (also those drawn from pi(.|s')).
        q_sampled = self.critic(batch.obs[per_state.repeat(3)], sampled)  # [E, 3 * B * n]
        q_sampled = q_sampled.reshape(-1, 3, batch_size, n).permute(0, 2, 1, 3).reshape(-1, batch_size, 3 * n)
        return {"losses/cql": self.cfg.learn.cql_alpha * continuous_cql_penalty(q_sampled, log_density, q)}

