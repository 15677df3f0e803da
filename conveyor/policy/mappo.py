"""MAPPO and IPPO: PPO for a team of agents, with a centralized (MAPPO) or decentralized (IPPO) critic.

Both are :class:`MAPPOPolicy`; ``policy.model.critic`` chooses the critic's input (:class:`IPPOPolicy` only changes
its default). One ``learn_mode.forward(batch)`` is one gradient step on a minibatch whose tensors carry an agent
axis: flat ``[B, A, ...]``, or sequences ``[L, B, A, ...]`` for a recurrent policy (with ``hidden``,
``episode_start`` and ``mask`` per step, as :func:`~conveyor.middleware.gae_estimator` writes them). It reads
``obs``, ``state``, ``action_mask`` and ``agent_mask`` (see :mod:`conveyor.policy.marl_model`), ``action`` (or
``raw_action`` for Gaussian policies), ``logp`` and ``value`` as collected, and ``adv`` / ``return`` per agent.
Every mean runs over the agents present (``agent_mask``) on real steps (``mask``); the loss reads::

    ratio    = exp(log pi(a|o) - logp)                    log pi over the allowed actions only
    pg_loss  = mean(max(-adv * ratio, -adv * clip(ratio, 1 - eps, 1 + eps)))
    v_loss   = 0.5 * mean((V - norm(return))^2)           (or the max with the clipped value's loss)
    loss     = pg_loss - entropy_coef * entropy + value_coef * v_loss

``norm`` is MAPPO's value normalisation (PopArt-free): returns are scaled by the running mean and std of the
returns learned from, the critic predicts scaled values, and the values the policy hands out (``value`` when
collecting, ``collect_mode.value``) are scaled back, so advantage estimators see returns in reward units.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.data.batch import to_host
from conveyor.policy.actor_critic import make_action_dist
from conveyor.policy.base import Policy
from conveyor.policy.learning import LazyOptimizer, LearnResult, fused_adam, masked_mean
from conveyor.policy.marl_model import (MaskedCategoricalDist, TeamActorCritic, TeamSpec, load_team_state,
                                        masked_logits, team_inputs)
from conveyor.policy.normaliser import RunningMeanStd
from conveyor.policy.options import optional_positive, with_defaults
from conveyor.policy.ppo import PPOPolicy, clipped_surrogate
from conveyor.policy.views import ActorCriticCollectMode, ActorCriticLearnMode
from conveyor.policy.weights import Acting
from conveyor.schema import ConfigError, Option

__all__ = ["MAPPOPolicy", "IPPOPolicy", "team_model_schema", "vector_dim"]

_MIN_VALUE_VAR = 1e-2  # MAPPO's ValueNorm floor on the variance of returns: near-constant returns stay bounded


def _vector_check(value: Any) -> str | None:
    ok = value is None or (isinstance(value, int) and value > 0) or \
        (isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], int) and value[0] > 0)
    return None if ok else "must be a positive int (or a one-element list): teams read vector observations"


def vector_dim(model_cfg: Mapping[str, Any], key: str, example: str) -> int:
    """``policy.model.<key>`` as an int (a one-element shape unpacked), or a ConfigError saying how to set it."""
    value = Policy._required(model_cfg, key, example)
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def team_model_schema() -> dict:
    """The ``policy.model`` options every team policy has: the team's size and spaces, and how agents share weights."""
    return {
        "n_agents": Option(None, "Number of agents in the team (set from the env).", type=int, check=optional_positive),
        "obs_shape": Option(None, "Size of each agent's observation vector (set from the env).", type=(int, list),
                            check=_vector_check),
        "state_shape": Option(None, "Size of the env's global state vector (set from the env; the centralized critic "
                                    "and the QMIX mixer read it).", type=(int, list), check=_vector_check),
        "share_parameters": Option(True, "One network for all agents, told apart by a one-hot agent id; False: one "
                                         "network per agent."),
        "agent_id": Option(True, "Append each agent's one-hot id to what a shared network reads (ignored with "
                                 "share_parameters=False)."),
        "activation": Option("relu", "Activation of the hidden layers.", choices=("tanh", "relu")),
    }


