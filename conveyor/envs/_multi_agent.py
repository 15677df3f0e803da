"""A team of agents as one Gymnasium env: :class:`MultiAgentEnv` over any PettingZoo Parallel API env.

The env managers step Gymnasium envs, so a multi-agent env enters them as one env whose values carry a fixed
agent axis: the agents of ``possible_agents`` in that order, ``N_agent = len(possible_agents)`` for the whole run.

- Observation: a ``Dict`` of ``obs`` float32 ``[N_agent, obs_dim]`` (each agent's observation flattened and
  zero-padded at the end to the largest agent's ``obs_dim``), ``state`` float32 ``[state_dim]`` (the env's
  ``state()`` where it has a ``state_space``, else the agents' flattened observations concatenated in agent
  order, zeros for agents that have left), ``agent_mask`` bool ``[N_agent]`` (False for an agent not in the
  episode any more) and, for discrete actions only, ``action_mask`` bool ``[N_agent, n_actions]`` (from the
  agent's observation dict ``"action_mask"`` or its info's, else True for its actions; False past an
  agent's own number of actions, and for an agent that has left).
- Action: ``MultiDiscrete`` with each agent's number of actions, or a ``Box [N_agent, act_dim]`` whose rows
  are each agent's action zero-padded to the largest ``act_dim`` (the padding's bounds are 0 and it is
  dropped). Actions of agents that have left are ignored.
- Reward: float32 ``[N_agent]`` (0 for agents not in the episode); the team reward is its sum, and the
  managers' ``info["episode"]`` holds the team return ``"r"`` (sum over agents) and ``"agent_r"`` per agent.
- The agents in ``agents`` after ``reset`` take part in the episode (others are masked until the next one).
  An agent leaves when the env drops it from ``agents`` or flags it terminated or truncated; the step it
  leaves, its observation is its last one and its mask False, afterwards its observation is zeros. The
  episode ends when every agent has left (or ``agents`` is empty): ``truncated`` if an agent that was still
  in it was truncated on that step, else ``terminated``.

Pickling a :class:`MultiAgentEnv` keeps the wrapped env's whole state (checkpoints resume exactly): PettingZoo
envs such as MPE's pickle through Gymnasium's ``EzPickle``, which only rebuilds a fresh env from its constructor
arguments. Here such an object is rebuilt that way and then given back every attribute that pickles (what does
not, such as MPE's pygame surface and font, is the fresh object's); cloudpickle pickles VMAS's scenario classes,
which no module defines.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.utils import EzPickle

__all__ = ["MultiAgentEnv", "OBS_KEYS"]

OBS_KEYS = ("obs", "state", "agent_mask", "action_mask")
"""The keys of a :class:`MultiAgentEnv` observation (``action_mask`` only for discrete actions)."""


def _agent_obs_space(space: spaces.Space, agent: Any) -> spaces.Box:
    """An agent's observation Box: the space itself, or the ``"observation"`` part of a dict with an action mask."""
    if isinstance(space, spaces.Dict) and "observation" in space.spaces:
        space = space["observation"]
    if not isinstance(space, spaces.Box):
        raise TypeError(f"agent {agent!r} has observation space {space}: the multi-agent adapter needs a Box (or a "
                        f"Dict with a Box 'observation' and an 'action_mask'); wrap the env to flatten it")
    return space


def _rebuilt(cls: type, args: tuple, kwargs: dict) -> Any:
    return cls(*args, **kwargs)


def _set_attributes(obj: Any, attributes: dict) -> None:
    obj.__dict__.update(attributes)


