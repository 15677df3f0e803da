"""Gymnasium env managers: step N envs in lock step, in this process, in worker processes or in envpool.

Build one from config with :func:`make_env_manager` (options in :data:`ENV_SCHEMA`), or from your own
env factories: ``SyncEnvManager([lambda: gym.make("CartPole-v1")] * 8)``. Every manager follows the
protocol in docs/design.md: ``reset(seed) -> obs``, ``step(action) -> Timestep``, ``close()``.
Smoke-test a new env with :func:`check_env`. ``ALE/<Game>-v5`` ids get the Atari preprocessing of
:class:`AtariFactory` (options ``cfg.env.atari``, :data:`ATARI_SCHEMA`). ``mpe/<scenario>`` and ``vmas/<scenario>``
ids build teams of agents, one :class:`MultiAgentEnv` per env with an agent axis (docs/multi-agent.md).
"""
from conveyor.envs._atari import ATARI_SCHEMA, AtariFactory, AtariGame
from conveyor.envs._check import EnvCheckError, check_env
from conveyor.envs._config import (ENV_SCHEMA, EnvFactory, check_env_config, check_env_id, env_factory, env_spaces,
                                   is_mujoco_id, make_env_manager)
from conveyor.envs._core import (GAME_INFO, EnvCrashedError, EnvFn, EnvManager, EnvManagerStats, Restored, Timestep,
                                 agent_returns)
from conveyor.envs._envpool import EnvpoolEnvManager
from conveyor.envs._marl_config import is_multi_agent_id, require_multi_agent, require_single_agent
from conveyor.envs._multi_agent import MultiAgentEnv
from conveyor.envs._spaces import AgentSpaces, agent_spaces
from conveyor.envs._subprocess import SubprocessEnvManager, default_num_workers
from conveyor.envs._sync import SyncEnvManager
from conveyor.envs._vmas import VmasParallelEnv

__all__ = [
    "ATARI_SCHEMA",
    "AgentSpaces",
    "AtariFactory",
    "AtariGame",
    "ENV_SCHEMA",
    "EnvCheckError",
    "EnvCrashedError",
    "EnvFactory",
    "EnvFn",
    "EnvManager",
    "EnvManagerStats",
    "EnvpoolEnvManager",
    "GAME_INFO",
    "MultiAgentEnv",
    "Restored",
    "SubprocessEnvManager",
    "SyncEnvManager",
    "Timestep",
    "VmasParallelEnv",
    "agent_returns",
    "agent_spaces",
    "check_env",
    "check_env_config",
    "check_env_id",
    "default_num_workers",
    "env_factory",
    "env_spaces",
    "is_mujoco_id",
    "is_multi_agent_id",
    "make_env_manager",
    "require_multi_agent",
    "require_single_agent",
]
