"""The run directory: where a run lives, the config it saves, and the checks that refuse a wrong start or resume.

A run lives in ``runs/<exp_name>/`` (``$CONVEYOR_RUNS/<exp_name>/`` where that is set: :func:`runs_root`), with
``config.json``, ``log.txt``, ``ckpt/``, ``tb/``, and ``nodes.json`` for a distributed run. A new run refuses a
name that already holds a run; ``resume=True`` reads the saved config, which a given config and seed must agree
with (a refusal names the keys that differ), in the layout the run was trained in (one process, or distributed).
A run that failed before its first checkpoint (marked with ``failed.txt`` by :func:`mark_failed`) holds nothing to
resume: a new run, or a resume with any config, starts over in its directory (its ``log.txt`` is kept and
appended to).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Type

from easydict import EasyDict

from conveyor.config import TOP_SCHEMA, compile_config
from conveyor.middleware import CheckpointError
from conveyor.schema import ConfigError

__all__ = ["RUNS", "RUNS_ENV", "runs_root", "CONFIG_FILE", "LATEST", "LOG_FILE", "NODES_FILE", "RunDirError",
           "check_exp_name", "experiment_dir", "run_directory", "prepare", "read_run_config", "check_layout",
           "config_differences", "mark_failed", "FAILED_FILE"]

log = logging.getLogger(__name__)

RUNS = Path("runs")
RUNS_ENV = "CONVEYOR_RUNS"
"""The environment variable naming the folder runs go in instead of ``runs/`` (``conveyor tune`` puts each trial's
run under ``runs/<study>/`` with it; the processes a run starts inherit it)."""
CONFIG_FILE = "config.json"
LATEST = "latest.pth.tar"
LOG_FILE = "log.txt"
"""In every run directory: the run's log records and progress lines as plain text (appended on resume)."""
FAILED_FILE = "failed.txt"
"""In the run directory of a run that raised before its first checkpoint: the error, one line (:func:`mark_failed`)."""
NODES_FILE = "nodes.json"
"""In the run directory of a distributed run: every node's id, roles, pid, host and address (the learner writes it)."""


class RunDirError(ValueError):
    """A run directory cannot be used as asked: it already holds a run, or holds another algorithm's run."""


def check_exp_name(name: Any) -> str:
    """``name`` if it is a usable run name: one non-empty path component, not ``.`` or ``..``."""
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name:
        raise ConfigError(f"exp_name {name!r} is not a run name: use one folder name such as 'cartpole_dqn_2' "
                          f"(no '/', not empty, not '.' or '..'); runs go under {runs_root()}/")
    return name


def runs_root() -> Path:
    """The folder runs go in: ``$CONVEYOR_RUNS`` where it is set, else ``runs`` (both relative to the working
    directory unless absolute)."""
    return Path(os.environ.get(RUNS_ENV) or RUNS)


def experiment_dir(cfg: Mapping[str, Any]) -> Path:
    """``runs/<exp_name>`` (under :func:`runs_root`): where an entry's config, logs and checkpoints go."""
    return runs_root() / check_exp_name(cfg["exp_name"])


def run_directory(cfg: Mapping[str, Any], exp_name: Optional[str] = None) -> Path:
    """The run directory of an entry run with config ``cfg`` (raw: its ``exp_name`` may be left to the default)
    and the ``exp_name`` argument, which wins."""
    return experiment_dir({"exp_name": exp_name if exp_name is not None else
                           cfg.get("exp_name", TOP_SCHEMA["exp_name"].default)})


