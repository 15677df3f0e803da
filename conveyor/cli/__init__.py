"""The ``conveyor`` command. Each subcommand lives in its own module of this package, which adds its parser
with ``register(commands)`` and handles it with the ``run(args) -> int`` it sets as the parser's default (the job
subcommands ``slurm-script`` and ``k8s-manifest`` through :func:`conveyor.cli._jobs.add_job_parser`).

Bad usage, bad input and disk errors print one line saying what is wrong and how to fix it, and exit with
code 2 (see :mod:`conveyor.cli._common`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, NoReturn, Optional

__all__ = ["main", "parser"]

COMMANDS = ("train", "tune", "listing", "eval", "export", "plot", "report", "collect", "describe", "task",
            "slurm_script", "k8s_manifest")
"""The modules of this package that define a subcommand, in the order ``--help`` lists them."""


class _Parser(argparse.ArgumentParser):
    """argparse, with bad usage reported in one line (``conveyor: error: ...``) like every other error."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        self.exit(2, f"conveyor: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    """The ``conveyor`` argument parser with every subcommand (``conveyor.cli.docs`` renders it as docs/cli.md)."""
    top = _Parser(prog="conveyor", description="Reinforcement learning as a pipeline of middleware.")
    top.add_argument("--version", action="version", version=f"conveyor {_version()}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"conveyor.cli.{name}").register(commands)
    return top


def _version() -> str:
    """The installed package's version (its metadata), or a note that it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("conveyor")
    except PackageNotFoundError:
        return "(not installed: pip install -e . for its version)"


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``conveyor`` console script; returns the exit code (also for ``--help``, ``--version``
    and bad usage, which argparse ends with ``SystemExit``)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
