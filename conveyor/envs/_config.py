"""``cfg.env``: its schema, the env id check, and building an env manager from it."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import gymnasium as gym

from conveyor.envs._atari import ATARI_OPTION, AtariFactory, atari_options, is_atari_id, register_atari, require_extra
from conveyor.envs._core import EnvManager
from conveyor.envs._envpool import EnvpoolEnvManager, envpool_atari_kwargs, envpool_task_id
from conveyor.envs._marl_config import check_multi_agent_id, is_multi_agent_id, make_multi_agent_env
from conveyor.envs._subprocess import SubprocessEnvManager
from conveyor.envs._sync import SyncEnvManager
from conveyor.schema import ConfigError, Option, closest, non_negative, positive, validate

__all__ = ["ENV_SCHEMA", "EnvFactory", "check_env_config", "check_env_id", "env_factory", "env_spaces",
           "is_mujoco_id", "make_env_manager"]

ENV_SCHEMA: dict[str, Option] = {
    "env_id": Option("CartPole-v1", "Gymnasium env id passed to gymnasium.make ('module:Id' imports module first), "
                                    "or a multi-agent 'mpe/<scenario>' or 'vmas/<scenario>' (docs/multi-agent.md)",
                     type=str),
    "env_kwargs": Option({}, "keyword arguments for gymnasium.make (e.g. render_mode), or for the multi-agent "
                             "scenario (e.g. max_cycles, N, continuous_actions)", type=dict, open=True),
    "collector_env_num": Option(8, "envs the collector steps in lock step", type=int, check=positive),
    "evaluator_env_num": Option(5, "envs the evaluator steps in lock step", type=int, check=positive),
    "n_evaluator_episode": Option(10, "episodes per evaluation, spread over the evaluator's envs", type=int,
                                  check=positive),
    "stop_value": Option(None, "stop training once the mean evaluation return reaches this (None: never)",
                         type=float),
    "async_collector": Option("auto", "where async mode runs the collection middleware: 'process' (a child process, "
                                      "so it overlaps the learner), 'thread' (this process, sharing its GIL: "
                                      "slower than sync on the zoo's entries), or 'auto' (now 'process')",
                              choices=("auto", "process", "thread")),
    "manager": Option("sync", "'sync' steps envs in this process (cheap envs); 'subprocess' in worker processes; "
                              "'envpool' in envpool's C++ thread pool (its Atari and MuJoCo envs)",
                      choices=("sync", "subprocess", "envpool")),
    "num_workers": Option(None, "worker processes for manager='subprocess' (None: min(env num, CPUs)), threads for "
                                "'envpool' (None: envpool's default)", type=int, check=positive),
    "start_method": Option(None, "multiprocessing start method for workers (None: the platform default)",
                           choices=(None, "fork", "forkserver", "spawn")),
    "step_timeout": Option(None, "seconds a worker may take for one step before it is killed and replaced "
                                 "(None: wait forever)", type=float, check=positive),
    "max_retry": Option(3, "times in a row one env may crash and be rebuilt before training stops with an error",
                        type=int, check=non_negative),
    "max_episode_steps": Option(None, "truncate episodes after this many steps (None: the env's own limit)",
                                type=int, check=positive),
    "atari": ATARI_OPTION,
}
"""The options of ``cfg.env``, read by :func:`make_env_manager` (and by collectors/evaluators for the counts)."""

Role = Literal["collector", "evaluator"]


@dataclass(frozen=True)
class EnvFactory:
    """A picklable env factory: ``gymnasium.make(env_id, max_episode_steps=..., **env_kwargs)``, or for a multi-agent
    id its scenario as one :class:`~conveyor.envs.MultiAgentEnv`."""

    env_id: str
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_episode_steps: int | None = None

    def __call__(self) -> gym.Env:
        if is_multi_agent_id(self.env_id):
            return make_multi_agent_env(self.env_id, self.env_kwargs, self.max_episode_steps)
        kwargs = dict(self.env_kwargs)
        if self.max_episode_steps is not None:
            kwargs["max_episode_steps"] = self.max_episode_steps
        if is_mujoco_id(self.env_id):
            _quiet_mujoco()
        return gym.make(self.env_id, **kwargs)


def is_mujoco_id(env_id: str) -> bool:
    """Whether ``env_id`` is a registered Gymnasium MuJoCo env (HalfCheetah-v5...)."""
    try:
        entry_point = gym.spec(env_id).entry_point
    except gym.error.Error:
        return False
    return isinstance(entry_point, str) and entry_point.startswith("gymnasium.envs.mujoco")


_MUJOCO_NOISE = "compiler attribute 'settotalmass' is deprecated"
"""MuJoCo's warning about Gymnasium's own HalfCheetah model, once for every env built: nothing a user can act on."""


def _quiet_mujoco() -> None:
    """Drop :data:`_MUJOCO_NOISE` (also kept out of ``MUJOCO_LOG.TXT`` in the working folder); MuJoCo's other
    warnings still go to stderr. A warning handler set before (the user's, or this one) is left in place."""
    import mujoco

    if mujoco.get_mju_user_warning() is not None:
        return

    def warn(text: str) -> None:
        if _MUJOCO_NOISE not in text:
            print(f"WARNING: {text}", file=sys.stderr, flush=True)

    mujoco.set_mju_user_warning(warn)


def check_env_id(env_id: str) -> None:
    """Raise :class:`~conveyor.schema.ConfigError` if ``env_id`` is not a registered Gymnasium id nor a known
    multi-agent id (``mpe/<scenario>``, ``vmas/<scenario>``, whose packages must be installed).

    The message names the closest registered id. An id of the form ``"module:Id"`` imports ``module``
    first (as ``gymnasium.make`` does), which registers its envs. Nothing is built.
    """
    if not isinstance(env_id, str) or not env_id:
        raise ConfigError(f"config key 'env.env_id' must be a Gymnasium env id such as 'CartPole-v1', got {env_id!r}")
    if is_multi_agent_id(env_id):
        check_multi_agent_id(env_id)
        return
    name = env_id
    if is_atari_id(env_id):
        register_atari(env_id)
    if ":" in env_id:
        module, name = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"config key 'env.env_id' is {env_id!r}, but its module {module!r} cannot be imported "
                              f"({exc}): install the package that provides it") from None
    try:
        gym.spec(name)
    except gym.error.Error as exc:
        hint = _atari_id(name) if not is_atari_id(env_id) else None
        hint = hint or _closest_env_id(name)
        fix = f"did you mean {hint!r}?" if hint else f"({exc}) register it with gymnasium.register first, or fix " \
                                                       f"the spelling"
        raise ConfigError(f"config key 'env.env_id' is {env_id!r}, which is not a registered Gymnasium env: "
                          f"{fix}") from None
    if is_mujoco_id(name):
        require_extra("mujoco", "mujoco", why=f"env.env_id {env_id!r}")


