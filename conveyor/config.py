"""Compiling a user's config: validate it against every section's schema and fill in defaults.

User configs are plain EasyDicts (a zoo entry's ``main_config``). :func:`compile_config` checks every
key against the schemas of the sections that own them (``cfg.env``: ``conveyor.envs.ENV_SCHEMA``,
``cfg.policy``: the policy class's ``config_schema()``), so a misspelt key, a wrong type, a negative
size or an unknown env id is an error before anything starts.
"""
from __future__ import annotations

import ast
import copy
import json
import runpy
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Type

import gymnasium as gym
from easydict import EasyDict

from conveyor.envs import (ENV_SCHEMA, AgentSpaces, agent_spaces, check_env_config, env_spaces, require_multi_agent,
                           require_single_agent)
from conveyor.schema import ConfigError, Option, validate

__all__ = ["TOP_SCHEMA", "compile_config", "space_shapes", "ConfigError", "apply_overrides", "load_config_file",
           "merge_config", "CONFIG_SUFFIXES"]

TOP_SCHEMA = {
    "exp_name": Option("experiment", "Name of the run: logs and checkpoints go under runs/<exp_name>/.", type=str),
    "seed": Option(0, "Seed of the envs, the networks' initialisation and exploration.", type=int,
                   check=lambda value: None if 0 <= value < 2**32 else "must be in [0, 2**32)"),
    "transport": Option("auto", "Distributed runs: how collected batches reach a learner on the same host: 'auto' "
                        "through shared memory (nng across hosts), 'nng' always in their router messages.",
                        type=str, choices=("auto", "nng")),
}
"""Top-level keys every config has."""


def space_shapes(observation_space: gym.Space, action_space: gym.Space) -> tuple:
    """``(obs_shape, action_shape)`` as policies' model configs expect them.

    A flat Box gives an int, an image Box a tuple, a Dict/Tuple space a dict of shapes (Tuple keys
    ``"0"``, ``"1"``, ...); a Discrete action space gives its number of actions, a Box its dimension.
    """
    def obs_shape(space: gym.Space) -> Any:
        if isinstance(space, gym.spaces.Dict):
            return {k: obs_shape(s) for k, s in space.spaces.items()}
        if isinstance(space, gym.spaces.Tuple):
            return {str(i): obs_shape(s) for i, s in enumerate(space.spaces)}
        if isinstance(space, gym.spaces.Discrete):
            return 1
        shape = tuple(space.shape)
        return shape[0] if len(shape) == 1 else list(shape)

    if isinstance(action_space, gym.spaces.Discrete):
        action = int(action_space.n)
    elif isinstance(action_space, gym.spaces.Box):
        action = int(action_space.shape[0]) if len(action_space.shape) == 1 else list(action_space.shape)
    else:
        raise ConfigError(f"action space {action_space} is not supported: use Discrete or a 1-D Box")
    return obs_shape(observation_space), action


def compile_config(cfg: Mapping[str, Any], policy: Optional[Type[Any]] = None, *,
                   infer_shapes: bool = True) -> EasyDict:
    """Validate ``cfg`` against the top-level, env and policy schemas and return it with every default.

    ``policy`` is the policy class (e.g. ``DQNPolicy``). With ``infer_shapes`` one env is built as the
    collector's are (:func:`~conveyor.envs.env_spaces`: an Atari id preprocessed) and closed, to read its
    spaces: the policy's ``check_config`` checks the config against them and across keys, a
    ``policy.model`` ``obs_shape`` / ``action_shape`` left unset is read from them, and so are
    ``action_low`` / ``action_high`` of a Box action space where the policy's model schema declares them;
    the values read are validated like the user's. The input is not modified. A policy refuses an env of the
    other kind (``Policy.multi_agent`` against a multi-agent ``env.env_id``); a team's policy gets its model
    keys from :func:`~conveyor.envs.agent_spaces` (one agent's sizes, the state's, ``N_agent``).
    """
    schema: dict = dict(TOP_SCHEMA, env=ENV_SCHEMA)
    if policy is not None:
        schema["policy"] = policy.config_schema()
    elif "policy" in cfg:
        raise ConfigError("config has a 'policy' section but compile_config() was given no policy class: "
                          "pass policy=<the policy class>, e.g. compile_config(cfg, policy=DQNPolicy)")
    compiled = validate(copy.deepcopy(dict(cfg)), schema)
    team = bool(getattr(policy, "multi_agent", False))
    if policy is not None:
        (require_multi_agent if team else require_single_agent)(compiled.env, policy.__name__)
    check_env_config(compiled.env)
    if not infer_shapes or policy is None:
        return compiled
    observation_space, action_space = env_spaces(compiled.env)
    check = getattr(policy, "check_config", None)
    if check is not None:
        check(compiled, observation_space, action_space)
    if team:
        _infer_team_model_keys(compiled.policy.model, agent_spaces(observation_space, action_space))
    else:
        _infer_model_keys(compiled.policy.model, observation_space, action_space)
    # What was read from the env is checked like what the user wrote.
    compiled.policy = validate(compiled.policy, schema["policy"], path="policy")
    return compiled