def prepare(main_config: Mapping[str, Any], policy: Type[Any], cfg: Optional[Mapping[str, Any]] = None, *,
            seed: Optional[int] = None, exp_name: Optional[str] = None, resume: bool = False,
            owner: bool = True, distributed: bool = False) -> EasyDict:
    """The compiled config of a run, with its run directory ready.

    A new run: ``cfg`` (default ``main_config``) with the overrides; its name must not hold a run yet;
    the directory is created and the resolved config saved in it. ``resume=True``: the config saved by
    the run (``cfg`` and ``seed``, if given, must agree with it: the command line that started a run resumes it,
    and so does one that leaves its ``--seed`` out; ``policy.device`` may differ: the run moves). ``owner=False``
    (a distributed run's node other than the learner): only the compiled config; the run directory is the
    learner's.
    """
    raw = EasyDict(copy.deepcopy(dict(cfg if cfg is not None else main_config)))
    if exp_name is not None:
        raw.exp_name = exp_name
    if not owner:
        return compile_config(raw if seed is None else EasyDict(raw, seed=seed), policy=policy)
    run_dir = experiment_dir(raw)
    if resume:
        if cfg is not None and seed is None and raw.get("seed") != main_config.get("seed"):
            seed = raw.seed  # a seed the given config sets is checked as --seed is
        return _saved_config(run_dir, policy, None if cfg is None else raw, seed, distributed)
    if seed is not None:
        raw.seed = seed
    compiled = compile_config(raw, policy=policy)
    if _failed_start(run_dir):
        return _start_over(run_dir, policy, compiled)
    check_new(run_dir)
    _write_config(run_dir, policy, compiled)
    return compiled


def _failed_start(run_dir: Path) -> bool:
    return (run_dir / FAILED_FILE).is_file() and not (run_dir / "ckpt" / LATEST).is_file()


def check_new(run_dir: Path) -> None:
    """Refuse to start a new run in ``run_dir`` when it already holds one; a start that failed before its first
    checkpoint is not refused (:func:`prepare` starts it over). A launcher calls it before any process starts."""
    if not _failed_start(run_dir) and run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunDirError(f"{run_dir} already holds a run: continue it with --resume, or choose another --exp-name")


def mark_failed(run_dir: Path, error: BaseException) -> None:
    """Mark ``run_dir`` as a run that failed before its first checkpoint (nothing to resume), so that the same
    command starts it over; a run with a checkpoint, or no directory, is left as it is."""
    if not run_dir.is_dir() or (run_dir / "ckpt" / LATEST).is_file():
        return
    try:
        (run_dir / FAILED_FILE).write_text(f"{type(error).__name__}: {' '.join(str(error).split())[:500]}\n")
    except OSError as exc:
        log.warning("cannot mark %s as a failed start (%s): remove it before starting the run again", run_dir, exc)


def _start_over(run_dir: Path, policy: Type[Any], cfg: EasyDict) -> EasyDict:
    """Empty ``run_dir`` of a start that left no checkpoint (its ``log.txt`` kept) and save ``cfg`` in it."""
    failed = run_dir / FAILED_FILE
    why = f" ({failed.read_text().strip()})" if failed.is_file() else ""
    log.warning("run '%s' stopped before its first checkpoint%s: it starts over", run_dir.name, why)
    for path in run_dir.iterdir():
        if path.name == LOG_FILE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    _write_config(run_dir, policy, cfg)
    return cfg


def _write_config(run_dir: Path, policy: Type[Any], cfg: EasyDict) -> None:
    path = run_dir / CONFIG_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"policy": policy.__name__, "config": cfg}, indent=2) + "\n")
    except OSError as exc:
        raise CheckpointError("write", path, exc, what="run config") from exc


def read_run_config(run_dir: Path) -> Dict[str, Any]:
    """What a run saved in its ``config.json``: ``{"policy": <policy class name>, "config": <compiled config>}``.

    A missing file is a ``FileNotFoundError``, an unreadable one a :class:`RunDirError`, each naming the path.
    """
    path = Path(run_dir) / CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a run directory (runs/<exp-name>)?") from None
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path} is unreadable ({' '.join(str(exc).split())})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise RunDirError(f"{path} is not a run's config: it has no 'config' section")
    return saved


