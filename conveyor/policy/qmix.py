"""QMIX and VDN: a team's Q-value mixed from per-agent recurrent Q-networks, learned from episode sequences.

Each agent acts on its own Q-values (a GRU :class:`~conveyor.policy.marl_model.AgentNet` over its observation and
its one-hot id, weights shared by default), greedily or eps-greedily over the actions its ``action_mask`` allows.
Learning mixes the Q-values of the actions taken into the team's ``Q_tot``: QMIX (Rashid et al. 2018) with a
mixing network whose weights come from hypernetworks on the env's global state, made non-negative (abs) so
``Q_tot`` rises with every agent's Q (monotonic: each agent's argmax is the team's); VDN (Sunehag et al. 2018)
with their sum. One ``learn_mode.forward(batch)`` is one gradient step on sequences ``[T, B]`` (each starting at an
episode's first step; padding after an episode's end has ``mask`` False) with an agent axis where the team has
one; the loss reads::

    q_tot[t]  = mixer(Q(o[t], h[t-1])[a[t]] * agent_mask[t], state[t])
    a*        = argmax over allowed actions of Q_online(next_obs[t], h[t])         (double Q; Q_target without)
    target[t] = team_reward[t] + gamma * (1 - terminated[t]) * mixer_target(Q_target(next_obs[t], h'[t])[a*]
                                                                             * next_agent_mask[t], next_state[t])
    td_loss   = mean over real steps of (q_tot - target)^2

``h[t]`` is the state after step ``t`` (the next step's Q reads ``next_obs`` from it, so a truncated episode, a
padded sequence and a sequence's last step bootstrap alike) and ``h'`` the target network's own; where the batch
has ``truncated``, the agents bootstrapped are :func:`~conveyor.policy.marl_model.bootstrap_agent_mask`'s (at a
truncated step, every agent that took it, though all leave at an episode's end). The batch holds
``obs``, ``state``, ``action_mask``, ``agent_mask``, ``action`` ``[T, B, A]``, ``reward`` (per agent ``[T, B, A]``,
made the team's by ``learn.team_reward``, or the team's ``[T, B]``), ``terminated`` (or ``done``) ``[T, B]``, the
same four inputs of the next step under ``next_obs``, ``next_state``, ``next_action_mask``, ``next_agent_mask``,
``mask`` ``[T, B]`` (else ``valid``) and optionally ``episode_start`` ``[T, B]`` (else the step after each episode's
end). A collector's time-major chunk ``[T, N]`` whose observations are the team's mapping is such a batch as it is;
a sequence's first step starts from a zero state, so chunks should begin at episode starts (a fixed episode length
``L``: ``n_sample = env_num * L``), as pymarl learns from whole episodes.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.base import Policy
from conveyor.policy.dqn import DQNPolicy
from conveyor.policy.learning import LazyOptimizer, LearnResult, TargetSync, fused_adam, make_target, masked_mean
from conveyor.policy.mappo import team_model_schema, vector_dim
from conveyor.policy.marl_model import (AgentNet, TeamSpec, bootstrap_agent_mask, load_team_state, masked_logits,
                                       team_inputs)
from conveyor.policy.options import replay_buffer_schema, with_defaults
from conveyor.policy.ppo import PPOPolicy
from conveyor.policy.weights import Acting
from conveyor.schema import Option

__all__ = ["QMIXPolicy", "QMixer", "VDNMixer", "QMIXModel"]


class QMixer(nn.Module):
    """``Q_tot(q [..., A], state [..., S]) -> [...]``: one hidden layer of ``embed_dim`` (ELU) whose weights are
    the absolute values of hypernetworks' outputs on the state, and a state-dependent bias ``V(state)``; with
    non-negative weights and a monotonic activation, ``dQ_tot / dQ_a >= 0`` for every agent ``a``."""

    def __init__(self, n_agents: int, state_dim: int, embed_dim: int = 32, hypernet_hidden: int = 64) -> None:
        super().__init__()
        self.n_agents, self.embed_dim = n_agents, embed_dim
        self.hyper_w1 = nn.Sequential(nn.Linear(state_dim, hypernet_hidden), nn.ReLU(),
                                      nn.Linear(hypernet_hidden, n_agents * embed_dim))
        self.hyper_b1 = nn.Linear(state_dim, embed_dim)
        self.hyper_w2 = nn.Sequential(nn.Linear(state_dim, hypernet_hidden), nn.ReLU(),
                                      nn.Linear(hypernet_hidden, embed_dim))
        self.value = nn.Sequential(nn.Linear(state_dim, embed_dim), nn.ReLU(), nn.Linear(embed_dim, 1))

    def forward(self, q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        w1 = self.hyper_w1(state).abs().reshape(*state.shape[:-1], self.n_agents, self.embed_dim)
        hidden = F.elu((q.unsqueeze(-2) @ w1).squeeze(-2) + self.hyper_b1(state))
        w2 = self.hyper_w2(state).abs()
        return (hidden * w2).sum(-1) + self.value(state).squeeze(-1)


class VDNMixer(nn.Module):
    """``Q_tot = sum_a Q_a``: value decomposition without the state."""

    def forward(self, q: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        return q.sum(-1)


class QMIXModel(nn.Module):
    """The agents' Q-network (:class:`AgentNet`, ``agents``) and the ``mixer``, one module so one target copy and
    one checkpoint entry hold both."""

    def __init__(self, agents: AgentNet, mixer: nn.Module) -> None:
        super().__init__()
        self.agents, self.mixer = agents, mixer

    def forward(self, obs: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Every agent's Q-values ``[..., A, n_actions]`` and its state after the step."""
        return self.agents(obs, hidden)