def check_env_config(env_cfg: Mapping[str, Any]) -> None:
    """Raise :class:`~conveyor.schema.ConfigError` if ``cfg.env`` (validated) names an env or a manager that cannot
    be built here: :func:`check_env_id`, and for ``manager: envpool`` envpool installed and providing the id."""
    check_env_id(env_cfg["env_id"])
    if env_cfg.get("manager") == "envpool":
        envpool_task_id(env_cfg["env_id"])


def _atari_id(name: str) -> str | None:
    """``ALE/<Game>-v5`` for an Atari game named without ``ALE/`` (``Pong-v5``, ``PongNoFrameskip-v4``, ``pong``),
    when ale-py is installed."""
    if importlib.util.find_spec("ale_py") is None:
        return None
    try:
        register_atari(name)
    except ConfigError:  # OpenCV missing: no Atari here
        return None
    game = name.rpartition("-v")[0] if "-v" in name else name
    for variant in ("NoFrameskip", "Deterministic"):
        game = game.replace(variant, "")
    games = {spec_id.lower(): spec_id for spec_id in gym.registry if spec_id.startswith("ALE/")}
    return games.get(f"ale/{game.lower()}-v5")


def _closest_env_id(env_id: str) -> str | None:
    """The registered id most like ``env_id``: names compared without versions, then the asked or latest version."""
    versions: dict[str, dict[int | None, str]] = {}
    for registered in gym.registry:
        base, _, version = registered.rpartition("-v") if "-v" in registered else (registered, "", "")
        versions.setdefault(base, {})[int(version) if version.isdigit() else None] = registered
    base, _, version = env_id.rpartition("-v") if "-v" in env_id else (env_id, "", "")
    lowered = {b.lower(): b for b in versions}
    found = closest(base, list(versions)) or lowered.get(closest(base.lower(), list(lowered)) or "")
    if found is None:
        return None
    asked = int(version) if version.isdigit() else None
    if asked in versions[found]:
        return versions[found][asked]
    numbered = [v for v in versions[found] if v is not None]
    return versions[found][max(numbered)] if numbered else versions[found][None]