def check_layout(run_dir: Path, distributed: bool) -> None:
    """Refuse to resume the run in ``run_dir`` in another layout than the one its checkpoint was trained in:
    in one process, or distributed (then the run has a ``nodes.json``). A run with no checkpoint fits any."""
    nodes = run_dir / NODES_FILE
    if not (run_dir / "ckpt" / LATEST).is_file() or nodes.is_file() == distributed:
        return
    if distributed:
        raise RunDirError(f"cannot resume '{run_dir.name}' as a distributed run: it was trained in one process "
                          f"({run_dir} has no {NODES_FILE}); resume it without --collectors and --evaluators")
    try:
        rows = [row["roles"] for row in json.loads(nodes.read_text())]
        collectors = sum("collector" in roles for roles in rows)
        evaluators = sum(roles == ["evaluator"] for roles in rows)  # the learner also evaluates when none does
        flags = f"--collectors {collectors}" + (f" --evaluators {evaluators}" if evaluators else "")
        layout = f"1 learner and {collectors} collector{'s' * (collectors != 1)}" + \
            (f" and {evaluators} evaluator{'s' * (evaluators != 1)}" if evaluators else "")
    except (OSError, ValueError, TypeError, KeyError):
        flags, layout = "--collectors N as it was started", "a distributed run"
    raise RunDirError(f"cannot resume '{run_dir.name}' in one process: it was trained as {layout} ({nodes}); "
                      f"resume it with {flags}")


def config_differences(saved: Any, given: Any, path: str = "") -> List[str]:
    """``"policy.learn.learning_rate: saved 0.003, given 0.002"`` for each leaf where two configs differ."""
    if isinstance(saved, dict) and isinstance(given, dict):
        return [line for key in sorted(set(saved) | set(given), key=str)
                for line in config_differences(saved.get(key, _MISSING), given.get(key, _MISSING),
                                               f"{path}.{key}" if path else str(key))]
    if saved == given:
        return []
    return [f"{path}: saved {_shown(saved)}, given {_shown(given)}"]


_MISSING = object()


def _shown(value: Any) -> str:
    return "nothing" if value is _MISSING else json.dumps(value)


def _leaves(lines: List[str], most: int = 3) -> str:
    return "; ".join(lines[:most]) + (f"; and {len(lines) - most} more" if len(lines) > most else "")


def _saved_config(run_dir: Path, policy: Type[Any], given: Optional[EasyDict], seed: Optional[int],
                  distributed: bool) -> EasyDict:
    latest = run_dir / "ckpt" / LATEST
    path = run_dir / CONFIG_FILE
    if not latest.is_file() and not path.is_file():
        raise FileNotFoundError(f"cannot resume '{run_dir.name}': no checkpoint at {latest}; start without "
                                f"--resume, or pass the --exp-name of an earlier run")
    try:
        saved = read_run_config(run_dir)
    except FileNotFoundError:
        raise FileNotFoundError(f"cannot resume '{run_dir.name}': {path} is missing (a run from an older "
                                f"version?); start a new run") from None
    except RunDirError as exc:
        raise RunDirError(f"cannot resume '{run_dir.name}': {exc}") from None
    if saved.get("policy") != policy.__name__:
        raise RunDirError(f"cannot resume '{run_dir.name}' with {policy.__name__}: it is a {saved.get('policy')} "
                          f"run; resume it with its own entry, or choose another --exp-name")
    check_layout(run_dir, distributed=distributed)
    if not latest.is_file():  # a failed or killed start: nothing to resume, so any config given goes
        raw = EasyDict(saved["config"]) if given is None else given
        return _start_over(run_dir, policy, compile_config(raw if seed is None else EasyDict(raw, seed=seed),
                                                           policy=policy))
    cfg = compile_config(EasyDict(saved["config"]), policy=policy)
    if seed is not None and seed != cfg.seed:
        raise RunDirError(f"--seed {seed} differs from the seed {cfg.seed} of run '{run_dir.name}': leave --seed "
                          f"out to resume it")
    if given is not None:  # the same command line resumes: its seed was checked above, the rest must agree
        differ = config_differences(json.loads(json.dumps(cfg)),
                                    json.loads(json.dumps(compile_config(EasyDict(given, seed=cfg.seed),
                                                                         policy=policy))))
        differ = [line for line in differ if not line.startswith(("policy.device:", "transport:"))]
        if differ:
            raise RunDirError(f"the config given differs from the one run '{run_dir.name}' saved in {path} "
                              f"({_leaves(differ)}): resume without a config, or start a new run")
        if "device" in given.get("policy", {}):  # a run may move between devices: its checkpoints load on any
            cfg.policy.device = given.policy.device
        cfg.transport = given.get("transport", cfg.transport)  # how batches travel: the run's data are the same
    return cfg
