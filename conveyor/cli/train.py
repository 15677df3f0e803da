"""``conveyor train``: train a zoo entry or a user's entry file.

    conveyor train cartpole/dqn [--set KEY=VALUE ...] [--config FILE] [--seed N] [--exp-name NAME] [--resume]
                                [--device cpu|cuda] [--async] [--max-env-step N] [--max-train-iter N]
                                [--ckpt-interval SECONDS] [--no-stop] [--resume-if-exists] [--dataset-dir DIR]
    conveyor train my_entry.py ...        # a file with a main_config and a main(), run like a zoo entry

The config is the entry's ``main_config``, then the ``--config`` file's values on top, then each ``--set``;
the entry validates the result like any config. Training ends with one line saying why it stopped (solved,
budget reached, interrupted) and where the run is. An env or evaluation that keeps crashing exits with 1.
Ctrl-C (SIGINT) or SIGTERM finish the iteration in progress, write ``final.pth.tar`` and ``latest.pth.tar``
and exit with 130 / 143; a second Ctrl-C stops at once.
"""
from __future__ import annotations

import argparse
import inspect
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Tuple

from conveyor.cli import _distributed as distributed
from conveyor.cli._common import message, number, os_message, usage_error
from conveyor.cli._ray_local import ClusterStartError

__all__ = ["register", "run", "trained", "stop_reason", "CKPT_INTERVAL"]

CKPT_INTERVAL = 300.0
"""Seconds between the wall-clock ``latest.pth.tar`` writes of ``conveyor train`` unless ``--ckpt-interval`` says."""


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``train`` subcommand."""
    train = commands.add_parser("train", help="train a zoo entry (e.g. cartpole/dqn) or your own entry file",
                                description="Train a zoo entry, or a .py file with a main_config and a main(); logs "
                                            "and checkpoints go under runs/<exp-name>/.")
    train.add_argument("entry", help="zoo entry as <env>/<algo> (any case; `conveyor list` shows them), or the path of "
                                     "a .py file holding main_config and main()")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config value, e.g. --set policy.learn.learning_rate=3e-4 (repeatable; the "
                            "value is read as the key's type)")
    train.add_argument("--config", default=None, metavar="FILE",
                       help="a .yaml, .json or .py (main_config) file whose values go over the entry's config; "
                            "a run's config.json works too")
    train.add_argument("--dataset-dir", default=None, metavar="DIR",
                       help="an offline entry: the folder its dataset was written to (conveyor collect --dataset-dir; "
                            "sets policy.other.dataset.dir; default $MINARI_DATASETS_PATH, else ~/.minari/datasets)")
    train.add_argument("--seed", type=int, default=None, help="seed (default: the entry's config)")
    train.add_argument("--exp-name", default=None, help="run name (default: the entry's config)")
    train.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="where the learner's policy runs (sets policy.device; default: the entry's config; with "
                            "--resume, moves the run there)")
    train.add_argument("--max-env-step", type=int, default=None,
                       help="stop after this many env steps in total (a resumed run counts the steps before it)")
    train.add_argument("--max-train-iter", type=int, default=None,
                       help="stop after this many gradient steps in total")
    train.add_argument("--resume", action="store_true",
                       help="continue runs/<exp-name> from its saved config and ckpt/latest.pth.tar (exactly where "
                            "it stopped; --set, --config and --seed, if given, must agree with it); without it, a "
                            "name that already holds a run is an error")
    train.add_argument("--resume-if-exists", dest="resume_if_exists", action="store_true",
                       help="--resume when runs/<exp-name> holds a run (its config.json), else start it: for a job "
                            "the scheduler may start again (sbatch --requeue, a restarted pod)")
    train.add_argument("--ckpt-interval", type=float, default=None, metavar="SECONDS",
                       help=f"also write latest.pth.tar every this many seconds of wall-clock time (default "
                            f"{CKPT_INTERVAL:g})")
    train.add_argument("--async", dest="async_mode", action="store_true",
                       help="overlap collection of the next iteration with training on this one")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    train.add_argument("--no-stop", dest="no_stop", action="store_true",
                       help="train past env.stop_value: only a budget (--max-env-step, --max-train-iter) ends the run")
    distributed.add_arguments(train)
    train.set_defaults(run=run, evaluation_hook=None)  # no flag: conveyor tune sets it (conveyor.run.Run's option)


def run(args: argparse.Namespace) -> int:
    """Train the entry; returns the exit code."""
    return trained(args)[0]


def trained(args: argparse.Namespace) -> Tuple[int, Any]:
    """Train the entry as :func:`run` does (its lines, its exit code); returns the exit code and the run's final
    context (a :class:`~conveyor.run.DistributedRun` for ``--collectors``; an interrupted run's as it stopped;
    ``None`` where it failed). ``args.evaluation_hook``, if set, is the :class:`~conveyor.run.Run`'s."""
    for flag, value in (("--max-env-step", args.max_env_step), ("--max-train-iter", args.max_train_iter)):
        if value is not None and value <= 0:
            return usage_error(f"{flag} must be > 0, got {value}"), None
    if args.ckpt_interval is not None and not args.ckpt_interval > 0:
        return usage_error(f"--ckpt-interval must be a number of seconds > 0, got {args.ckpt_interval}"), None
    with distributed.started_ahead(args):  # a distributed run's zygote imports torch while this process does
        return _train(args)


