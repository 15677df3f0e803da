"""Multi-agent env ids (``mpe/<scenario>``, ``vmas/<scenario>``), their factory, and the checks that an entry's env
has the kind of agents it trains.

``mpe/<module>`` builds ``mpe2.<module>.parallel_env(**env_kwargs)`` (e.g. ``mpe/simple_spread_v3`` with
``max_cycles``, ``N``, ``continuous_actions``); ``vmas/<scenario>`` builds :class:`~conveyor.envs._vmas.VmasParallelEnv`
(``continuous_actions``, ``max_steps``, and scenario keys such as ``n_agents``). Both are wrapped in
:class:`~conveyor.envs._multi_agent.MultiAgentEnv`, which the env managers step like any Gymnasium env.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Mapping

import gymnasium as gym

from conveyor.envs._atari import require_extra
from conveyor.envs._multi_agent import MultiAgentEnv
from conveyor.schema import ConfigError, closest

__all__ = ["check_multi_agent_id", "is_multi_agent_id", "make_multi_agent_env", "multi_agent_ids", "require_multi_agent",
           "require_single_agent"]

FAMILIES = {"mpe": ("pettingzoo", "mpe2"), "vmas": ("vmas",)}
"""Multi-agent id prefixes and the packages (of the ``marl`` extra) each needs."""

EXAMPLE_IDS = "mpe/simple_spread_v3, mpe/simple_reference_v3, mpe/simple_tag_v3, vmas/navigation, vmas/balance"


def is_multi_agent_id(env_id: Any) -> bool:
    """Whether ``env_id`` names a multi-agent env (``mpe/...`` or ``vmas/...``); nothing is imported."""
    return isinstance(env_id, str) and env_id.split("/", 1)[0] in FAMILIES and "/" in env_id


def multi_agent_ids(family: str) -> list[str]:
    """The ids of one family's scenarios, from its installed package (``mpe2``'s env modules, ``vmas.scenarios``)."""
    if family == "mpe":
        import mpe2

        names = [m.name for m in pkgutil.iter_modules(mpe2.__path__) if not m.name.startswith("_")
                 and m.name != "all_modules"]
    else:
        import vmas

        names = list(vmas.scenarios)
    return [f"{family}/{name}" for name in sorted(names)]


def check_multi_agent_id(env_id: str) -> None:
    """Raise a one-line :class:`ConfigError` if ``env_id``'s packages are missing or its scenario is unknown."""
    family = env_id.split("/", 1)[0]
    require_extra("marl", *FAMILIES[family], why=f"env.env_id {env_id!r}")
    accepted = multi_agent_ids(family)
    if env_id not in accepted:
        hint = closest(env_id, accepted)
        fix = f"did you mean {hint!r}? " if hint else ""
        raise ConfigError(f"config key 'env.env_id' is {env_id!r}, which is no {family} scenario: {fix}accepted ids: "
                          f"{', '.join(accepted)}")


def make_multi_agent_env(env_id: str, env_kwargs: Mapping[str, Any], max_episode_steps: int | None = None) -> gym.Env:
    """Build the scenario of ``env_id`` with ``env_kwargs``, wrapped in :class:`MultiAgentEnv`, its episodes
    truncated after ``max_episode_steps`` when given (what :class:`~conveyor.envs.EnvFactory` calls for these ids)."""
    family, name = env_id.split("/", 1)
    if family == "mpe":
        parallel_env = importlib.import_module(f"mpe2.{name}").parallel_env(**env_kwargs)
    else:
        from conveyor.envs._vmas import VmasParallelEnv

        parallel_env = VmasParallelEnv(name, **env_kwargs)
    env: gym.Env = MultiAgentEnv(parallel_env, env_id)
    if max_episode_steps is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps)
    return env


def require_multi_agent(env_cfg: Mapping[str, Any], who: str) -> None:
    """Refuse (one-line :class:`ConfigError`) a ``cfg.env`` whose env is single-agent, for ``who`` (an entry or a
    policy) that trains a team."""
    env_id = env_cfg.get("env_id")
    if not is_multi_agent_id(env_id):
        raise ConfigError(f"{who} trains a team of agents, but env.env_id={env_id!r} is a single-agent Gymnasium env: "
                          f"set env.env_id to a multi-agent id ({EXAMPLE_IDS}), or use a single-agent entry")


def require_single_agent(env_cfg: Mapping[str, Any], who: str) -> None:
    """Refuse (one-line :class:`ConfigError`) a ``cfg.env`` whose env is multi-agent, for ``who`` that trains one
    agent."""
    env_id = env_cfg.get("env_id")
    if is_multi_agent_id(env_id):
        raise ConfigError(f"{who} trains one agent, but env.env_id={env_id!r} is a multi-agent env: use a "
                          f"multi-agent entry (e.g. mpe/mappo), or set env.env_id to a Gymnasium id such as "
                          f"'CartPole-v1'")
