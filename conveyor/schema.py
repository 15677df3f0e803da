"""Self-documenting config schemas: every key has a default, a type and one line of meaning.

A schema is a nested ``dict`` whose leaves are :class:`Option`. It gives the defaults
(:func:`defaults`) and validates a user config against them (:func:`validate`), so the place a key
is documented is also the place it is checked. This module imports nothing else of Conveyor:
``envs/``, ``policy/`` and the zoo all declare their options with it.
"""
from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from easydict import EasyDict

__all__ = ["ConfigError", "Option", "Schema", "Rename", "DI_ENGINE_RENAMES", "renamed", "defaults", "validate",
           "merge_schemas", "closest"]

Schema = Mapping[str, Any]
_UNSET = object()


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value outside its range."""


@dataclass(frozen=True)
class Option:
    """One config key.

    ``type`` is the expected Python type (or a tuple of them); ``None`` in ``choices`` or a ``None``
    default makes ``None`` acceptable. ``check`` returns an error phrase (e.g. ``"must be > 0"``) or
    ``None``. An ``open`` option holds a free-form dict whose keys are not validated (e.g. env kwargs).
    """

    default: Any
    doc: str
    type: type | tuple[type, ...] | None = None
    choices: Sequence[Any] | None = None
    check: Callable[[Any], str | None] | None = None
    open: bool = False

    def expected_type(self) -> tuple[type, ...] | None:
        if self.type is not None:
            types = self.type if isinstance(self.type, tuple) else (self.type,)
        elif self.default is not None and not self.open:
            types = (type(self.default),)
        else:
            return None
        if float in types and int not in types:
            types = types + (int,)
        if list in types or tuple in types:
            types = tuple(set(types) | {list, tuple})
        return types


def positive(value: Any) -> str | None:
    """A ``check`` for strictly positive numbers."""
    return None if value > 0 else "must be > 0"


def non_negative(value: Any) -> str | None:
    """A ``check`` for numbers >= 0."""
    return None if value >= 0 else "must be >= 0"


def unit_interval(value: Any) -> str | None:
    """A ``check`` for numbers in [0, 1]."""
    return None if 0 <= value <= 1 else "must be in [0, 1]"


def closest(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate most like ``name``, for "did you mean" hints; ``None`` if nothing is close."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return found[0] if found else None


@dataclass(frozen=True)
class Rename:
    """Where Conveyor keeps what another framework's config key holds, and how the values differ (if they do)."""

    key: str
    note: str = ""


DI_ENGINE_RENAMES: dict[str, Rename] = {
    "replay_buffer_size": Rename("policy.other.replay_buffer.size"),
    "encoder_hidden_size_list": Rename("policy.model.hidden_sizes"),
    "hidden_size_list": Rename("policy.model.hidden_sizes"),
    "actor_head_hidden_size": Rename("policy.model.hidden_sizes", "one list of layer widths for the actor and the "
                                                                 "critics"),
    "critic_head_hidden_size": Rename("policy.model.hidden_sizes", "one list of layer widths for the actor and the "
                                                                  "critics"),
    "twin_critic": Rename("policy.model.critic_num", "twin_critic=True is critic_num=2"),
    "value_weight": Rename("policy.learn.value_coef"),
    "entropy_weight": Rename("policy.learn.entropy_coef"),
    "eps.type": Rename("policy.other.eps.kind", "same values: 'exp' or 'linear'"),
    "learning_rate_q": Rename("policy.learn.critic_learning_rate"),
    "learning_rate_policy": Rename("policy.learn.actor_learning_rate"),
    "learning_rate_alpha": Rename("policy.learn.alpha_learning_rate"),
    "target_update_theta": Rename("policy.learn.target_theta"),
    "grad_clip_value": Rename("policy.learn.grad_clip", "it always clips the global L2 norm; there is no "
                                                        "grad_clip_type"),
    "grad_clip_type": Rename("policy.learn.grad_clip", "it always clips the global L2 norm to that value"),
    "priority": Rename("policy.other.replay_buffer.prioritized"),
    "priority_IS_weight": Rename("policy.other.replay_buffer.prioritized", "importance weights come with "
                                                                          "prioritized replay (annealed by beta)"),
    "random_collect_size": Rename("policy.collect.random_collect_size"),
    "evaluator.n_episode": Rename("env.n_evaluator_episode"),
    "collect.discount_factor": Rename("policy.discount_factor", "one discount for collection and learning"),
    "collect.gae_lambda": Rename("policy.gae_lambda"),
    "continuous": Rename("policy.model.action_space", "continuous=True is action_space='gaussian'"),
    "train_iterations": Rename("--max-train-iter", "a budget of `conveyor train`, max_train_iter= of an entry's "
                                                   "main"),
}
"""DI-engine config names that Conveyor calls otherwise, keyed by the name's last components ("eps.type" matches
``policy.other.eps.type``, "replay_buffer_size" matches it anywhere); :func:`validate` names the new key."""