def _masked_eps_greedy(q: torch.Tensor, action_mask: torch.Tensor | None, eps: float,
                       rng: np.random.Generator) -> np.ndarray:
    """Each agent's best allowed action, replaced with probability ``eps`` (one draw per agent) by one drawn
    uniformly among its allowed actions (one draw per action: the largest allowed draw wins)."""
    q = masked_logits(q, action_mask)
    greedy = q.argmax(-1).cpu().numpy()
    explore = rng.random(greedy.shape) < eps
    draws = rng.random(tuple(q.shape))
    if action_mask is not None:
        allowed = (action_mask | ~action_mask.any(-1, keepdim=True)).cpu().numpy()
        draws = np.where(allowed, draws, -1.0)
    return np.where(explore, draws.argmax(-1), greedy)


def _episode_start(batch: ttorch.Tensor) -> torch.Tensor | None:
    """Where the agents' state starts afresh ``[T, B]``: the batch's ``episode_start``, else each step after one that
    ended an episode (``terminated`` / ``truncated``, or ``done``) or did not count (``valid`` False)."""
    if "episode_start" in batch:
        return batch.episode_start
    ended = batch.done.bool() if "done" in batch else batch.terminated.bool()
    if "truncated" in batch:
        ended = ended | batch.truncated.bool()
    if "valid" in batch:
        ended = ended | ~batch.valid.bool()
    start = torch.zeros_like(ended)
    start[1:] = ended[:-1]
    return start


