"""``conveyor train``: train a zoo entry.

    conveyor train cartpole/dqn [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
                                [--ckpt-interval SECONDS]

An env or evaluation that keeps crashing exits with 1. Ctrl-C (SIGINT) or SIGTERM finish the iteration in
progress, write ``final.pth.tar`` and ``latest.pth.tar`` and exit with 130 / 143; a second Ctrl-C stops at once.
"""
from __future__ import annotations

import argparse
import sys

from conveyor.cli import _distributed as distributed
from conveyor.cli._common import message, os_message, usage_error

__all__ = ["register", "run"]


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``train`` subcommand."""
    train = commands.add_parser("train", help="train a zoo entry, e.g. cartpole/dqn",
                                description="Train a zoo entry; logs and checkpoints go under runs/<exp-name>/.")
    train.add_argument("entry", help="zoo entry as <env>/<algo>; `conveyor list` shows them")
    train.add_argument("--seed", type=int, default=None, help="seed (default: the entry's config)")
    train.add_argument("--exp-name", default=None, help="run name (default: the entry's config)")
    train.add_argument("--max-env-step", type=int, default=None,
                       help="stop after this many env steps in total (a resumed run counts the steps before it)")
    train.add_argument("--resume", action="store_true",
                       help="continue runs/<exp-name> from its saved config and ckpt/latest.pth.tar (exactly where "
                            "it stopped); without it, a name that already holds a run is an error")
    train.add_argument("--ckpt-interval", type=float, default=300.0, metavar="SECONDS",
                       help="also write latest.pth.tar every this many seconds of wall-clock time (default 300)")
    train.add_argument("--async", dest="async_mode", action="store_true",
                       help="overlap collection of the next iteration with training on this one")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    distributed.add_arguments(train)
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Train the entry; returns the exit code."""
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError, load_entry

    if args.max_env_step is not None and args.max_env_step <= 0:
        return usage_error(f"--max-env-step must be > 0, got {args.max_env_step}")
    if not args.ckpt_interval > 0:
        return usage_error(f"--ckpt-interval must be a number of seconds > 0, got {args.ckpt_interval}")
    from conveyor.envs import EnvCrashedError
    from conveyor.middleware import EvaluationError
    from conveyor.zoo._online import RunDirError, TrainingInterrupted

    try:
        if distributed.requested(args):  # learner, collectors and evaluators as processes (cli/_distributed.py)
            ctx = distributed.train(args)
        else:
            entry = load_entry(args.entry)
            ctx = entry.main(seed=args.seed, exp_name=args.exp_name, max_env_step=args.max_env_step,
                             resume=args.resume, async_mode=args.async_mode, progress=args.progress,
                             ckpt_interval=args.ckpt_interval)
    except TrainingInterrupted as stop:
        print(f"conveyor: {stop}", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print("conveyor: stopped at once by a second interrupt; the last latest.pth.tar is kept", file=sys.stderr)
        return 130
    except (UnknownEntryError, ConfigError, RunDirError, FileNotFoundError) as exc:
        return usage_error(message(exc))
    except OSError as exc:  # disk errors: the path and the cause
        return usage_error(os_message(exc))
    except (EnvCrashedError, EvaluationError) as exc:
        print(f"conveyor: error: {message(exc)}", file=sys.stderr)
        return 1
    print(f"done: env_step={ctx.env_step} train_iter={ctx.train_iter} last_eval_return={ctx.last_eval_value}")
    return 0