def renamed(path: str) -> str | None:
    """The hint for an unknown dotted ``path`` that DI-engine's name explains (:data:`DI_ENGINE_RENAMES`), else
    ``None``."""
    parts = path.split(".")
    for start in range(len(parts)):
        rename = DI_ENGINE_RENAMES.get(".".join(parts[start:]))
        if rename is not None and rename.key != path:  # a key one policy has and another lacks is no rename
            note = f" ({rename.note})" if rename.note else ""
            return f"'{'.'.join(parts[start:])}' is DI-engine's name: Conveyor's is '{rename.key}'{note}"
    return None


def defaults(schema: Schema) -> EasyDict:
    """The default config a schema describes, as a fresh EasyDict (mutable defaults are copied)."""
    out = {}
    for key, spec in schema.items():
        out[key] = copy.deepcopy(spec.default) if isinstance(spec, Option) else defaults(spec)
    return EasyDict(out)


def merge_schemas(*schemas: Schema) -> dict:
    """Later schemas extend and override earlier ones, section by section."""
    out: dict = {}
    for schema in schemas:
        for key, spec in schema.items():
            if isinstance(spec, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = merge_schemas(out[key], spec)
            else:
                out[key] = spec
    return out


def validate(config: Mapping[str, Any], schema: Schema, path: str = "") -> EasyDict:
    """Check ``config`` against ``schema`` and return it completed with defaults.

    Raises :class:`ConfigError` naming the full dotted path of the first bad key, with Conveyor's key for a
    DI-engine name (:data:`DI_ENGINE_RENAMES`) or else the closest valid key for a misspelt one.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config section '{path or '<root>'}' must be a dict, got {type(config).__name__}")
    for key in config:
        if key not in schema:
            where = f"{path}.{key}" if path else str(key)
            hint = closest(str(key), [str(k) for k in schema])
            fix = renamed(where) or (f"did you mean '{path + '.' if path else ''}{hint}'?" if hint else
                                     f"valid keys here: {', '.join(sorted(map(str, schema)))}")
            raise ConfigError(f"unknown config key '{where}': {fix}")
    out = {}
    for key, spec in schema.items():
        where = f"{path}.{key}" if path else key
        if isinstance(spec, Option):
            value = config[key] if key in config else copy.deepcopy(spec.default)
            _check_option(value, spec, where)
            out[key] = EasyDict(value) if isinstance(value, Mapping) else value
        else:
            out[key] = validate(config.get(key, {}) or {}, spec, where)
    return EasyDict(out)


def _check_option(value: Any, spec: Option, where: str) -> None:
    if value is None and (spec.default is None or (spec.choices is not None and None in spec.choices)):
        return
    types = spec.expected_type()
    if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
        names = " or ".join(sorted(t.__name__ for t in types))
        raise ConfigError(f"config key '{where}' must be {names}, got {value!r} ({type(value).__name__}): {spec.doc}")
    if spec.choices is not None and value not in spec.choices:
        hint = closest(str(value), [str(c) for c in spec.choices])
        extra = f"; did you mean {hint!r}?" if hint else ""
        raise ConfigError(f"config key '{where}' must be one of {list(spec.choices)}, got {value!r}{extra}")
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise ConfigError(f"config key '{where}' {problem}, got {value!r}: {spec.doc}")