class QMIXPolicy(Policy):
    """QMIX (``learn.mixer='qmix'``) or VDN (``'vdn'``) for a team with discrete actions (see the module doc).

    - ``collect_mode.forward(obs, eps=...)``: ``obs`` maps ``obs`` ``[N, A, O]`` (and ``action_mask``,
      ``agent_mask``); returns ``action`` ``[N, A]``, eps-greedy among allowed actions; each agent's GRU state
      is kept per env and reset by ``collect_mode.reset(env_ids)``.
    - ``eval_mode.forward(obs)``: greedy allowed actions.
    - ``learn_mode.forward(batch)``: one step on sequences; ``losses/td``, ``charts/q_tot_mean``,
      ``charts/target_mean`` and, when clipping, ``charts/grad_norm``. The target network follows the online
      one every ``learn.target_update_freq`` steps, or softly by ``learn.target_theta``.
    """

    multi_agent = True  # compile_config takes team env ids (mpe/..., vmas/...) for it, and only those

    @classmethod
    def config_schema(cls) -> dict:
        """Base options, DQN's target-network and exploration options, the team's model options (pymarl's QMIX
        defaults)."""
        dqn, ppo = DQNPolicy.config_schema(), PPOPolicy.config_schema()
        return schema.merge_schemas(super().config_schema(), {
            "model": {
                **team_model_schema(),
                "action_shape": dqn["model"]["action_shape"],
                "rnn": with_defaults(ppo["model"], {"rnn": "gru"})["rnn"],
                "rnn_hidden_size": ppo["model"]["rnn_hidden_size"],
                "hidden_sizes": with_defaults(super().config_schema()["model"], {"hidden_sizes": [64]})["hidden_sizes"],
                "mixer": Option("qmix", "How agents' Q-values make the team's: 'qmix' (a monotonic mixing network from "
                                        "hypernetworks on the state) or 'vdn' (their sum).", choices=("qmix", "vdn")),
                "mixing_embed_dim": Option(32, "Width of the QMIX mixing network's hidden layer.",
                                           check=schema.positive),
                "hypernet_hidden": Option(64, "Width of the hidden layer of the hypernetworks that make the mixing "
                                              "weights.", check=schema.positive),
            },
            "learn": {
                **{key: dqn["learn"][key] for key in ("double", "target_theta")},
                **with_defaults(dqn["learn"], {"target_update_freq": 200}),
                **with_defaults(super().config_schema()["learn"], {"batch_size": 32, "learning_rate": 5e-4,
                                                                   "grad_clip": 10.0}),
                "team_reward": Option("mean", "The team's reward from per-agent rewards: 'mean' (over the agents "
                                              "present; a shared reward as it is) or 'sum'.", choices=("mean", "sum")),
            },
            "other": {
                "eps": {**dqn["other"]["eps"], **with_defaults(dqn["other"]["eps"], {"kind": "linear", "decay": 50_000})},
                "replay_buffer": replay_buffer_schema(5000),
            },
        })

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """A :class:`QMIXModel` as ``model_cfg`` describes it."""
        n_agents = vector_dim(model_cfg, "n_agents", "n_agents=3 for simple_spread_v3")
        agents = AgentNet(n_agents, vector_dim(model_cfg, "obs_shape", "obs_shape=18 for simple_spread_v3"),
                          vector_dim(model_cfg, "action_shape", "action_shape=5 for simple_spread_v3"),
                          hidden_sizes=model_cfg.hidden_sizes, activation=model_cfg.activation,
                          share=model_cfg.share_parameters, agent_id=model_cfg.agent_id,
                          rnn_hidden_size=model_cfg.rnn_hidden_size if model_cfg.rnn else None)
        if model_cfg.mixer == "vdn":
            return QMIXModel(agents, VDNMixer())
        state_dim = vector_dim(model_cfg, "state_shape", "state_shape=54 for simple_spread_v3 (or mixer='vdn')")
        return QMIXModel(agents, QMixer(n_agents, state_dim, model_cfg.mixing_embed_dim, model_cfg.hypernet_hidden))

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        self.team = TeamSpec(type(self).__name__, **{key: self.cfg.model[key] for key in (
            "n_agents", "obs_shape", "state_shape", "action_shape", "mixer")})
        self.register_state("team", self.team)
        self.target_model = make_target(self.model)
        self._target_sync = TargetSync(self.target_model, self.model)
        self.register_state("target_model", self.target_model)
        self.optimizer = LazyOptimizer(torch.optim.Adam, self.model, lr=self.cfg.learn.learning_rate,
                                       fused=fused_adam(self.device))
        self.register_state("optimizer", self.optimizer)
        self._parameters = list(self.model.parameters())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint, refusing one saved for another team (number of agents, spaces) in one line."""
        load_team_state(self, state_dict, super().load_state_dict)

    # --- acting ----------------------------------------------------------------------------------
    def _reset(self, memory: dict, env_ids: Sequence[int] | None) -> None:
        """Zero the agents' recurrent state in the envs whose episodes ended."""
        memory["hidden"] = PPOPolicy._cleared(memory.get("hidden"), env_ids)

    def _q(self, acting: Acting, obs: Any) -> tuple[torch.Tensor, Any]:
        """Every agent's Q-values ``[N, A, n]`` after its state in ``acting.memory`` (which moves on a step)."""
        team = team_inputs(obs)
        hidden = acting.memory.get("hidden")
        if hidden is not None and hidden.shape[:-1] != team.obs.shape[:-1]:
            hidden = None
        q, acting.memory["hidden"] = acting.model(team.obs, hidden)
        return q, team

    def _forward_collect(self, acting: Acting, obs: Any, *, eps: float) -> dict[str, Any]:
        """Eps-greedy allowed actions ``[N, A]``: each agent explores on its own draw."""
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"QMIXPolicy.collect_mode.forward: eps must be in [0, 1], got {eps!r}")
        q, team = self._q(acting, obs)
        return {"action": _masked_eps_greedy(q, team.action_mask, eps, self.rng)}

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """Greedy allowed actions ``[N, A]``."""
        q, team = self._q(acting, obs)
        return masked_logits(q, team.action_mask).argmax(-1)

    # --- learning --------------------------------------------------------------------------------
    def _team_reward(self, reward: torch.Tensor, alive: torch.Tensor, steps: torch.Size) -> torch.Tensor:
        """The team's reward ``[T, B]``: as given, or made from per-agent rewards ``[T, B, A]``."""
        if reward.shape == steps:
            return reward
        total = (reward * alive).sum(-1)
        return total if self.cfg.learn.team_reward == "sum" else total / alive.sum(-1).clamp(min=1.0)

    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One QMIX / VDN gradient step on a batch of sequences ``[T, B]``."""
        team, nxt = team_inputs(batch), team_inputs(batch, "next_")
        start = _episode_start(batch)
        action = batch.action.long()
        alive = torch.ones(action.shape, device=action.device) if team.agent_mask is None else team.agent_mask.float()
        next_alive = torch.ones_like(alive) if nxt.agent_mask is None else nxt.agent_mask.float()
        if "truncated" in batch and nxt.agent_mask is not None:
            next_alive = bootstrap_agent_mask(alive, next_alive, batch.truncated).float()
        terminated = (batch.terminated if "terminated" in batch else batch.done).float()
        mask = batch.mask.float() if "mask" in batch else batch.valid.float() if "valid" in batch else None

        q_all, hidden = self.model.agents.unroll(team.obs, None, start)
        q = q_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        q_tot = self.model.mixer(q * alive, team.state)

        with torch.no_grad():
            _, target_hidden = self.target_model.agents.unroll(team.obs, None, start)
            next_q_target = self.target_model.agents(nxt.obs, target_hidden)[0]
            next_q_select = self.model.agents(nxt.obs, hidden)[0] if self.cfg.learn.double else next_q_target
            next_action = masked_logits(next_q_select, nxt.action_mask).argmax(-1, keepdim=True)
            next_q = next_q_target.gather(-1, next_action).squeeze(-1)
            next_q_tot = self.target_model.mixer(next_q * next_alive, nxt.state)
            reward = self._team_reward(batch.reward.float(), alive, q_tot.shape)
            target = reward + self.cfg.discount_factor * (1.0 - terminated) * next_q_tot

        td_loss = masked_mean((q_tot - target).pow(2), mask)

        out: dict[str, Any] = {"losses/td": td_loss.item(),
                               "charts/q_tot_mean": masked_mean(q_tot.detach(), mask).item(),
                               "charts/target_mean": masked_mean(target, mask).item()}
        result = self._gradient_step(td_loss, self.optimizer, self._parameters, out)
        self._target_sync.after_step(self.train_iter, self.cfg.learn.target_theta, self.cfg.learn.target_update_freq)
        return result
