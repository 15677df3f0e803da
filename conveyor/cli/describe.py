"""``conveyor describe``: a pipeline as a table, without training.

    conveyor describe cartpole/dqn
    conveyor describe my_entry.py

The entry's ``main()`` builds its pipeline in a temporary folder and stops before the first iteration
(``task.inspecting()``); the table lists each middleware, the context fields it reads and writes and its
role. A pipeline whose order does not fit the declared fields is listed with its problems and exits with 2.
"""
from __future__ import annotations

import argparse

from conveyor.cli._common import message, os_message, usage_error

__all__ = ["register", "run"]


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``describe`` subcommand."""
    describe = commands.add_parser("describe", help="show a pipeline's middleware and the context fields they use",
                                   description="Build a zoo entry's or a FILE.py's pipeline without training and "
                                               "print each middleware with the context fields it reads and "
                                               "writes (? = may be unset, after: = after its yield) and its role.")
    describe.add_argument("entry", help="zoo entry as <env>/<algo> (`conveyor list`), or a FILE.py with a main()")
    describe.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the table; returns the exit code."""
    from conveyor.schema import ConfigError
    from conveyor.testing import inspect_main
    from conveyor.zoo import UnknownEntryError

    try:
        label, found = inspect_main(args.entry)
    except (UnknownEntryError, ConfigError, FileNotFoundError, TypeError) as exc:
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    except Exception as exc:  # the user's main failed while building its pipeline
        return usage_error(f"building the pipeline of {args.entry} failed: {type(exc).__name__}: {message(exc)}")
    if found.table is None:
        return usage_error(f"{label}: main() returned without calling task.run(), so there is no pipeline to describe")
    print(found.table)
    if found.table.problems:
        return usage_error(f"{label}: {len(found.table.problems)} problem(s) in the order of the pipeline (above)")
    return 0
