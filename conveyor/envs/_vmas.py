"""VMAS scenarios under PettingZoo's Parallel API, one simulation per env (``num_envs=1``).

VMAS simulates a batch of worlds in torch; here each env holds a batch of one and the env managers step N
such envs, as they do any Gymnasium env. That is the simpler correct choice: auto-reset per env, seeds
``seed + i``, crash rebuilds, worker processes and checkpoints all come from the managers unchanged, where
one VMAS batch of N worlds would need its own manager for each of them. The price is torch's per-call
overhead paid N times per step instead of once.

Around every VMAS call (:meth:`VmasParallelEnv._vmas_call`):

- VMAS keeps one random state for all its envs of a process (a class attribute swapped in around every call);
  each :class:`VmasParallelEnv` carries its own and swaps it in, so an env's worlds do not depend on the other
  envs of the process or on the order they are stepped in, and the state pickles with the env (exact resume).
- torch runs one intra-op thread: a world of one gains nothing from more, and in a worker process forked from
  one that had run a parallel torch operator, VMAS's first parallel operator never returned (torch 2.13 CPU,
  OpenMP's threads are not forked); with one thread it runs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
from gymnasium import spaces

__all__ = ["VmasParallelEnv", "VMAS_MAX_STEPS"]

VMAS_MAX_STEPS = 100
"""Episode length when ``max_steps`` is not given (VMAS's own default is no limit; BenchMARL's tasks use 100)."""


def _shared_random_state() -> list | None:
    """VMAS's random states (torch, numpy, random) that all its envs of this process share, in place."""
    from vmas.simulator.environment import Environment

    return getattr(Environment, "vmas_random_state", None)


def _gymnasium_space(space: Any) -> spaces.Space:
    """VMAS's (OpenAI gym) Box or Discrete as Gymnasium's."""
    if hasattr(space, "n"):
        return spaces.Discrete(int(space.n))
    return spaces.Box(np.asarray(space.low, np.float32), np.asarray(space.high, np.float32), dtype=np.float32)


class VmasParallelEnv:
    """A VMAS scenario as a PettingZoo Parallel API env: dicts keyed by agent name of numpy values.

    ``continuous_actions`` picks Box or Discrete actions, ``max_steps`` truncates episodes, and the other keyword
    arguments go to the scenario (e.g. ``n_agents``). VMAS has no per-agent ends: every agent leaves together.
    """

    metadata = {"render_modes": ["rgb_array"], "name": "vmas"}

    def __init__(self, scenario: str, *, continuous_actions: bool = True, max_steps: int | None = VMAS_MAX_STEPS,
                 render_mode: str | None = None, **scenario_kwargs: Any) -> None:
        import vmas

        shared = _shared_random_state()
        self._rng = None if shared is None else list(shared)
        self.render_mode = render_mode
        with self._vmas_call():
            self._env = vmas.make_env(scenario, num_envs=1, device="cpu", continuous_actions=continuous_actions,
                                      max_steps=max_steps, dict_spaces=True, terminated_truncated=True,
                                      **scenario_kwargs)
        self.possible_agents = [agent.name for agent in self._env.agents]
        self.agents: list[str] = []
        self._obs_spaces = {agent: _gymnasium_space(space) for agent, space in self._env.observation_space.spaces.items()}
        self._act_spaces = {agent: _gymnasium_space(space) for agent, space in self._env.action_space.spaces.items()}
        self._continuous = continuous_actions

    @contextlib.contextmanager
    def _vmas_call(self) -> Iterator[None]:
        """Run VMAS in one torch thread, with this env's random state in place of the one its envs share; keep
        what it leaves (see the module docstring)."""
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        states = _shared_random_state()
        shared = None if states is None else list(states)
        if states is not None:
            states[:] = self._rng
        try:
            yield
        finally:
            if states is not None:
                self._rng = list(states)
                states[:] = shared
            torch.set_num_threads(threads)

    def observation_space(self, agent: str) -> Any:
        """The agent's observation Box."""
        return self._obs_spaces[agent]

    def action_space(self, agent: str) -> Any:
        """The agent's action space: a Box, or Discrete with ``continuous_actions=False``."""
        return self._act_spaces[agent]

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        """Start a new episode (seeded when ``seed`` is given); every agent takes part."""
        with self._vmas_call():
            obs = self._env.reset(seed=seed)
        self.agents = list(self.possible_agents)
        return self._numpy(obs), {agent: {} for agent in self.agents}

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        """Step the world; agents without an action (none should be) do nothing."""
        import torch

        joint = {}
        for agent in self.possible_agents:
            space = self._act_spaces[agent]
            if self._continuous:
                value = actions.get(agent, np.zeros(space.shape, np.float32))
                joint[agent] = torch.as_tensor(np.asarray(value, np.float32).reshape(1, -1))
            else:
                joint[agent] = torch.tensor([int(actions.get(agent, 0))], dtype=torch.long)
        with self._vmas_call():
            obs, rewards, terminated, truncated, infos = self._env.step(joint)
        term, trunc = bool(terminated[0]), bool(truncated[0])
        agents = self.agents
        if term or trunc:
            self.agents = []
        return (self._numpy(obs), {agent: float(rewards[agent][0]) for agent in agents},
                {agent: term for agent in agents}, {agent: trunc for agent in agents},
                {agent: {key: float(value[0]) for key, value in infos[agent].items() if value.numel() == 1}
                 for agent in agents})

    @staticmethod
    def _numpy(obs: dict) -> dict:
        return {agent: value[0].numpy() for agent, value in obs.items()}

    def render(self) -> Any:
        """The first world as an RGB array."""
        with self._vmas_call():
            return self._env.render(mode="rgb_array")

    def close(self) -> None:
        """Nothing to release: VMAS holds no processes or files."""
