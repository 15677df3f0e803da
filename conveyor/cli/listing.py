"""``conveyor list``: the zoo entries as a table of env id, algorithm and the stop value each trains to."""
from __future__ import annotations

import argparse
from types import ModuleType

from conveyor.cli._common import number

__all__ = ["register", "run"]


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``list`` subcommand."""
    commands.add_parser("list", help="list the zoo entries", description="List the zoo entries: name, env id, "
                        "algorithm and the stop value (mean eval return) training ends at.").set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print one zoo entry per row."""
    from conveyor.zoo import entries, load_entry

    rows = [("ENTRY", "ENV", "ALGORITHM", "STOP VALUE")]
    for name in entries():
        entry = load_entry(name)
        env = entry.main_config.get("env", {})
        stop = env.get("stop_value")
        rows.append((name, env.get("env_id", "-").rpartition(":")[2], _algorithm(name, entry),
                     "-" if stop is None else number(stop)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _algorithm(name: str, entry: ModuleType) -> str:
    """The algorithm as the entry's docstring names it ("Recurrent PPO (GRU core) on ..."), else from its name."""
    first = (entry.__doc__ or "").strip().splitlines()[0] if entry.__doc__ else ""
    described, sep, _ = first.partition(" on ")
    return described if sep and len(described) <= 32 else name.rpartition("/")[2].upper()
