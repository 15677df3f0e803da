"""The ``conveyor`` command. Each subcommand lives in its own module of this package, which adds its parser
with ``register(commands)`` and handles it with the ``run(args) -> int`` it sets as the parser's default.

Bad usage, bad input and disk errors print one line saying what is wrong and how to fix it, and exit with
code 2 (see :mod:`conveyor.cli._common`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

__all__ = ["main"]

COMMANDS = ("train", "listing", "task")
"""The modules of this package that define a subcommand, in the order ``--help`` lists them."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Reinforcement learning as a pipeline of middleware.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"conveyor.cli.{name}").register(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``conveyor`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