def _train(args: argparse.Namespace) -> Tuple[int, Any]:
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return usage_error("--device cuda: torch sees no CUDA device on this machine; use --device cpu"), None
    from conveyor.engine.parallel.runner import RemoteTraceback, WorkerError
    from conveyor.envs import EnvCrashedError
    from conveyor.middleware import EvaluationError
    from conveyor.middleware.inference import InferenceServerLost
    from conveyor.policy import DataParallelError
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError, load_entry
    from conveyor.run import RunDirError, TrainingInterrupted
    from conveyor.run.directory import CONFIG_FILE, run_directory

    try:
        entry = load_entry(args.entry)
        cfg = _config(entry, args)
        run_dir = run_directory(cfg if cfg is not None else entry.main_config, args.exp_name)
        if args.resume_if_exists:  # a run that stopped before its first checkpoint starts over from its config
            args.resume = args.resume or (run_dir / CONFIG_FILE).is_file()
        if args.resume and args.device is not None and args.config is None and not args.overrides \
                and args.dataset_dir is None:
            cfg = _saved_on(run_dir, args.device)
        if distributed.requested(args):  # learner, collectors and evaluators as processes (cli/_distributed.py)
            ctx = distributed.train(args, cfg)
        else:
            ctx = entry.main(cfg, **_keywords(entry, args))
    except TrainingInterrupted as stop:
        written = "final and latest checkpoints written" if stop.final else "the learner ended without its final " \
                  "checkpoint (its log.txt says why); its last latest.pth.tar, if any, is kept"
        print(f"conveyor: interrupted by {signal.Signals(stop.signum).name}{_stopped_at(stop.ctx)}; {written}, "
              f"continue with --resume; run directory {run_dir}", file=sys.stderr)
        return 128 + stop.signum, stop.ctx
    except KeyboardInterrupt:
        print("conveyor: stopped at once by a second interrupt; the last latest.pth.tar is kept", file=sys.stderr)
        return 130, None
    except (UnknownEntryError, ConfigError, RunDirError, FileNotFoundError) as exc:
        return usage_error(message(exc)), None
    except OSError as exc:  # disk errors: the path and the cause
        return usage_error(os_message(exc)), None
    except (EnvCrashedError, EvaluationError, DataParallelError, ClusterStartError,
            InferenceServerLost) as exc:  # faults, not usage
        print(f"conveyor: error: {message(exc)}", file=sys.stderr)
        return 1, None
    except WorkerError as exc:  # a node died; the others ended their runs without it (docs/distributed.md)
        if isinstance(exc.__cause__, RemoteTraceback):  # a node's exception that does not unpickle here: a bug
            raise
        print(f"conveyor: error: {message(exc)}; run directory {run_dir}", file=sys.stderr)
        return 1, None
    used = _used_config(run_dir, cfg, entry)
    max_train_iter = args.max_train_iter or used.get("policy", {}).get("learn", {}).get("max_train_iter")
    stop_value = None if args.no_stop else used.get("env", {}).get("stop_value")  # --no-stop: not what ended it
    print(f"{stop_reason(ctx, stop_value, args.max_env_step, max_train_iter)}; "
          f"run directory {run_dir}")
    return 0, ctx


def stop_reason(ctx: Any, stop_value: Optional[float], max_env_step: Optional[int] = None,
                max_train_iter: Optional[int] = None) -> str:
    """Why a run whose final context is ``ctx`` stopped: solved, a budget reached, or neither."""
    last = ctx.last_eval_value
    at = _position(ctx)
    if last is not None and stop_value is not None and last >= stop_value:
        return f"solved: eval {number(last)} >= stop value {number(stop_value)} at {at}"
    target = "" if stop_value is None else f" (stop value {number(stop_value)})"
    if max_env_step is not None and ctx.env_step >= max_env_step:
        return f"budget reached: env step {ctx.env_step} of --max-env-step {max_env_step}; last eval " \
               f"{number(last)}{target}"
    if max_train_iter is not None and ctx.train_iter >= max_train_iter:
        return f"budget reached: train iter {ctx.train_iter} of max_train_iter {max_train_iter}; last eval " \
               f"{number(last)}{target}"
    where = f"env step {ctx.env_step}, train iter {ctx.train_iter}" if hasattr(ctx, "env_step") else at
    return f"stopped at {where}; last eval {number(last)}{target}"


