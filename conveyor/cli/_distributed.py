"""The distributed half of ``conveyor train``: ``--collectors N [--evaluators M]`` and where the processes listen.

    conveyor train cartpole/dqn --collectors 2 --evaluators 1
    conveyor train cartpole/dqn --collectors 2 --evaluators 1 --node-ids 0,3 --protocol tcp \\
        --address 10.0.0.1 --ports 50515 --secret-file secret        # host A: learner and evaluator
    conveyor train cartpole/dqn --collectors 2 --evaluators 1 --node-ids 1,2 --protocol tcp \\
        --address 10.0.0.2 --attach-to tcp://10.0.0.1:50515 --secret-file secret   # host B: the collectors
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, ContextManager, Optional

from conveyor.cli._common import message
from conveyor.cli.task import add_launch_arguments, launch_options

__all__ = ["add_arguments", "requested", "started_ahead", "train"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--collectors``, ``--evaluators`` and the launch options to ``conveyor train``."""
    group = parser.add_argument_group("distributed (docs/distributed.md)")
    group.add_argument("--collectors", type=int, default=None, metavar="N",
                       help="train with 1 learner and N collector processes (node 0 learns, 1..N collect)")
    group.add_argument("--evaluators", type=int, default=0, metavar="M",
                       help="with --collectors: M evaluator processes (nodes N+1..N+M; default 0)")
    add_launch_arguments(group)


def requested(args: argparse.Namespace) -> bool:
    """Whether the command line asks for a distributed run."""
    return args.collectors is not None or args.evaluators != 0


def started_ahead(args: argparse.Namespace) -> ContextManager[None]:
    """For a distributed run, its zygote started now (``Parallel.runner``'s zygote_ahead), so that its imports
    (torch among them, about 2 s) overlap those of this process, which reads the entry's config first."""
    if not requested(args):
        return contextlib.nullcontext()
    from conveyor.engine.parallel.runner import zygote_ahead
    return zygote_ahead(["conveyor.zoo.run"])


def train(args: argparse.Namespace, cfg: Optional[Any] = None) -> Any:
    """Run ``args.entry`` distributed (with ``cfg``, the entry's config after ``--config`` / ``--set``, if given);
    returns its :class:`~conveyor.zoo.run.DistributedRun`. A launch that cannot start (an address, a secret, a
    flag) is a ``ConfigError`` with its one-line reason."""
    from conveyor.engine.parallel.runner import RemoteTraceback
    from conveyor.schema import ConfigError
    from conveyor.zoo.run import train_distributed

    if args.collectors is None:
        raise ConfigError(f"--evaluators {args.evaluators} needs --collectors N (a distributed run's collectors)")
    if args.async_mode:
        raise ConfigError("--async is for one process; with --collectors, collection already runs beside training")
    try:
        where = launch_options(args)
        if isinstance(where["node_ids"], int):  # one node here: its id (not the first of a range, as for task)
            where["node_ids"] = [where["node_ids"]]
        return train_distributed(args.entry, collectors=args.collectors, evaluators=args.evaluators, cfg=cfg,
                                 seed=args.seed, exp_name=args.exp_name, max_env_step=args.max_env_step,
                                 max_train_iter=args.max_train_iter, resume=args.resume,
                                 progress=args.progress, ckpt_interval=args.ckpt_interval, no_stop=args.no_stop,
                                 **where)
    except ValueError as exc:  # the launch refused, not a node's own error (that one has its traceback)
        if isinstance(exc, ConfigError) or isinstance(exc.__cause__, RemoteTraceback):
            raise
        raise ConfigError(message(exc)) from None