def env_factory(env_cfg: Mapping[str, Any], role: Role = "collector") -> EnvFactory | AtariFactory:
    """The picklable factory of one env as ``cfg.env`` asks for it: :class:`AtariFactory` for ``ALE/`` ids
    (life loss and reward clipping only for the collector's envs), :class:`EnvFactory` otherwise. Build one
    env with it to read the spaces a manager will have."""
    cfg = validate(env_cfg, ENV_SCHEMA, "env")
    if is_atari_id(cfg.env_id):
        return AtariFactory.from_config(cfg, collector=role == "collector")
    return EnvFactory(cfg.env_id, dict(cfg.env_kwargs), cfg.max_episode_steps)


def env_spaces(env_cfg: Mapping[str, Any]) -> tuple:
    """``(observation_space, action_space)`` of the envs ``cfg.env`` asks for, read from one env built as the
    collector's are (:func:`env_factory`) and closed at once."""
    env = env_factory(env_cfg)()
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def make_env_manager(env_cfg: Mapping[str, Any], role: Role, seed: int | None = None) -> EnvManager:
    """Build the manager ``cfg.env`` asks for, with ``collector_env_num`` or ``evaluator_env_num`` envs.

    ``env_cfg`` is ``cfg.env`` (compiled or not: missing keys get their defaults). The env id is
    checked before any env or process is started. ``seed`` is used by the manager's first ``reset()``.
    """
    cfg = validate(env_cfg, ENV_SCHEMA, "env")
    if role not in ("collector", "evaluator"):
        raise ValueError(f"role must be 'collector' or 'evaluator', got {role!r}")
    env_num = cfg.collector_env_num if role == "collector" else cfg.evaluator_env_num
    if cfg.manager == "envpool":
        if is_multi_agent_id(cfg.env_id):
            raise ConfigError(f"env.manager 'envpool' has no multi-agent envs such as env.env_id={cfg.env_id!r}: set "
                              f"env.manager to 'sync' or 'subprocess'")
        return _envpool_manager(cfg, role, env_num, seed)
    check_env_id(cfg.env_id)
    env_fns = [env_factory(cfg, role)] * env_num
    if cfg.manager == "sync":
        return SyncEnvManager(env_fns, seed=seed, max_retry=cfg.max_retry, env_id=cfg.env_id)
    num_workers = None if cfg.num_workers is None else min(cfg.num_workers, env_num)
    return SubprocessEnvManager(env_fns, num_workers=num_workers, seed=seed, max_retry=cfg.max_retry,
                                start_method=cfg.start_method, step_timeout=cfg.step_timeout, env_id=cfg.env_id)


def _envpool_manager(cfg: Mapping[str, Any], role: Role, env_num: int, seed: int | None) -> EnvpoolEnvManager:
    """``manager: envpool``: the env id mapped to envpool's, Atari preprocessing from ``cfg.env.atari``;
    ``env_kwargs`` go to ``envpool.make``."""
    task_id = envpool_task_id(cfg.env_id)
    kwargs = dict(cfg.env_kwargs)
    if is_atari_id(cfg.env_id):
        kwargs.update(envpool_atari_kwargs(atari_options(cfg.atari), collector=role == "collector"))
    if cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    return EnvpoolEnvManager(task_id, env_num, seed=seed, num_threads=cfg.num_workers, env_id=cfg.env_id, **kwargs)