def _config(entry: ModuleType, args: argparse.Namespace) -> Optional[Any]:
    """The entry's config with ``--config``, ``--set`` and ``--device`` applied; ``None`` when none is given
    (the entry then uses its own, or on ``--resume`` the run's saved one)."""
    from conveyor.config import apply_overrides, load_config_file, merge_config

    from conveyor.run.nodes import is_offline
    from conveyor.schema import ConfigError

    if args.config is None and not args.overrides and args.device is None and args.dataset_dir is None:
        return None
    cfg = entry.main_config
    if args.config is not None:
        cfg = merge_config(cfg, load_config_file(args.config))
    overrides = list(args.overrides)
    if args.device is not None:
        overrides.append(f"policy.device={args.device}")
    cfg = apply_overrides(cfg, overrides)
    if args.dataset_dir is not None:
        if not is_offline(cfg):
            raise ConfigError(f"--dataset-dir: {args.entry} trains online and reads no dataset; it is for offline "
                              f"entries such as cartpole/bc")
        cfg.policy.other.dataset.dir = args.dataset_dir  # as written: a folder name is no literal to read
    return cfg


def _saved_on(run_dir: Path, device: str) -> Optional[Any]:
    """``--resume --device D`` with no other config: the run's saved config (``None``: the entry reads it), moved
    to ``D`` where it trained elsewhere (its checkpoints load on any device). The entry's own config with ``D``
    would differ from that of a run started with ``--set``."""
    from conveyor.run.directory import CONFIG_FILE, read_run_config

    if not (run_dir / CONFIG_FILE).is_file():
        return None  # nothing to resume: the entry says so
    saved = read_run_config(run_dir)["config"]
    if str(saved.get("policy", {}).get("device", "cpu")).split(":")[0] == device:
        return None
    saved["policy"]["device"] = device
    return saved


_KEYWORDS = (("seed", "--seed"), ("exp_name", "--exp-name"), ("max_env_step", "--max-env-step"),
             ("max_train_iter", "--max-train-iter"), ("resume", "--resume"), ("async_mode", "--async"),
             ("progress", "--no-progress"), ("ckpt_interval", "--ckpt-interval"), ("no_stop", "--no-stop"))


def _keywords(entry: ModuleType, args: argparse.Namespace) -> dict:
    """The keyword arguments of ``entry.main`` the command line sets; one it cannot take is a ConfigError."""
    from conveyor.schema import ConfigError

    defaults = {"seed": None, "exp_name": None, "max_env_step": None, "max_train_iter": None, "resume": False,
                "async_mode": False, "progress": True, "ckpt_interval": None, "no_stop": False}
    given = {name: getattr(args, name) for name, _ in _KEYWORDS if getattr(args, name) != defaults[name]}
    if args.evaluation_hook is not None:
        given["evaluation_hook"] = args.evaluation_hook
    parameters = inspect.signature(entry.main).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if takes_any or "ckpt_interval" in parameters:
        given.setdefault("ckpt_interval", CKPT_INTERVAL)
    if not takes_any:
        for name, flag in (*_KEYWORDS, ("evaluation_hook", "conveyor tune --pruner")):
            if name in given and name not in parameters:
                raise ConfigError(f"{flag}: {args.entry} has a main() without the keyword argument {name}=; an "
                                  f"entry's main is main(cfg=None, *, seed=None, exp_name=None, max_env_step=None, "
                                  f"max_train_iter=None, resume=False, async_mode=False, progress=True, "
                                  f"ckpt_interval=None)")
    return given


def _position(ctx: Any) -> str:
    """Where a run is: its env step, or its train iteration in an offline run (which takes no env steps)."""
    return f"env step {ctx.env_step}" if hasattr(ctx, "env_step") else f"train iter {ctx.train_iter}"


def _stopped_at(ctx: Any) -> str:
    """`` at <position> (last eval R)`` for an interrupted run; nothing where its counters are not known here (the
    driver of a Ray run, whose learner ran in an actor)."""
    if getattr(ctx, "env_step", 0) is None or getattr(ctx, "train_iter", 0) is None:
        return ""
    return f" at {_position(ctx)} (last eval {number(ctx.last_eval_value)})"


def _used_config(run_dir: Path, cfg: Optional[Any], entry: ModuleType) -> Any:
    """The config the run used: its saved one, else the one it was given."""
    from conveyor.run import RunDirError
    from conveyor.run.directory import read_run_config
    try:
        return read_run_config(run_dir)["config"]
    except (FileNotFoundError, RunDirError):
        return cfg if cfg is not None else entry.main_config
