"""``conveyor list``: the zoo entries."""
from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``list`` subcommand."""
    commands.add_parser("list", help="list the zoo entries").set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print one zoo entry per line."""
    from conveyor.zoo import entries
    print("\n".join(entries()))
    return 0