def _infer_model_keys(model: Any, observation_space: gym.Space, action_space: gym.Space) -> None:
    """Fill the model keys left unset (shapes, and Box action bounds where the model declares them)."""
    obs_shape, action_shape = space_shapes(observation_space, action_space)
    if model.get("obs_shape") is None:
        model.obs_shape = obs_shape
    if model.get("action_shape") is None:
        model.action_shape = action_shape
    if isinstance(action_space, gym.spaces.Box):
        bounds = {"action_low": action_space.low, "action_high": action_space.high}
        for key, values in bounds.items():
            if key in model and model[key] is None:
                model[key] = _bound(values)


def _infer_team_model_keys(model: Any, team: AgentSpaces) -> None:
    """For a team's policy, fill the model keys left unset: ``obs_shape`` (one agent's observation size) and
    ``action_shape`` (``n_actions`` or ``act_dim``), and where the model declares them ``state_shape`` and
    ``n_agents``."""
    found = {"obs_shape": team.obs_dim, "action_shape": team.action_dim, "state_shape": team.state_dim,
             "n_agents": team.agent_num}
    for key, value in found.items():
        if model.get(key) is None and (key in model or key in ("obs_shape", "action_shape")):
            model[key] = value


def _bound(values: Any) -> Any:
    """A Box bound as config writes it: one float when every dim shares it, else a list of floats."""
    flat = [float(v) for v in values.reshape(-1)]
    return flat[0] if len(set(flat)) == 1 else flat


CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".py")
"""Config files :func:`load_config_file` reads."""


def apply_overrides(cfg: Mapping[str, Any], assignments: Iterable[str]) -> EasyDict:
    """A copy of ``cfg`` with each ``"dotted.key=value"`` applied, the value typed against the config.

    Where the key holds a string, the text is kept as it is; elsewhere it is read as a Python or JSON literal
    (``3e-4``, ``[64, 64]``, ``true``, ``null``, ``None``), and a whole float given for an int key becomes an
    int; text that is no literal stays a string. Keys are not checked here: :func:`compile_config` validates
    the result like any config (an unknown key names the closest one, a wrong type the expected one).
    """
    out = EasyDict(copy.deepcopy(dict(cfg)))
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {assignment!r} is not KEY=VALUE with a dotted config key, e.g. "
                              f"policy.learn.learning_rate=3e-4")
        node = out
        for depth, part in enumerate(parts[:-1]):
            if part not in node:
                node[part] = EasyDict()
            elif not isinstance(node[part], Mapping):
                raise ConfigError(f"override {assignment!r}: config key '{'.'.join(parts[:depth + 1])}' holds "
                                  f"{node[part]!r}, not a section with keys")
            node = node[part]
        node[parts[-1]] = _typed(text, node.get(parts[-1]))
    return out


def _typed(text: str, current: Any) -> Any:
    if isinstance(current, str):
        return text
    value = _literal(text)
    if isinstance(current, int) and not isinstance(current, bool) and isinstance(value, float) and \
            value.is_integer():
        return int(value)
    return value


def _literal(text: str) -> Any:
    word = text.strip()
    if word.lower() in ("none", "null", "~"):
        return None
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    try:
        return ast.literal_eval(word)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return float(word)
    except ValueError:
        return text


def merge_config(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> EasyDict:
    """``base`` with ``overlay``'s values on top, section by section (neither input is modified)."""
    out = EasyDict(copy.deepcopy(dict(base)))
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_config_file(path: Any) -> EasyDict:
    """The config in a ``.yaml`` / ``.yml`` / ``.json`` file, or the ``main_config`` of a ``.py`` file.

    A run's own ``config.json`` (``{"policy": ..., "config": {...}}``) gives its config. Any problem (no such
    file, a syntax error, no mapping inside) is a one-line :class:`ConfigError` naming the file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise ConfigError(f"config file {path} must end in {', '.join(CONFIG_SUFFIXES)}, got '{path.suffix}'")
    try:
        found = _read_config(path, suffix)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (ValueError, SyntaxError) as exc:  # json, yaml (a ValueError here) and Python syntax errors
        raise ConfigError(f"cannot read config file {path}: {' '.join(str(exc).split())}") from None
    if isinstance(found, Mapping) and set(found) == {"policy", "config"}:
        found = found["config"]
    if not isinstance(found, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping of config sections (a main_config in a .py "
                          f"file), got {type(found).__name__}")
    return EasyDict(copy.deepcopy(dict(found)))


def _read_config(path: Path, suffix: str) -> Any:
    if suffix == ".py":
        return runpy.run_path(str(path)).get("main_config")
    text = path.read_text()
    if suffix == ".json":
        return json.loads(text)
    import yaml
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from None
