"""docs/cli.md's reference parts, rendered from the ``conveyor`` parser so that the page cannot go stale.

    python -m conveyor.cli.docs            # rewrite the generated parts of docs/cli.md in place
    python -m conveyor.cli.docs --check    # exit 1 if docs/cli.md is not what the parser renders now

The page is hand-written prose around marked parts: between ``<!-- cli: commands -->`` (the table of
subcommands) or ``<!-- cli: NAME -->`` (one subcommand's synopsis and options) and ``<!-- end cli -->``, the
text is replaced by what :func:`render` makes of the parser; everything else is kept as written.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["render", "regenerate", "subcommands", "main", "PAGE"]

PAGE = Path("docs") / "cli.md"
"""The page, relative to the repository root."""

_PART = re.compile(r"^<!-- cli: ([a-z0-9-]+) -->\n.*?^<!-- end cli -->$", re.MULTILINE | re.DOTALL)


def subcommands(top: Optional[argparse.ArgumentParser] = None) -> Dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser by name, in the order ``conveyor --help`` lists them."""
    from conveyor.cli import parser

    top = top or parser()
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise ValueError("the parser has no subcommands")


def _summaries(top: argparse.ArgumentParser) -> Dict[str, str]:
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _invocation(action: argparse.Action) -> str:
    """How the argument is written: ``--set KEY=VALUE``, ``--device {cpu,cuda}``, ``RUN_DIR [RUN_DIR ...]``."""
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    name = _metavar(action)
    value = {None: name, "?": f"[{name}]", "*": f"[{name} ...]", "+": f"{name} [{name} ...]"}.get(
        action.nargs, " ".join([name] * action.nargs) if isinstance(action.nargs, int) else name)
    return f"{', '.join(action.option_strings)} {value}" if action.option_strings else value


def _meaning(action: argparse.Action, prog: str) -> str:
    text = (action.help or "") % {**vars(action), "prog": prog}
    if action.required and action.option_strings:
        text = f"(required) {text}"
    return _markdown(text)


def _markdown(text: str) -> str:
    """Help text as Markdown: one line, with ``<exp-name>`` and ``a|b`` shown as written."""
    return " ".join(text.split()).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _table(actions: List[argparse.Action], prog: str) -> List[str]:
    rows = ["| argument | meaning |", "| --- | --- |"]
    rows += [f"| `{_invocation(a)}` | {_meaning(a, prog)} |" for a in actions]
    return rows


def _command(sub: argparse.ArgumentParser) -> str:
    """One subcommand: its synopsis, its description and a table of its arguments per group."""
    shown = [a for a in sub._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    synopsis = [sub.prog] + ["[options]"] * any(a.option_strings for a in shown)
    synopsis += [_invocation(a) for a in shown if not a.option_strings]
    lines = ["```", " ".join(synopsis), "```", "", _markdown(sub.description or "")]
    own = [a for a in shown if a in sub._positionals._group_actions + sub._optionals._group_actions]
    if own:
        lines += [""] + _table(own, sub.prog)
    for group in sub._action_groups:
        if group in (sub._positionals, sub._optionals):
            continue
        members = [a for a in group._group_actions if a in shown]
        if members:
            lines += ["", f"*{group.title}*", ""] + _table(members, sub.prog)
    return "\n".join(lines)


def render(part: str, top: Optional[argparse.ArgumentParser] = None) -> str:
    """The generated text of a marked part: ``commands`` (every subcommand with its one-line help) or a
    subcommand's name."""
    from conveyor.cli import parser

    top = top or parser()
    subs = subcommands(top)
    if part == "commands":
        rows = ["| command | what it does |", "| --- | --- |"]
        rows += [f"| [`conveyor {name}`](#conveyor-{name}) | {_markdown(help_)} |"
                 for name, help_ in _summaries(top).items()]
        return "\n".join(rows)
    if part not in subs:
        raise ValueError(f"docs/cli.md marks an unknown part '{part}': the parts are commands, {', '.join(subs)}")
    return _command(subs[part])


def regenerate(text: str, top: Optional[argparse.ArgumentParser] = None) -> str:
    """``text`` (docs/cli.md) with every marked part rendered anew."""
    from conveyor.cli import parser

    top = top or parser()
    return _PART.sub(lambda m: f"<!-- cli: {m.group(1)} -->\n{render(m.group(1), top)}\n<!-- end cli -->", text)


def main(argv: Optional[List[str]] = None) -> int:
    """Rewrite docs/cli.md (``--check``: only say whether it is current); returns the exit code."""
    options = argparse.ArgumentParser(prog="python -m conveyor.cli.docs", description=__doc__.splitlines()[0])
    options.add_argument("page", nargs="?", default=str(PAGE), help=f"the page to regenerate (default {PAGE})")
    options.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page is stale")
    args = options.parse_args(argv)
    path = Path(args.page)
    try:
        old = path.read_text()
    except OSError as exc:
        print(f"conveyor.cli.docs: cannot read {path} ({exc.strerror}): run it from the repository root",
              file=sys.stderr)
        return 2
    new = regenerate(old)
    if new == old:
        print(f"{path} is current")
        return 0
    if args.check:
        print(f"{path} is stale: run python -m conveyor.cli.docs", file=sys.stderr)
        return 1
    path.write_text(new)
    print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
