"""The distributed half of ``conveyor train``: ``--collectors N [--evaluators M]`` and where the processes listen.

    conveyor train cartpole/dqn --collectors 2 --evaluators 1
    conveyor train cartpole/dqn --collectors 2 --evaluators 1 --node-ids 0,3 --protocol tcp \\
        --address 10.0.0.1 --ports 50515 --secret-file secret        # host A: learner and evaluator
    conveyor train cartpole/dqn --collectors 2 --evaluators 1 --node-ids 1,2 --protocol tcp \\
        --address 10.0.0.2 --attach-to tcp://10.0.0.1:50515 --secret-file secret   # host B: the collectors
    srun -n 3 conveyor train cartpole/dqn --collectors 2 --launcher slurm --secret-file secret  # a Slurm task a node

``--launcher slurm`` (one ``conveyor train`` per ``srun`` task) and ``--launcher kubernetes`` (one per pod of an
indexed Job) make this process one node of the layout, the one of its rank (``conveyor.engine.parallel.cluster``
reads the scheduler's environment); ``conveyor slurm-script`` and ``conveyor k8s-manifest`` write the job.
``--launcher ray`` starts every node as a Ray actor from here (``conveyor.cli._ray``).
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, ContextManager, Optional

from conveyor.cli._common import message
from conveyor.cli._placement import nodes_ahead, placed, run_nodes
from conveyor.cli.task import add_launch_arguments, launch_options

__all__ = ["LAUNCHERS", "add_arguments", "placed", "requested", "run_nodes", "started_ahead", "train"]

LAUNCHERS = ("local", "slurm", "kubernetes", "ray")
"""``--launcher``: this host's processes (local), one node per Slurm task or per pod of an indexed Job, or one
Ray actor per node started from here."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--collectors``, ``--evaluators`` and the launch options to ``conveyor train``."""
    group = parser.add_argument_group("distributed (docs/distributed.md)")
    group.add_argument("--collectors", type=int, default=None, metavar="N",
                       help="train with 1 learner and N collector processes (node 0 learns, 1..N collect)")
    group.add_argument("--learners", type=int, default=1, metavar="L",
                       help="with --collectors: L data-parallel learner processes (nodes 0..L-1, then the collectors; "
                            "default 1)")
    group.add_argument("--evaluators", type=int, default=0, metavar="M",
                       help="with --collectors: M evaluator processes (nodes N+1..N+M; default 0: the learner evaluates)")
    group.add_argument("--inference", default=None, metavar="{local,server}",
                       help="with --collectors: server, one more process acts for every collector in one forward "
                            "pass (on the GPU where there is one); local, each collector acts itself (default: server "
                            "where CUDA is or the policy acts on images, else local; docs/distributed.md)")
    group.add_argument("--launcher", choices=LAUNCHERS, default="local",
                       help="local: start the nodes here (default); slurm: this srun task is the node of its rank "
                            "(SLURM_PROCID); kubernetes: this pod of an indexed Job is (JOB_COMPLETION_INDEX); ray: "
                            "one Ray actor per node, placed by Ray (pip install \"conveyor[ray]\")")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --launcher ray: the running cluster to join (e.g. 10.0.0.1:6379, or auto); "
                            "default: a local one started for this run")
    group.add_argument("--peer-timeout", type=float, default=None, metavar="SECONDS",
                       help="how long a node tolerates a silent peer (a stopped or unreachable process) before it "
                            "is lost: longer for slow networks or long pauses, shorter to notice a lost node sooner "
                            "(default 5; the heartbeat is a quarter of it under 2)")
    add_launch_arguments(group)


def requested(args: argparse.Namespace) -> bool:
    """Whether the command line asks for a distributed run."""
    return args.collectors is not None or args.evaluators != 0 or args.learners != 1 or args.launcher != "local" \
        or args.peer_timeout is not None or args.inference not in (None, "local")


def started_ahead(args: argparse.Namespace) -> ContextManager[None]:
    """For a distributed run, its zygote started now (``Parallel.runner``'s zygote_ahead), so that its imports
    (torch among them, about 2 s) overlap those of this process, which reads the entry's config first. Under Ray
    the nodes start in actors, not from here: each actor starts its own so (:func:`nodes_ahead`)."""
    if not requested(args) or args.launcher == "ray":
        return contextlib.nullcontext()
    return nodes_ahead()


def train(args: argparse.Namespace, cfg: Optional[Any] = None) -> Any:
    """Run ``args.entry`` distributed (with ``cfg``, the entry's config after ``--config`` / ``--set``, if given);
    returns its :class:`~conveyor.run.DistributedRun`. A launch that cannot start (an address, a secret, a
    flag) is a ``ConfigError`` with its one-line reason."""
    from conveyor.engine.parallel.runner import RemoteTraceback
    from conveyor.run.nodes import Layout, check_peer_timeout
    from conveyor.schema import ConfigError

    if args.inference is not None:
        Layout(1, inference=args.inference)  # an unknown value: its one line
    if args.collectors is None:
        given = f"--evaluators {args.evaluators}" if args.evaluators else f"--learners {args.learners}" \
            if args.learners != 1 else f"--launcher {args.launcher}" if args.launcher != "local" \
            else f"--inference {args.inference}" if args.inference not in (None, "local") \
            else f"--peer-timeout {args.peer_timeout:g}"
        raise ConfigError(f"{given} needs --collectors N (a distributed run's collectors)")
    if args.inference == "server" and args.launcher != "local":
        raise ConfigError(f"--inference server runs the server beside the collectors, all started here; with "
                          f"--launcher {args.launcher} use --inference local")
    check_peer_timeout(args.peer_timeout)
    if args.async_mode:
        raise ConfigError("--async is for one process; with --collectors, collection already runs beside training")
    if args.ray_address is not None and args.launcher != "ray":
        raise ConfigError(f"--ray-address is for --launcher ray, not --launcher {args.launcher}")
    try:
        where = launch_options(args)
        if isinstance(where["node_ids"], int):  # one node here: its id (not the first of a range, as for task)
            where["node_ids"] = [where["node_ids"]]
        if args.launcher == "ray":
            from conveyor.cli._ray import train_on_ray
            return train_on_ray(args, cfg, where)
        if args.launcher != "local":
            where = placed(args, where, args.learners + args.collectors + args.evaluators)
        return run_nodes(args, cfg, where)
    except ValueError as exc:  # the launch refused, not a node's own error (that one has its traceback)
        if isinstance(exc, ConfigError) or isinstance(exc.__cause__, RemoteTraceback):
            raise
        raise ConfigError(message(exc)) from None
