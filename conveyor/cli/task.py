"""``conveyor task``: run a function of your own package on several worker processes or hosts.

    conveyor task --package DIR --main MODULE.FUNC [--parallel-workers N] [--topology star|mesh|alone]
                  [--protocol ipc|tcp] [--address A] [--ports P] [--node-ids I] [--attach-to URLS]
                  [--labels L] [--secret-file F]

Imports ``MODULE`` from ``DIR`` and runs ``FUNC()`` under ``Parallel.runner`` (docs/distributed.md). The
secret: ``--secret-file``, else ``$CONVEYOR_SECRET``, else one generated for this launch (its workers then
stay on this host). Under ``srun`` (``SLURM_PROCID`` set, more than one task) each Slurm task is one node,
node id = its rank, listening on its host at ``--ports`` + rank and attached to every other task.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional

from conveyor.cli._common import message, usage_error

__all__ = ["add_launch_arguments", "launch_options", "load_main", "register", "run", "runner_options"]

TOPOLOGIES = ("star", "mesh", "alone")
PROTOCOLS = ("ipc", "tcp")


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``task`` subcommand."""
    parser = commands.add_parser("task", help="run MODULE.FUNC of a package on several processes or hosts",
                                 description="Run FUNC() on N worker processes joined by routers (Parallel.runner).")
    parser.add_argument("--package", default=".", metavar="DIR", help="folder MODULE is imported from (default .)")
    parser.add_argument("--main", required=True, metavar="MODULE.FUNC", help="the function every worker runs")
    parser.add_argument("--parallel-workers", type=int, default=1, metavar="N",
                        help="worker processes here (default 1)")
    parser.add_argument("--topology", default="star", help=f"one of {', '.join(TOPOLOGIES)} (default star)")
    add_launch_arguments(parser)
    parser.add_argument("--labels", default=None, metavar="L", help="comma-separated labels of every worker here")
    parser.add_argument("--no-slurm", dest="slurm", action="store_false",
                        help="ignore Slurm's environment (SLURM_PROCID ...) even when it is set")
    parser.set_defaults(run=run)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say where a launch's workers listen, whom they join and whether dead ones are restarted
    (``conveyor task`` and ``conveyor train --collectors``): --protocol, --address, --ports, --node-ids,
    --attach-to, --secret-file, --auto-recover, --max-retries."""
    parser.add_argument("--protocol", default="ipc", help=f"one of {', '.join(PROTOCOLS)} (default ipc)")
    parser.add_argument("--address", default=None,
                        help="tcp: the host to listen on (default 127.0.0.1); ipc: the folder of the socket files")
    parser.add_argument("--ports", default=None, metavar="P",
                        help="tcp: the first port (worker i listens on P+i) or one per worker, comma-separated")
    parser.add_argument("--node-ids", default=None, metavar="I",
                        help="the first node id or one per worker here, comma-separated (default 0..N-1)")
    parser.add_argument("--attach-to", default=None, metavar="URLS",
                        help="comma-separated addresses of nodes started elsewhere, e.g. tcp://10.0.0.1:50515")
    parser.add_argument("--secret-file", default=None, metavar="F",
                        help="file holding the shared secret (the same on every host); default $CONVEYOR_SECRET")
    parser.add_argument("--auto-recover", action="store_true",
                        help="start a worker that dies (killed, crashed) again with its node id; it rejoins the run")
    parser.add_argument("--max-retries", type=int, default=None, metavar="N",
                        help="with --auto-recover: restarts per worker (default 3)")


def launch_options(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``Parallel.runner`` keyword arguments of :func:`add_launch_arguments`' options (``secret`` only when a
    file or ``$CONVEYOR_SECRET`` gives one); ValueError with a one-line reason for a bad one."""
    from conveyor.engine.parallel.frame import SECRET_ENV, load_secret

    if args.protocol not in PROTOCOLS:
        raise ValueError(f"--protocol {args.protocol!r}: must be one of {', '.join(PROTOCOLS)}"
                         f"{_closest(args.protocol, PROTOCOLS)}")
    if args.max_retries is not None and not args.auto_recover:
        raise ValueError(f"--max-retries {args.max_retries}: restarts need --auto-recover")
    if args.max_retries is not None and args.max_retries < 0:
        raise ValueError(f"--max-retries {args.max_retries}: must be >= 0")
    env = os.environ if environ is None else environ
    options = {"protocol": args.protocol, "address": args.address, "ports": _ints("--ports", args.ports),
               "node_ids": _ints("--node-ids", args.node_ids), "attach_to": _words(args.attach_to),
               "auto_recover": args.auto_recover, "max_retries": args.max_retries}
    if args.secret_file is not None or SECRET_ENV in env:
        options["secret"] = load_secret(args.secret_file, environ=env, generate=False)  # SecretError is a ValueError
    return options


