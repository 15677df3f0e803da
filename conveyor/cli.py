"""The ``conveyor`` command: train a zoo entry, or list them.

    conveyor train cartpole/dqn [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]
                                [--ckpt-interval SECONDS]
    conveyor list

Bad usage, bad input and disk errors print one line saying what is wrong and how to fix it, and exit with
code 2; an env or evaluation that keeps crashing exits with 1. Ctrl-C (SIGINT) or SIGTERM finish the
iteration in progress, write ``final.pth.tar`` and ``latest.pth.tar`` and exit with 130 / 143; a second
Ctrl-C stops at once.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Reinforcement learning as a pipeline of middleware.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
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
    commands.add_parser("list", help="list the zoo entries")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``conveyor`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError, entries, load_entry

    if args.command == "list":
        print("\n".join(entries()))
        return 0
    if args.max_env_step is not None and args.max_env_step <= 0:
        return _usage_error(f"--max-env-step must be > 0, got {args.max_env_step}")
    if not args.ckpt_interval > 0:
        return _usage_error(f"--ckpt-interval must be a number of seconds > 0, got {args.ckpt_interval}")
    from conveyor.envs import EnvCrashedError
    from conveyor.middleware import EvaluationError
    from conveyor.zoo._online import RunDirError, TrainingInterrupted

    try:
        entry = load_entry(args.entry)
        ctx = entry.main(seed=args.seed, exp_name=args.exp_name, max_env_step=args.max_env_step, resume=args.resume,
                         async_mode=args.async_mode, progress=args.progress, ckpt_interval=args.ckpt_interval)
    except TrainingInterrupted as stop:
        print(f"conveyor: {stop}", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print("conveyor: stopped at once by a second interrupt; the last latest.pth.tar is kept", file=sys.stderr)
        return 130
    except (UnknownEntryError, ConfigError, RunDirError, FileNotFoundError) as exc:
        return _usage_error(_message(exc))
    except OSError as exc:  # disk errors: the path and the cause
        return _usage_error(_os_message(exc))
    except (EnvCrashedError, EvaluationError) as exc:
        print(f"conveyor: error: {_message(exc)}", file=sys.stderr)
        return 1
    print(f"done: env_step={ctx.env_step} train_iter={ctx.train_iter} last_eval_return={ctx.last_eval_value}")
    return 0


def _message(exc: BaseException) -> str:
    """The exception's own sentence (``str()`` of a LookupError would wrap it in quotes)."""
    return exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)


def _os_message(exc: OSError) -> str:
    """One line naming the path and the cause (``CheckpointError`` already says both)."""
    if type(exc).__str__ is not OSError.__str__:
        return str(exc)
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def _usage_error(message: str) -> int:
    print(f"conveyor: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
