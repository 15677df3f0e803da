"""Batching Gymnasium spaces: a space as a flat list of fixed-shape leaves, and back.

A nested space (``Dict``, ``Tuple``, nested arbitrarily) is handled as the list of its leaf spaces
(``Box``, ``Discrete``, ``MultiDiscrete``, ``MultiBinary``), so a manager preallocates one array per
leaf (in-process or in shared memory) and writes each env's value in place. Batched values are
handed to users nested again: dicts for ``Dict``, dicts keyed ``"0"``, ``"1"``, ... for ``Tuple``.

A team's env (:class:`~conveyor.envs.MultiAgentEnv`) is one such nested space; :func:`agent_spaces` reads the
agent axis and the per-agent sizes back from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
from gymnasium import spaces

__all__ = ["AgentSpaces", "SpaceLayout", "LEAF_SPACES", "agent_spaces"]

LEAF_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)

Path = tuple  # keys from the root space to a leaf: str for Dict, int for Tuple


class SpaceLayout:
    """The leaves of one (possibly nested) space: their paths, shapes and dtypes."""

    __slots__ = ("space", "paths", "shapes", "dtypes", "flat")

    def __init__(self, space: spaces.Space, what: str = "observation") -> None:
        self.space = space
        leaves: list[tuple[Path, tuple[int, ...], np.dtype]] = []
        _collect_leaves(space, (), leaves, what)
        self.paths = [path for path, _, _ in leaves]
        self.shapes = [shape for _, shape, _ in leaves]
        self.dtypes = [dtype for _, _, dtype in leaves]
        self.flat = isinstance(space, LEAF_SPACES)

    def empty(self, n: int) -> list[np.ndarray]:
        """One uninitialised ``[n, ...]`` array per leaf."""
        return [np.empty((n, *shape), dtype) for shape, dtype in zip(self.shapes, self.dtypes)]

    def write(self, arrays: list[np.ndarray], row: int, value: Any) -> None:
        """Write one env's (nested) value into row ``row`` of the leaf arrays."""
        for array, path in zip(arrays, self.paths):
            array[row] = _get(value, path)

    def nest(self, arrays: list[np.ndarray]) -> Any:
        """Leaf arrays as the batched value users see: the array itself, or nested dicts of arrays."""
        if self.flat:
            return arrays[0]
        tree: dict = {}
        for array, path in zip(arrays, self.paths):
            node = tree
            for key in path[:-1]:
                node = node.setdefault(str(key), {})
            node[str(path[-1])] = array
        return tree

    def item(self, arrays: list[np.ndarray], row: int) -> Any:
        """Row ``row`` of the leaf arrays in the space's native structure (dict / tuple), e.g. one env's action."""
        if self.flat:
            return arrays[0][row]
        return _native(self.space, iter([array[row] for array in arrays]))

    def leaves_of(self, batch: Any) -> list[Any]:
        """A user's batched (nested) value as its list of leaves; ``Tuple`` parts may be tuples or dicts."""
        if self.flat:
            return [batch]
        return [_get(batch, path) for path in self.paths]


def _collect_leaves(space: spaces.Space, path: Path, out: list, what: str) -> None:
    if isinstance(space, LEAF_SPACES):
        out.append((path, tuple(space.shape), np.dtype(space.dtype)))
    elif isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            _collect_leaves(sub, path + (key,), out, what)
    elif isinstance(space, spaces.Tuple):
        for index, sub in enumerate(space.spaces):
            _collect_leaves(sub, path + (index,), out, what)
    else:
        where = "".join(f"[{key!r}]" for key in path)
        raise TypeError(
            f"{what} space{where} {space} cannot be batched into arrays: env managers support Box, Discrete, "
            f"MultiDiscrete, MultiBinary and Dict/Tuple of them; wrap the env to convert it "
            f"(e.g. gymnasium.wrappers.FlattenObservation for observations)")


def _get(value: Any, path: Path) -> Any:
    for key in path:
        if isinstance(key, int) and isinstance(value, Mapping):
            key = str(key)
        value = value[key]
    return value


def _native(space: spaces.Space, leaves: Iterator[Any]) -> Any:
    if isinstance(space, spaces.Dict):
        return {key: _native(sub, leaves) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_native(sub, leaves) for sub in space.spaces)
    return next(leaves)


@dataclass(frozen=True)
class AgentSpaces:
    """The sizes a team's policy is built from: the agent axis, one agent's observation and action, the state."""

    agent_num: int
    """``N_agent``, the length of the agent axis."""
    obs_dim: int
    """One agent's observation size (``obs`` is ``[N_agent, obs_dim]``, shorter ones zero-padded)."""
    state_dim: int
    """The global state's size (``state`` is ``[state_dim]``)."""
    action_space: spaces.Space
    """One agent's actions: ``Discrete(n_actions)`` (the most any agent has; ``action_mask`` marks each agent's), or
    ``Box(act_dim)`` with bounds that cover every agent's."""

    @property
    def discrete(self) -> bool:
        """Whether actions are discrete (then ``action_mask`` is ``[N_agent, n_actions]``)."""
        return isinstance(self.action_space, spaces.Discrete)

    @property
    def action_dim(self) -> int:
        """``n_actions`` for discrete actions, ``act_dim`` for continuous ones."""
        return int(self.action_space.n) if self.discrete else int(self.action_space.shape[0])


def agent_spaces(observation_space: spaces.Space, action_space: spaces.Space) -> AgentSpaces:
    """The :class:`AgentSpaces` of a team's env from its (manager's) spaces, e.g.
    ``agent_spaces(manager.observation_space, manager.action_space)`` or ``agent_spaces(*env_spaces(cfg.env))``."""
    keys = {"obs", "state", "agent_mask"}
    if not isinstance(observation_space, spaces.Dict) or not keys <= set(observation_space.spaces):
        raise ValueError(f"observation space {observation_space} has no agent axis (keys {sorted(keys)}): it is not a "
                         f"team's env; set env.env_id to a multi-agent id such as 'mpe/simple_spread_v3'")
    agent_num, obs_dim = observation_space["obs"].shape
    if isinstance(action_space, spaces.MultiDiscrete):
        one: spaces.Space = spaces.Discrete(int(action_space.nvec.max()))
    else:
        one = spaces.Box(action_space.low.min(axis=0), action_space.high.max(axis=0), dtype=action_space.dtype)
    return AgentSpaces(int(agent_num), int(obs_dim), int(observation_space["state"].shape[0]), one)
