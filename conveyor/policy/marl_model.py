"""Networks of a team of agents, and what the team policies share: their inputs, masked actions, the team's spec.

Every tensor of a team carries an agent axis before its features: observations ``[..., N_agent, obs_dim]``, the
env's global state ``[..., state_dim]`` (one per env), action masks ``[..., N_agent, n_actions]`` (bool, True where
an action is allowed) and the agent mask ``[..., N_agent]`` (bool, False once an agent has left). What a policy
acts on (``collect_mode.forward(obs)``) and learns from (``learn_mode.forward(batch)``) holds these under the
keys ``obs``, ``state``, ``action_mask`` and ``agent_mask`` (:func:`team_inputs` reads them from either). Every
agent leaves at an episode's end, a truncated one's too: :func:`bootstrap_agent_mask` says which agents a step
bootstraps from.

:class:`AgentNet` is one network per agent: by default one set of weights shared by all agents, told apart by a
one-hot agent id appended to their input (parameter sharing); with ``share=False`` one set per agent. Optionally a
GRU cell carries each agent's state from step to step, as in MAPPO (Yu et al. 2022) and QMIX's agent networks.
:class:`TeamActorCritic` is MAPPO's and IPPO's pair: an actor over each agent's observation, and a critic over
the global state (centralized, MAPPO) or over the agent's own observation (decentralized, IPPO).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from conveyor.policy.actor_critic import CategoricalDist, Params, _orthogonal
from conveyor.policy.model import MLP
from conveyor.schema import ConfigError

__all__ = ["TeamInputs", "team_inputs", "bootstrap_agent_mask", "agent_ids", "AgentNet", "TeamActorCritic",
           "MaskedCategoricalDist", "TeamSpec", "MASKED_LOGIT", "masked_logits", "load_team_state"]

MASKED_LOGIT = -1e9
"""The logit of a masked action: its probability is exactly 0 in float32, and its entropy term 0 (not NaN)."""


class TeamInputs(NamedTuple):
    """What a team policy reads: ``obs [..., A, O]``, ``state [..., S]`` or None, ``action_mask [..., A, n]`` or
    None, ``agent_mask [..., A]`` or None."""

    obs: torch.Tensor
    state: torch.Tensor | None
    action_mask: torch.Tensor | None
    agent_mask: torch.Tensor | None


def team_inputs(tree: Any, prefix: str = "") -> TeamInputs:
    """The team's inputs under ``prefix + key`` in ``tree`` (a batch with them at its top, or an observation
    mapping of the env manager; a batch whose ``obs`` is itself such a mapping is read there)."""
    obs = tree[prefix + "obs"]
    if not isinstance(obs, torch.Tensor):  # the env's observation mapping, stored as the batch's obs
        return team_inputs(obs)

    def get(key: str) -> torch.Tensor | None:
        return tree[prefix + key] if prefix + key in tree else None

    mask, alive = get("action_mask"), get("agent_mask")
    return TeamInputs(obs.float(), None if get("state") is None else get("state").float(),
                      None if mask is None else mask.bool(), None if alive is None else alive.bool())


def bootstrap_agent_mask(agent_mask: torch.Tensor, next_agent_mask: torch.Tensor,
                         truncated: torch.Tensor) -> torch.Tensor:
    """The agents ``[..., A]`` whose value of the next observation a step bootstraps from: where the episode was
    ``truncated`` (``[...]``) those that took the step (``agent_mask``), as all leave though they were cut short;
    elsewhere those still in ``next_agent_mask`` (one that left, or a terminated episode's, is worth 0)."""
    cut = truncated.bool().reshape(*truncated.shape, *([1] * (agent_mask.ndim - truncated.ndim)))
    return (agent_mask.bool() & cut) | (next_agent_mask.bool() & ~cut)


def agent_ids(n_agents: int, lead: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """One-hot agent ids ``[*lead, n_agents, n_agents]`` (row ``i`` is agent ``i``'s)."""
    return torch.eye(n_agents, device=device).expand(*lead, n_agents, n_agents)


class _Core(nn.Module):
    """One network: an MLP, a GRU cell over its features when recurrent, and a linear head."""

    def __init__(self, in_dim: int, out_dim: int, hidden_sizes: Sequence[int], activation: str,
                 rnn_hidden_size: int | None, head_gain: float) -> None:
        super().__init__()
        self.encoder = MLP(in_dim, hidden_sizes, activation=activation, orthogonal_gain=math.sqrt(2.0))
        dim = self.encoder.output_dim
        self.rnn = nn.GRUCell(dim, rnn_hidden_size) if rnn_hidden_size else None
        self.head = _orthogonal(nn.Linear(rnn_hidden_size or dim, out_dim), head_gain)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        features = self.encoder(x)
        if self.rnn is not None:
            lead = features.shape[:-1]
            hidden = self.rnn(features.reshape(-1, features.shape[-1]),
                              hidden.reshape(-1, hidden.shape[-1])).reshape(*lead, -1)
            features = hidden
        return self.head(features), hidden


class AgentNet(nn.Module):
    """Outputs ``[..., A, out_dim]`` from inputs ``[..., A, in_dim]``: one shared core fed the agent's one-hot id
    too (``share``, ``agent_id``), or one core per agent (``share=False``: each knows its agent, no id needed).
    With ``rnn_hidden_size`` each agent carries a GRU state ``[..., A, H]``."""

    def __init__(self, n_agents: int, in_dim: int, out_dim: int, *, hidden_sizes: Sequence[int] = (64, 64),
                 activation: str = "relu", share: bool = True, agent_id: bool = True,
                 rnn_hidden_size: int | None = None, head_gain: float = 1.0) -> None:
        super().__init__()
        self.n_agents = n_agents
        self.agent_id = agent_id and share
        width = in_dim + (n_agents if self.agent_id else 0)
        self.cores = nn.ModuleList(_Core(width, out_dim, hidden_sizes, activation, rnn_hidden_size, head_gain)
                                   for _ in range(1 if share else n_agents))
        self.hidden_size = rnn_hidden_size

    @property
    def recurrent(self) -> bool:
        """Whether each agent carries a GRU state."""
        return self.hidden_size is not None

    def forward(self, x: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: ``(outputs [..., A, out], the state after it [..., A, H] or None)``; ``hidden`` is the state
        before it (zeros when None)."""
        if x.shape[-2] != self.n_agents:
            raise ValueError(f"AgentNet: expected {self.n_agents} agents on dim -2, got input {tuple(x.shape)}")
        if self.agent_id:
            x = torch.cat([x, agent_ids(self.n_agents, x.shape[:-2], x.device)], -1)
        if self.recurrent and hidden is None:
            hidden = x.new_zeros(*x.shape[:-1], self.hidden_size)
        if len(self.cores) == 1:
            return self.cores[0](x, hidden)
        outs = [core(x[..., i, :], None if hidden is None else hidden[..., i, :]) for i, core in enumerate(self.cores)]
        out = torch.stack([o for o, _ in outs], -2)
        return out, (torch.stack([h for _, h in outs], -2) if self.recurrent else None)

    def unroll(self, x: torch.Tensor, hidden: torch.Tensor | None,
               episode_start: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequences ``x [L, B, A, in]`` from the state ``hidden [B, A, H]`` before their first step (zeros when
        None), the state zeroed before every step where ``episode_start [L, B]``: ``(outputs [L, B, A, out],
        the state after each step [L, B, A, H] or None)``."""
        if not self.recurrent:
            return self.forward(x)[0], None
        h = x.new_zeros(*x.shape[1:-1], self.hidden_size) if hidden is None else hidden
        keep = None if episode_start is None else (~episode_start.bool()).to(x.dtype)[..., None, None]
        outs, states = [], []
        for t in range(x.shape[0]):
            if keep is not None:
                h = h * keep[t]
            out, h = self.forward(x[t], h)
            outs.append(out)
            states.append(h)
        return torch.stack(outs), torch.stack(states)


class TeamActorCritic(nn.Module):
    """MAPPO's / IPPO's networks: an actor :class:`AgentNet` over each agent's observation (``action_dim`` logits,
    or a Gaussian's mean with a learned log-std per dim) and a critic :class:`AgentNet` whose input is the env's
    global state for every agent (``centralized``: V(state, agent id)) or the agent's own observation (IPPO).

    When recurrent, the state kept per agent is the actor's and the critic's GRU states side by side
    (``[..., A, 2 * rnn_hidden_size]``, :attr:`hidden_size`), so a collector stores and resets one tensor."""

    def __init__(self, n_agents: int, obs_dim: int, state_dim: int | None, action_dim: int, *, discrete: bool = True,
                 centralized: bool = True, hidden_sizes: Sequence[int] = (64, 64), activation: str = "relu",
                 share: bool = True, agent_id: bool = True, rnn_hidden_size: int | None = None,
                 init_log_std: float = 0.0) -> None:
        super().__init__()
        if centralized and state_dim is None:
            raise ValueError("a centralized critic needs the global state's size (state_dim)")
        self.n_agents, self.discrete, self.centralized, self.action_dim = n_agents, discrete, centralized, action_dim
        common = dict(hidden_sizes=hidden_sizes, activation=activation, share=share, agent_id=agent_id,
                      rnn_hidden_size=rnn_hidden_size)
        self.actor = AgentNet(n_agents, obs_dim, action_dim, head_gain=0.01, **common)
        self.critic = AgentNet(n_agents, state_dim if centralized else obs_dim, 1, head_gain=1.0, **common)
        if not discrete:
            self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))
        self.rnn_hidden_size = rnn_hidden_size

    @property
    def recurrent(self) -> bool:
        """Whether actor and critic carry GRU states."""
        return self.rnn_hidden_size is not None

    @property
    def hidden_size(self) -> int | None:
        """Width of the state kept per agent: the actor's and the critic's GRU states (None: feed-forward)."""
        return None if self.rnn_hidden_size is None else 2 * self.rnn_hidden_size

    def critic_input(self, obs: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """What the critic reads for each agent ``[..., A, D]``: the global state (centralized) or the agent's obs."""
        if not self.centralized:
            return obs
        if state is None:
            raise ValueError("a centralized critic needs the global 'state' next to 'obs'")
        return state.unsqueeze(-2).expand(*state.shape[:-1], self.n_agents, state.shape[-1])

    def _params(self, out: torch.Tensor) -> Params:
        return out if self.discrete else (out, self.log_std.expand_as(out))

    def _split(self, hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if hidden is None or not self.recurrent:
            return None, None
        return hidden[..., :self.rnn_hidden_size], hidden[..., self.rnn_hidden_size:]

    def forward(self, obs: torch.Tensor, state: torch.Tensor | None, hidden: torch.Tensor | None = None
                ) -> tuple[Params, torch.Tensor, torch.Tensor | None]:
        """One step for ``[..., A]`` agents: ``(actor params, values [..., A], state after it or None)``."""
        actor_h, critic_h = self._split(hidden)
        out, actor_h = self.actor(obs, actor_h)
        value, critic_h = self.critic(self.critic_input(obs, state), critic_h)
        return self._params(out), value.squeeze(-1), (torch.cat([actor_h, critic_h], -1) if self.recurrent else None)

    def act(self, obs: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[Params, torch.Tensor | None]:
        """The actor alone (acting deterministically needs no critic): ``(params, state after it or None)``; the
        critic's half of a recurrent state is kept as it was."""
        actor_h, critic_h = self._split(hidden)
        out, actor_h = self.actor(obs, actor_h)
        return self._params(out), (torch.cat([actor_h, critic_h], -1) if self.recurrent else None)

    def value(self, obs: torch.Tensor, state: torch.Tensor | None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The critic's values ``[..., A]`` (after the state ``hidden`` when recurrent)."""
        return self.critic(self.critic_input(obs, state), self._split(hidden)[1])[0].squeeze(-1)

    def unroll(self, obs: torch.Tensor, state: torch.Tensor | None, hidden: torch.Tensor | None,
               episode_start: torch.Tensor | None) -> tuple[Params, torch.Tensor]:
        """Sequences ``[L, B, A]`` replayed from the state ``hidden [B, A, 2H]`` before them (see
        :meth:`AgentNet.unroll`); feed-forward networks take any leading dims. ``(params, values)``."""
        if not self.recurrent:
            params, value, _ = self.forward(obs, state)
            return params, value
        actor_h, critic_h = self._split(hidden)
        out, _ = self.actor.unroll(obs, actor_h, episode_start)
        value, _ = self.critic.unroll(self.critic_input(obs, state), critic_h, episode_start)
        return self._params(out), value.squeeze(-1)


def masked_logits(logits: torch.Tensor, action_mask: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the disallowed actions at :data:`MASKED_LOGIT`; a row that allows none (an agent that has
    left) is left as it is, so it stays a distribution."""
    if action_mask is None:
        return logits
    allowed = action_mask | ~action_mask.any(-1, keepdim=True)
    return logits.masked_fill(~allowed, MASKED_LOGIT)


class MaskedCategoricalDist(CategoricalDist):
    """Discrete actions from logits already masked by :func:`masked_logits`. Sampling takes the argmax of the logits
    plus Gumbel noise (one uniform draw per action, from the policy's ``rng``), so a masked action, some 1e9 below
    every allowed one, is never drawn, whatever the draw."""

    def sample(self, params: Params, rng: np.random.Generator) -> tuple[torch.Tensor, None, torch.Tensor]:
        log_probs = torch.log_softmax(params, -1)
        u = rng.uniform(1e-12, 1.0, tuple(params.shape)).astype(np.float32)
        gumbel = -torch.log(-torch.log(torch.from_numpy(u).to(params.device)))
        action = (log_probs + gumbel).argmax(-1)
        return action, None, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)


class TeamSpec:
    """The team a policy was built for (number of agents, spaces), saved in its checkpoints: loading one saved for
    another team is refused with one line saying what changed and how to fix it (issue 32, part 6)."""

    def __init__(self, owner: str, **spec: Any) -> None:
        self.owner, self.spec = owner, {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.items()}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.spec)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.check(state_dict)

    def check(self, saved: Mapping[str, Any] | None) -> None:
        """Raise a :class:`ConfigError` where ``saved`` (a checkpoint's team) differs from this policy's."""
        if saved is None:
            raise ConfigError(f"{self.owner}: the checkpoint holds no team spec (number of agents, spaces): it was "
                              f"saved by a single-agent policy; resume it with that policy, or start a new run")
        changed = [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in self.spec.items()
                   if saved.get(key) != value]
        if changed:
            keys = ", ".join(f"policy.model.{key}" for key in self.spec if saved.get(key) != self.spec[key])
            raise ConfigError(f"{self.owner}: the checkpoint was saved for another team ({'; '.join(changed)}): "
                              f"resume on the env it was trained on (same agents and spaces, {keys}), or start a "
                              f"new run instead of resuming")


def load_team_state(policy: Any, state_dict: Mapping[str, Any], load: Callable[[Mapping[str, Any]], None]) -> None:
    """Check ``state_dict``'s team against ``policy.team`` before ``load`` restores anything (a network of another
    shape would otherwise fail first, with a size mismatch that names no cause)."""
    policy.team.check(state_dict.get("team"))
    load(state_dict)