class _StatePickler(cloudpickle.CloudPickler):
    """Pickles an ``EzPickle`` object as its constructor call followed by its attributes that pickle (see the
    module docstring)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, EzPickle) and not isinstance(obj, type):
            kept = {}
            for key, value in vars(obj).items():
                if key.startswith("_ezpickle_"):
                    continue
                try:
                    _dumps_state(value)
                except Exception:
                    continue
                kept[key] = value
            return (_rebuilt, (type(obj), obj._ezpickle_args, obj._ezpickle_kwargs), kept, None, None,
                    _set_attributes)
        return super().reducer_override(obj)


def _dumps_state(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _StatePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


class MultiAgentEnv(gym.Env):
    """A PettingZoo Parallel API env as one Gymnasium env with a fixed agent axis (see the module docstring).

    ``reward_shape`` ``(N_agent,)`` tells the env managers to keep rewards and returns per agent.
    """

    def __init__(self, parallel_env: Any, env_id: str | None = None) -> None:
        self.parallel_env = parallel_env
        self.agent_names = list(parallel_env.possible_agents)
        if not self.agent_names:
            raise ValueError(f"{env_id or type(parallel_env).__name__} has no possible_agents: a multi-agent env "
                             f"must name its agents before reset()")
        self.env_id = env_id or type(parallel_env).__name__
        self.metadata = dict(getattr(parallel_env, "metadata", None) or {})
        self.render_mode = getattr(parallel_env, "render_mode", None)
        boxes = [_agent_obs_space(parallel_env.observation_space(a), a) for a in self.agent_names]
        self._obs_dims = [int(np.prod(box.shape)) for box in boxes]
        self._act_spaces = [parallel_env.action_space(a) for a in self.agent_names]
        n, obs_dim = len(self.agent_names), max(self._obs_dims)
        self._has_state = getattr(parallel_env, "state_space", None) is not None
        state_dim = int(np.prod(parallel_env.state_space.shape)) if self._has_state else sum(self._obs_dims)
        obs_spaces: dict[str, spaces.Space] = {
            "obs": spaces.Box(-np.inf, np.inf, (n, obs_dim), np.float32),
            "state": spaces.Box(-np.inf, np.inf, (state_dim,), np.float32),
            "agent_mask": spaces.Box(0, 1, (n,), np.bool_),
        }
        self.discrete = all(isinstance(s, spaces.Discrete) for s in self._act_spaces)
        if self.discrete:
            self._n_actions = [int(s.n) for s in self._act_spaces]
            obs_spaces["action_mask"] = spaces.Box(0, 1, (n, max(self._n_actions)), np.bool_)
            self.action_space = spaces.MultiDiscrete(self._n_actions)
            self._starts = [int(s.start) for s in self._act_spaces]
        elif all(isinstance(s, spaces.Box) and len(s.shape) == 1 for s in self._act_spaces):
            self._act_dims = [int(s.shape[0]) for s in self._act_spaces]
            low = np.zeros((n, max(self._act_dims)), np.float32)
            high = np.zeros_like(low)
            for i, s in enumerate(self._act_spaces):
                low[i, :s.shape[0]], high[i, :s.shape[0]] = s.low, s.high
            self.action_space = spaces.Box(low, high, dtype=np.float32)
        else:
            raise TypeError(f"{self.env_id} has action spaces {self._act_spaces}: the multi-agent adapter needs every "
                            f"agent's to be Discrete, or every agent's a 1-D Box")
        self.observation_space = spaces.Dict(obs_spaces)
        self.reward_shape = (n,)
        self._alive = np.zeros(n, np.bool_)
        self._masks = np.ones(obs_spaces["action_mask"].shape, np.bool_) if self.discrete else None

    @property
    def agent_num(self) -> int:
        """``N_agent``: the length of the agent axis."""
        return len(self.agent_names)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        """Reset the wrapped env; every agent it lists in ``agents`` is in the episode."""
        super().reset(seed=seed)
        obs, infos = self.parallel_env.reset(seed=seed, options=options)
        present = set(self.parallel_env.agents)
        self._alive = np.array([a in present for a in self.agent_names], np.bool_)
        return self._observe(obs, infos), self._info(infos)

    def step(self, action: Any) -> tuple[dict, np.ndarray, bool, bool, dict]:
        """Step the agents still in the episode with their rows of ``action``; see the module docstring."""
        actions = {name: self._agent_action(action, i) for i, name in enumerate(self.agent_names) if self._alive[i]}
        obs, rewards, terms, truncs, infos = self.parallel_env.step(actions)
        reward = np.array([rewards.get(a, 0.0) if self._alive[i] else 0.0 for i, a in enumerate(self.agent_names)],
                          np.float32)
        present = set(self.parallel_env.agents)
        was_alive = self._alive
        self._alive = np.array([alive and a in present and not terms.get(a, False) and not truncs.get(a, False)
                                for alive, a in zip(was_alive, self.agent_names)], np.bool_)
        ended = not self._alive.any()
        truncated = ended and any(truncs.get(a, False) for a, alive in zip(self.agent_names, was_alive) if alive)
        return self._observe(obs, infos, was_alive), reward, ended and not truncated, truncated, self._info(infos)

    def _agent_action(self, action: Any, i: int) -> Any:
        if self.discrete:
            return int(action[i]) + self._starts[i]
        return np.asarray(action[i][:self._act_dims[i]], np.float32)

    def _observe(self, obs: dict, infos: dict, shown: np.ndarray | None = None) -> dict:
        """The batched observation; ``shown`` marks the agents whose observation is given (default: alive ones)."""
        shown = self._alive if shown is None else shown
        out = np.zeros(self.observation_space["obs"].shape, np.float32)
        parts = []
        masks = self._masks.copy() if self._masks is not None else None
        for i, name in enumerate(self.agent_names):
            agent_obs = obs.get(name) if shown[i] else None
            mask = None
            if isinstance(agent_obs, dict):
                mask = agent_obs.get("action_mask")
                agent_obs = agent_obs["observation"]
            if mask is None and shown[i]:
                mask = (infos.get(name) or {}).get("action_mask")
            flat = np.zeros(self._obs_dims[i], np.float32) if agent_obs is None else \
                np.asarray(agent_obs, np.float32).reshape(-1)
            out[i, :flat.size] = flat
            parts.append(flat)
            if masks is not None:
                masks[i, self._n_actions[i]:] = False
                if not self._alive[i]:
                    masks[i] = False
                elif mask is not None:
                    masks[i, :self._n_actions[i]] = np.asarray(mask, np.bool_)
        state = self.parallel_env.state() if self._has_state else np.concatenate(parts)
        result = {"obs": out, "state": np.asarray(state, np.float32).reshape(-1), "agent_mask": self._alive.copy()}
        if masks is not None:
            result["action_mask"] = masks
        return result

    def _info(self, infos: dict) -> dict:
        """Per-agent infos under ``"agents"``, only when some agent's is not empty (so quiet steps stay cheap)."""
        agents = {name: info for name, info in (infos or {}).items() if info}
        return {"agents": agents} if agents else {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["parallel_env"] = _dumps_state(self.parallel_env)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, parallel_env=pickle.loads(state["parallel_env"]))

    def render(self) -> Any:
        """The wrapped env's frame (build it with ``render_mode="rgb_array"`` in ``env_kwargs``)."""
        return self.parallel_env.render()

    def close(self) -> None:
        """Close the wrapped env."""
        self.parallel_env.close()
