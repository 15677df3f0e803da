"""What ``conveyor tune`` searches and how a trial's run talks to its study: the ``--param KEY=DIST`` parameters
(:class:`Param`), the pruners, and :class:`TrialReporter`, the run's evaluation hook that reports each evaluation
to the trial and says when the pruner stops it.

``DIST`` is ``loguniform(a,b)`` (floats, log scale, ``0 < a < b``), ``uniform(a,b)`` (floats, ``a < b``),
``int(a,b)`` (integers from ``a`` to ``b``, both included, ``a < b``) or ``choice(x,y,...)`` (one of the values, each
written as ``--set`` takes it: ``choice(64,128)``, ``choice([64],[64,64])``, ``choice(sync,subprocess)``).
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from conveyor.schema import ConfigError

__all__ = ["PRUNED_AT", "PRUNERS", "Param", "TrialReporter", "make_pruner", "parse_param"]

PRUNERS = ("median", "none")
"""``--pruner``: median (a trial whose best evaluation so far is below the median of the finished trials' at the
same env step stops, once 2 trials have finished) or none."""

PRUNED_AT = "pruned_at_env_step"
"""The user attribute :class:`TrialReporter` sets on a trial it stops: the env step of the evaluation that did."""

_DIST = re.compile(r"^(loguniform|uniform|int|choice)\((.*)\)$", re.DOTALL)
_FORMS = "loguniform(a,b), uniform(a,b), int(a,b) or choice(x,y,...)"


@dataclass(frozen=True)
class Param:
    """One searched config key: its dotted ``key``, the distribution's ``kind`` and bounds or ``choices`` (text)."""

    key: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    choices: Tuple[str, ...] = ()

    def suggest(self, trial: Any) -> str:
        """The value ``trial`` samples for this key, as ``--set`` text."""
        if self.kind == "choice":
            return str(trial.suggest_categorical(self.key, list(self.choices)))
        if self.kind == "int":
            return str(trial.suggest_int(self.key, int(self.low), int(self.high)))
        return repr(trial.suggest_float(self.key, self.low, self.high, log=self.kind == "loguniform"))

    def first(self) -> str:
        """The lowest value (a choice's first), as ``--set`` text: what is checked before the first trial."""
        if self.kind == "choice":
            return self.choices[0]
        return str(int(self.low)) if self.kind == "int" else repr(self.low)


def parse_param(text: str) -> Param:
    """``KEY=DIST`` as :class:`Param`; a ConfigError saying what is wrong and the forms that are right."""
    key, sep, dist = text.partition("=")
    key = key.strip()
    found = _DIST.match(dist.strip())
    if not sep or not key or not all(key.split(".")) or found is None:
        raise ConfigError(f"--param {text!r}: expected KEY=DIST with a dotted config key and DIST one of {_FORMS}, "
                          f"e.g. policy.learn.learning_rate=loguniform(1e-4,1e-2)")
    kind, inside = found.group(1), found.group(2)
    parts = _split(inside)
    where = f"--param {key}={kind}({inside})"
    if kind == "choice":
        if not parts or not all(parts):
            raise ConfigError(f"{where}: choice needs one or more values separated by commas, e.g. choice(32,64)")
        if len(set(parts)) != len(parts):
            raise ConfigError(f"{where}: a value is listed twice")
        return Param(key, kind, choices=tuple(parts))
    if len(parts) != 2:
        raise ConfigError(f"{where}: {kind} takes two bounds, {kind}(a,b)")
    low, high = (_bound(part, kind, where) for part in parts)
    if not low < high:
        raise ConfigError(f"{where}: the lower bound must be below the upper one (a < b), got a={parts[0]}, "
                          f"b={parts[1]}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs 0 < a (a log scale), got a={parts[0]}; use uniform(a,b) for a "
                          f"range that reaches 0")
    return Param(key, kind, low, high)


def _split(inside: str) -> List[str]:
    """``inside`` split at the commas outside brackets, each part stripped."""
    parts, depth, current = [], 0, []
    for char in inside:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    return [] if parts == [""] else parts


def _bound(text: str, kind: str, where: str) -> float:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: int(a,b) takes whole numbers, got {text!r}")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{where}: {kind}(a,b) takes numbers, got {text!r}")
    return float(value)


def make_pruner(kind: str) -> Any:
    """The Optuna pruner of ``--pruner kind``."""
    import optuna

    if kind == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)


class TrialReporter:
    """A trial's evaluation hook (:data:`conveyor.run.core.EvaluationHook`): reports each evaluation's mean return to
    the Optuna trial at its env step, and returns True (the run ends after its iteration, with its final
    checkpoint) once the study's pruner says to stop, which it records as the trial's :data:`PRUNED_AT`.

    It pickles as the storage URL, study name, trial id and pruner, and opens the study again where it lands, so it
    reaches a distributed run's learner process (``--collectors``); the trial of this process is used as given.
    """

    def __init__(self, storage: str, study_name: str, trial_id: int, pruner: str, trial: Any = None) -> None:
        self.storage, self.study_name, self.trial_id, self.pruner = storage, study_name, trial_id, pruner
        self._trial = trial
        self._last_step: Optional[int] = None

    def __repr__(self) -> str:
        return f"TrialReporter(study={self.study_name!r}, trial_id={self.trial_id}, pruner={self.pruner!r})"

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_trial": None}

    def __call__(self, result: Dict[str, Any]) -> bool:
        """Report ``result`` (an evaluation: ``mean``, ``env_step``); True to stop the run. A result without a finite
        mean and an env step after the last one reported is left out."""
        mean, step = result.get("mean"), result.get("env_step")
        if not isinstance(mean, (int, float)) or isinstance(mean, bool) or not math.isfinite(mean) or \
                not isinstance(step, int) or isinstance(step, bool) or \
                (self._last_step is not None and step <= self._last_step):
            return False
        self._last_step = step
        trial = self._open()
        trial.report(float(mean), step)
        if not trial.should_prune():
            return False
        trial.set_user_attr(PRUNED_AT, step)
        return True

    def _open(self) -> Any:
        if self._trial is None:
            import optuna

            study = optuna.load_study(study_name=self.study_name, storage=self.storage,
                                      pruner=make_pruner(self.pruner))
            self._trial = optuna.trial.Trial(study, self.trial_id)
        return self._trial
