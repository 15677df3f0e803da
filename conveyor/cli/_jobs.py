"""What ``conveyor slurm-script`` and ``conveyor k8s-manifest`` share: the layout options of a job, their checks,
and the ``conveyor train`` command every node of the job runs (``--launcher slurm|kubernetes``, cli/_distributed.py).

The command resumes the run when the scheduler starts the job again (``--resume-if-exists``: a requeued Slurm
job, a Job re-applied after a failure), and each node reads its rank from the scheduler, so one command serves
every node: node 0 the learner, 1..C the collectors, then the evaluators (``conveyor.run.Layout``).
"""
from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, List

from conveyor.cli._common import message, usage_error

__all__ = ["add_job_parser", "checked_layout", "default_exp_name", "print_job", "train_command"]


def print_job(write: Callable[[argparse.Namespace], str], args: argparse.Namespace) -> int:
    """Print the job ``write(args)`` writes (an sbatch script, a manifest); bad input is one line and exit code 2."""
    try:
        text = write(args)
    except ValueError as exc:
        return usage_error(message(exc))
    print(text, end="")
    return 0


def add_job_parser(commands: "argparse._SubParsersAction", name: str, write: Callable[[argparse.Namespace], str], *,
                   help: str, description: str, exp_name_help: str) -> argparse.ArgumentParser:
    """Add the job subcommand ``name``, which prints what ``write(args)`` writes (:func:`print_job`): its parser with
    the entry, the layout (``--learners``, ``--collectors``, ``--evaluators``), what the run is given (``--set``,
    ``--seed``, ``--max-env-step``, ``--ckpt-interval``, ``--peer-timeout``, ``--port``) and ``--exp-name``;
    returns it for the options of that scheduler alone."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.set_defaults(run=functools.partial(print_job, write))
    parser.add_argument("entry", help="zoo entry as <env>/<algo> (`conveyor list` shows them), or an entry file's "
                                      "path as the nodes see it")
    parser.add_argument("--learners", type=int, default=1, metavar="L",
                        help="data-parallel learner processes (default 1): nodes 0..L-1, then the collectors and "
                             "evaluators, L + C + M nodes in all")
    parser.add_argument("--collectors", type=int, required=True, metavar="C",
                        help="collector processes (nodes L..L+C-1, after the learners); the job has L + C + M nodes")
    parser.add_argument("--evaluators", type=int, default=0, metavar="M",
                        help="evaluator processes (the last M nodes; default 0, as for conveyor train: the learner "
                             "evaluates)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to conveyor train: override one config value (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="passed to conveyor train (default: the entry's)")
    parser.add_argument("--max-env-step", type=int, default=None, metavar="N",
                        help="passed to conveyor train: stop after N env steps in total")
    parser.add_argument("--ckpt-interval", type=float, default=None, metavar="SECONDS",
                        help="passed to conveyor train: write latest.pth.tar every this many seconds (default 300), "
                             "the most a lost node or a preemption costs")
    parser.add_argument("--peer-timeout", type=float, default=None, metavar="SECONDS",
                        help="passed to conveyor train: how long a node tolerates a silent peer before it is lost "
                             "(default 5)")
    parser.add_argument("--port", type=int, default=None, metavar="P",
                        help="node r listens on port P + r (default 29650)")
    parser.add_argument("--exp-name", default=None, metavar="NAME", help=exp_name_help)
    return parser


def checked_layout(args: argparse.Namespace) -> Any:
    """The job's :class:`~conveyor.run.Layout`, after the entry, the layout and the budget are checked;
    ``ValueError`` (a ``ConfigError`` or the entry's ``UnknownEntryError`` as a ValueError) with one line."""
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError, load_entry
    from conveyor.run import Layout
    from conveyor.run.nodes import check_learners, check_peer_timeout, is_offline

    layout = Layout(args.collectors, args.evaluators, args.learners)
    for flag, value, least in (("--max-env-step", args.max_env_step, 1), ("--port", args.port, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    if args.ckpt_interval is not None and not args.ckpt_interval > 0:
        raise ConfigError(f"--ckpt-interval must be a number of seconds > 0, got {args.ckpt_interval}")
    check_peer_timeout(args.peer_timeout)
    if args.port is not None and args.port + layout.n_nodes > 65536:
        raise ConfigError(f"--port {args.port}: node r listens on it + r, so it must be at most "
                          f"{65536 - layout.n_nodes} for {layout.n_nodes} nodes")
    try:
        entry = load_entry(args.entry)
    except UnknownEntryError as exc:
        raise ConfigError(exc.args[0]) from None
    if is_offline(entry.main_config):
        raise ConfigError(f"{args.entry} trains offline from a dataset, in one process: it has no collectors to "
                          f"spread over a job's nodes")
    if args.learners > 1:  # a restarted job would resume, which is refused: such a job is not requeued or retried
        check_learners(args.entry, entry.main_config, resume=False, auto_recover=False, learners=args.learners)
    return layout


def default_exp_name(entry: str) -> str:
    """The run name the entry's config gives (``cartpole_dqn``)."""
    from conveyor.zoo import load_entry
    from conveyor.run.directory import run_directory

    return run_directory(load_entry(entry).main_config).name


def train_command(args: argparse.Namespace, launcher: str, exp_name: str, secret_file: str) -> List[str]:
    """The ``conveyor train`` command line of every node (words, unquoted)."""
    command = ["conveyor", "train", args.entry, "--collectors", str(args.collectors)]
    if args.learners != 1:
        command += ["--learners", str(args.learners)]
    if args.evaluators:
        command += ["--evaluators", str(args.evaluators)]
    command += ["--launcher", launcher, "--secret-file", secret_file, "--exp-name", exp_name, "--resume-if-exists",
                "--no-progress"]
    for override in args.overrides:
        command += ["--set", override]
    for flag, value in (("--seed", args.seed), ("--max-env-step", args.max_env_step),
                        ("--ckpt-interval", args.ckpt_interval), ("--peer-timeout", args.peer_timeout),
                        ("--ports", args.port)):
        if value is not None:
            command += [flag, str(value)]
    return command