class MAPPOPolicy(Policy):
    """Multi-agent PPO (Yu et al. 2022) over a :class:`~conveyor.policy.marl_model.TeamActorCritic`.

    - ``collect_mode.forward(obs)``: ``obs`` maps ``obs`` ``[N, A, O]``, ``state`` ``[N, S]`` and optionally
      ``action_mask`` ``[N, A, n]`` and ``agent_mask`` ``[N, A]``; returns ``action`` ``[N, A]`` (never a masked
      one), ``logp`` and ``value`` ``[N, A]``, ``raw_action`` for Gaussian policies, and ``hidden`` /
      ``next_hidden`` ``[N, A, 2H]`` for recurrent ones (reset per env by ``collect_mode.reset(env_ids)``).
    - ``collect_mode.value(obs, hidden=None)``: values ``[B, A]`` in reward units, 0 for absent agents.
    - ``eval_mode.forward(obs)``: the most likely allowed action, or the Gaussian's mean.
    - ``learn_mode.forward(batch)`` (see the module doc) returns ``losses/policy``, ``losses/value``,
      ``losses/entropy``, ``charts/approx_kl``, ``charts/clip_frac``, ``charts/lr`` and ``charts/grad_norm``;
      ``learn_mode.gather(batch)`` (trainers call it once per round) folds the round's returns into the value
      normaliser.
    """

    multi_agent = True  # compile_config takes team env ids (mpe/..., vmas/...) for it, and only those

    @classmethod
    def config_schema(cls) -> dict:
        """Base options, PPO's learning options (MAPPO paper's defaults for MPE) and the team's model options."""
        ppo = PPOPolicy.config_schema()
        learn_keys = ("epoch_per_collect", "lr_anneal_steps", "lr_anneal_unit", "clip_ratio", "value_clip",
                      "value_coef", "adv_norm", "sequence_length")
        return schema.merge_schemas(super().config_schema(), {
            "gae_lambda": ppo["gae_lambda"],
            "model": {
                **team_model_schema(),
                **{key: ppo["model"][key] for key in ("action_space", "action_low", "action_high", "init_log_std",
                                                      "rnn")},
                "action_shape": ppo["model"]["action_shape"],
                "critic": Option("centralized", "The critic's input: 'centralized' (the env's global state and the "
                                                "agent's id: MAPPO) or 'decentralized' (the agent's own "
                                                "observation: IPPO).", choices=("centralized", "decentralized")),
                "rnn_hidden_size": ppo["model"]["rnn_hidden_size"],
                "value_norm": Option(True, "Learn values of returns scaled by their running mean and std (MAPPO's "
                                           "value normalisation)."),
            },
            "learn": {
                **{key: ppo["learn"][key] for key in learn_keys},
                **with_defaults(ppo["learn"], {"epoch_per_collect": 5, "learning_rate": 5e-4, "entropy_coef": 0.01,
                                               "value_coef": 1.0, "grad_clip": 10.0, "sequence_length": 10}),
            },
            "collect": {"n_sample": ppo["collect"]["n_sample"]},
        })

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """A :class:`TeamActorCritic` as ``model_cfg`` describes it."""
        centralized = model_cfg.critic == "centralized"
        state_dim = vector_dim(model_cfg, "state_shape", "state_shape=54 for simple_spread_v3 (or "
                               "critic='decentralized')") if centralized else None
        return TeamActorCritic(vector_dim(model_cfg, "n_agents", "n_agents=3 for simple_spread_v3"),
                               vector_dim(model_cfg, "obs_shape", "obs_shape=18 for simple_spread_v3"), state_dim,
                               vector_dim(model_cfg, "action_shape", "action_shape=5 for simple_spread_v3"),
                               discrete=model_cfg.action_space == "discrete", centralized=centralized,
                               hidden_sizes=model_cfg.hidden_sizes, activation=model_cfg.activation,
                               share=model_cfg.share_parameters, agent_id=model_cfg.agent_id,
                               rnn_hidden_size=model_cfg.rnn_hidden_size if model_cfg.rnn else None,
                               init_log_std=model_cfg.init_log_std)

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        model_cfg = self.cfg.model
        self.discrete = model_cfg.action_space == "discrete"
        self._collect_mode = ActorCriticCollectMode(self)  # with value(), for advantage estimators
        self._learn_mode = ActorCriticLearnMode(self)  # with gather(), for the value normaliser's statistics
        if self.discrete:
            self.action_dist = MaskedCategoricalDist()
        else:
            try:
                self.action_dist = make_action_dist(model_cfg.action_space, self.model.action_dim,
                                                    model_cfg.action_low, model_cfg.action_high, self.device)
            except ValueError as exc:
                raise ConfigError(f"policy.model.action_low/action_high: {exc}") from None
        self.recurrent = self.model.recurrent
        self.team = TeamSpec(type(self).__name__, **{key: model_cfg[key] for key in (
            "n_agents", "obs_shape", "state_shape", "action_shape", "action_space", "critic")})
        self.register_state("team", self.team)
        self.value_stats: RunningMeanStd | None = None
        if model_cfg.value_norm:
            self.value_stats = RunningMeanStd(())
            self.register_state("value_normaliser", self.value_stats)
        self.optimizer = LazyOptimizer(torch.optim.Adam, self.model, lr=self.cfg.learn.learning_rate, eps=1e-5,
                                       fused=fused_adam(self.device))
        self.register_state("optimizer", self.optimizer)
        self._parameters = list(self.model.parameters())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint, refusing one saved for another team (number of agents, spaces) in one line."""
        load_team_state(self, state_dict, super().load_state_dict)

    def join_data_parallel(self, group: Any) -> None:
        """Refused: advantages are normalised and value statistics kept per learner here, so data-parallel learners
        would drift apart."""
        raise ValueError(f"{type(self).__name__} does not learn data-parallel yet (advantage normalisation and the "
                         "value normaliser are per learner): run one learner (no --learners)")

    # --- value normalisation ---------------------------------------------------------------------
    def _value_scale(self) -> tuple[float, float]:
        """``(mean, std)`` of the returns learned from: the critic's unit (``(0, 1)`` without value_norm)."""
        if self.value_stats is None or self.value_stats.count == 0:
            return 0.0, 1.0
        return float(self.value_stats.mean), float(np.sqrt(max(float(self.value_stats.var), _MIN_VALUE_VAR)))

    def _acting_extras(self) -> Any:
        """The value scale acting denormalises with, fixed with each published version."""
        return self._value_scale() if self.value_stats is not None else None

    def _gather(self, batch: Any) -> None:
        """Fold a round's returns of the agents present on real steps into the value normaliser."""
        if self.value_stats is not None:
            self.value_stats.update(batch["return"][self._loss_mask(batch, batch["return"]) > 0].cpu().numpy())

    @staticmethod
    def _loss_mask(batch: Any, like: torch.Tensor) -> torch.Tensor:
        """1.0 where a step counts ``[..., A]``: an agent present (``agent_mask``) on a real step (``mask``)."""
        mask = torch.ones_like(like)
        team = team_inputs(batch)
        if team.agent_mask is not None:
            mask = mask * team.agent_mask
        if "mask" in batch:
            mask = mask * batch.mask.unsqueeze(-1)
        return mask

    def _values_out(self, acting: Acting, value: torch.Tensor, agent_mask: torch.Tensor | None) -> torch.Tensor:
        """The critic's values in reward units (by the version's scale), 0 for absent agents."""
        if acting.extras is not None:
            mean, std = acting.extras
            value = value * std + mean
        return value if agent_mask is None else value * agent_mask

    # --- acting ----------------------------------------------------------------------------------
    def _initial_state(self, state: torch.Tensor | None, obs: torch.Tensor) -> torch.Tensor:
        shape = (*obs.shape[:-1], self.model.hidden_size)
        return obs.new_zeros(shape) if state is None or tuple(state.shape) != shape else state

    def _reset(self, memory: dict, env_ids: Sequence[int] | None) -> None:
        """Zero the agents' recurrent state in the envs whose episodes ended."""
        memory["hidden"] = PPOPolicy._cleared(memory.get("hidden"), env_ids)

    def _params(self, params: Any, action_mask: torch.Tensor | None) -> Any:
        return masked_logits(params, action_mask) if self.discrete else params

    def _forward_collect(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Sampled allowed actions of every agent, their log-probabilities and values (and the state around the
        step when recurrent)."""
        team = team_inputs(obs)
        kept: dict[str, torch.Tensor] = {}
        hidden = self._initial_state(acting.memory.get("hidden"), team.obs) if self.recurrent else None
        params, value, next_hidden = acting.model(team.obs, team.state, hidden)
        if self.recurrent:
            acting.memory["hidden"] = next_hidden
            kept.update(hidden=hidden, next_hidden=next_hidden)
        action, raw_action, logp = self.action_dist.sample(self._params(params, team.action_mask), self.rng)
        kept.update(action=action, logp=logp, value=self._values_out(acting, value, team.agent_mask))
        if raw_action is not None:
            kept["raw_action"] = raw_action
        return dict(zip(kept, to_host(*kept.values())))

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """The most likely allowed action of every agent, or the Gaussian's mean."""
        team = team_inputs(obs)
        hidden = self._initial_state(acting.memory.get("hidden"), team.obs) if self.recurrent else None
        params, hidden = acting.model.act(team.obs, hidden)
        if self.recurrent:
            acting.memory["hidden"] = hidden
        return self.action_dist.mode(self._params(params, team.action_mask))

    def _value(self, acting: Acting, obs: Any, hidden: torch.Tensor | None = None) -> np.ndarray:
        """The critic's values ``[B, A]`` of ``obs`` (after the recurrent state ``hidden``), in reward units."""
        team = team_inputs(obs)
        if self.recurrent and hidden is None:
            raise ValueError(f"{type(self).__name__}.collect_mode.value: a recurrent policy needs hidden= (the state "
                             "before obs, e.g. the trajectory's next_hidden)")
        value = acting.model.value(team.obs, team.state, None if hidden is None else hidden.float())
        return to_host(self._values_out(acting, value, team.agent_mask))[0]

    # --- learning --------------------------------------------------------------------------------
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One PPO gradient step on a team's minibatch (flat ``[B, A]``, or sequences ``[L, B, A]``)."""
        learn = self.cfg.learn
        team = team_inputs(batch)
        if self.recurrent:
            if "episode_start" not in batch:
                raise ValueError(f"{type(self).__name__}: a recurrent policy learns from sequences [L, B, A] with "
                                 "hidden, episode_start and mask (gae_estimator writes them from trajectories that "
                                 "carry 'hidden')")
            params, new_value = self.model.unroll(team.obs, team.state, batch.hidden[0].float(), batch.episode_start)
        else:
            params, new_value, _ = self.model(team.obs, team.state)
        params = self._params(params, team.action_mask)
        action = batch[self.action_dist.raw_key] if self.action_dist.raw_key else batch.action
        mask = self._loss_mask(batch, new_value)

        new_logp, entropy = self.action_dist.log_prob_entropy(params, action)
        logratio = new_logp - batch.logp
        ratio = logratio.exp()

        adv = batch.adv
        if learn.adv_norm:
            adv_mean = masked_mean(adv, mask)
            adv_std = masked_mean((adv - adv_mean).pow(2), mask).sqrt()
            adv = (adv - adv_mean) / (adv_std + 1e-8)

        pg_loss = clipped_surrogate(ratio, adv, learn.clip_ratio, mask)

        mean, std = self._value_scale()  # the critic learns returns in the normaliser's unit
        target = (batch["return"] - mean) / std
        v_loss_unclipped = (new_value - target).pow(2)
        if learn.value_clip is not None:
            old_value = (batch.value - mean) / std
            v_clipped = old_value + (new_value - old_value).clamp(-learn.value_clip, learn.value_clip)
            v_loss = 0.5 * masked_mean(torch.max(v_loss_unclipped, (v_clipped - target).pow(2)), mask)
        else:
            v_loss = 0.5 * masked_mean(v_loss_unclipped, mask)

        entropy_loss = masked_mean(entropy, mask)
        loss = pg_loss - learn.entropy_coef * entropy_loss + learn.value_coef * v_loss

        with torch.no_grad():
            approx_kl = masked_mean((ratio - 1.0) - logratio, mask)
            clip_frac = masked_mean(((ratio - 1.0).abs() > learn.clip_ratio).float(), mask)
            metrics = torch.stack([pg_loss, v_loss, entropy_loss, approx_kl, clip_frac]).tolist()
        out: dict[str, Any] = dict(zip(("losses/policy", "losses/value", "losses/entropy", "charts/approx_kl",
                                        "charts/clip_frac"), metrics))
        out["charts/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return self._gradient_step(loss, self.optimizer, self._parameters, out)


class IPPOPolicy(MAPPOPolicy):
    """Independent PPO: :class:`MAPPOPolicy` whose critic reads each agent's own observation, not the global state
    (``policy.model.critic='decentralized'``, the default here)."""

    @classmethod
    def config_schema(cls) -> dict:
        """MAPPO's options, with a decentralized critic by default."""
        base = super().config_schema()
        return schema.merge_schemas(base, with_defaults(base, {"model": {"critic": "decentralized"}}))