def run(args: argparse.Namespace) -> int:
    """Start the workers; returns the exit code."""
    try:
        options = runner_options(args)
        main = load_main(args.package, args.main)
    except ValueError as exc:
        return usage_error(message(exc))
    from conveyor.engine import Parallel
    from conveyor.engine.parallel.runner import RemoteTraceback
    try:
        Parallel.runner(**options)(main)
    except KeyboardInterrupt:
        print("conveyor: interrupted; every worker was stopped", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # the launch refused (an address, a secret), not a worker's own error
        if isinstance(exc.__cause__, RemoteTraceback):
            raise
        return usage_error(message(exc))
    return 0


def runner_options(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``Parallel.runner`` keyword arguments from the command line (and Slurm's environment); ValueError
    with a one-line reason for a bad one."""
    from conveyor.engine.parallel.cluster import DEFAULT_PORT, slurm_task

    if args.parallel_workers < 1:
        raise ValueError(f"--parallel-workers must be >= 1, got {args.parallel_workers}")
    if args.topology not in TOPOLOGIES:
        raise ValueError(f"--topology {args.topology!r}: must be one of {', '.join(TOPOLOGIES)}"
                         f"{_closest(args.topology, TOPOLOGIES)}")
    options = {"n_parallel_workers": args.parallel_workers, "topology": args.topology,
               "labels": _words(args.labels), **launch_options(args, environ)}
    slurm = slurm_task(os.environ if environ is None else environ) if args.slurm else None
    if slurm is not None:
        if args.parallel_workers != 1 or args.node_ids is not None or args.address is not None:
            raise ValueError("under srun each Slurm task is one node (id = SLURM_PROCID, address = its host): leave "
                             "out --parallel-workers, --node-ids and --address, or pass --no-slurm")
        if isinstance(options["ports"], list) and len(options["ports"]) != 1:
            raise ValueError(f"under srun --ports is the first port (task r listens on it + r), got {args.ports}")
        port = options["ports"] if isinstance(options["ports"], int) else (options["ports"] or [DEFAULT_PORT])[0]
        extra, placed = options["attach_to"], slurm.runner_arguments(port)
        options.update(placed, attach_to=placed["attach_to"] + extra,
                       topology="mesh" if args.topology == "alone" else args.topology)
    return options


def load_main(package: str, target: str) -> Callable[..., Any]:
    """``FUNC`` of ``MODULE`` imported from the folder ``package`` (put first on ``sys.path``, so the workers,
    which inherit it, import it the same way)."""
    module_name, _, func_name = target.rpartition(".")
    if not module_name or not func_name:
        raise ValueError(f"--main {target!r}: expected MODULE.FUNC, e.g. train.main")
    if not os.path.isdir(package):
        raise ValueError(f"--package {package!r}: no such folder")
    folder = os.path.abspath(package)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ValueError(f"--main {target!r}: no module {exc.name!r} in {folder}") from None
        raise
    func = getattr(module, func_name, None)
    if not callable(func):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ValueError(f"--main {target!r}: {module_name} has no function {func_name!r}{_closest(func_name, names)}")
    return func


def _ints(flag: str, text: Optional[str]) -> Any:
    """None, one int, or a list of ints from ``"8000"`` / ``"8000,8003"``."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected an integer or comma-separated integers") from None
    low = 1 if flag == "--ports" else 0  # no port 0: leave --ports out and the OS picks free ones
    if not values or any(v < low for v in values):
        raise ValueError(f"{flag} {text!r}: expected integers >= {low}")
    return values[0] if len(values) == 1 and "," not in text else values


def _words(text: Optional[str]) -> List[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _closest(value: str, choices: Any) -> str:
    from conveyor.schema import closest
    hint = closest(value, list(choices))
    return f"; did you mean {hint!r}?" if hint else ""
