"""Where the nodes of a launcher's job run: the node of this process's rank (``--launcher slurm|kubernetes``, one
per task or pod; ``--launcher ray``, one per actor), and the call that runs the nodes started here. Shared by
:mod:`conveyor.cli._distributed` and :mod:`conveyor.cli._ray`."""
from __future__ import annotations

import argparse
import os
from typing import Any, ContextManager, Dict, Mapping, Optional

__all__ = ["job_port", "node_arguments", "nodes_ahead", "placed", "run_nodes"]


def nodes_ahead() -> ContextManager[None]:
    """The zygote of the nodes this process starts next (``Parallel.runner``'s zygote_ahead), started now, so that
    its imports (torch among them, about 2 s) overlap this process's own."""
    from conveyor.engine.parallel.runner import zygote_ahead

    return zygote_ahead(["conveyor.run"])


def run_nodes(args: argparse.Namespace, cfg: Optional[Any], where: Dict[str, Any]) -> Any:
    """:func:`~conveyor.run.train_distributed` of ``args.entry`` for the nodes ``where`` starts here (the
    launch options, after :func:`placed` or :func:`node_arguments` for a launcher's node)."""
    from conveyor.run import train_distributed
    from conveyor.zoo import load_entry

    return train_distributed(load_entry(args.entry), collectors=args.collectors, evaluators=args.evaluators,
                             learners=getattr(args, "learners", 1), cfg=cfg,
                             seed=args.seed, exp_name=args.exp_name, max_env_step=args.max_env_step,
                             max_train_iter=args.max_train_iter, resume=args.resume,
                             progress=args.progress, ckpt_interval=args.ckpt_interval, no_stop=args.no_stop,
                             evaluation_hook=getattr(args, "evaluation_hook", None),
                             peer_timeout_s=getattr(args, "peer_timeout", None),
                             inference=getattr(args, "inference", None), **where)


def placed(args: argparse.Namespace, where: Dict[str, Any], n_nodes: int,
           environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``where`` (the launch options) with this process made the node of its rank in a job of ``n_nodes`` started
    by ``args.launcher`` (one Slurm task or one pod per node): its id, its host and port, every other node to
    dial. ValueError with a one-line reason outside such a job, or for a job of another size or a flag it sets."""
    from conveyor.engine.parallel.cluster import kubernetes_task, slurm_task

    env = os.environ if environ is None else environ
    flag = f"--launcher {args.launcher}"
    if args.launcher == "slurm":
        variable, job, starter = "SLURM_PROCID", slurm_task(env), "srun -n {n} (conveyor slurm-script writes the job)"
    else:
        variable, job = "JOB_COMPLETION_INDEX", kubernetes_task(env)
        starter = "an indexed Job of {n} completions (conveyor k8s-manifest writes it)"
    if variable not in env:
        raise ValueError(f"{flag}: {variable} is not set; start one conveyor train per node with "
                         f"{starter.format(n=n_nodes)}")
    n_tasks = 1 if job is None else job.n_tasks
    if n_tasks != n_nodes:
        raise ValueError(f"{flag}: the job has {n_tasks} node{'s' * (n_tasks != 1)} but --collectors "
                         f"{args.collectors}" + (f" --evaluators {args.evaluators}" if args.evaluators else "") +
                         (f" --learners {args.learners}" if getattr(args, "learners", 1) != 1 else "") +
                         f" needs {n_nodes} (the learners, then collectors and evaluators): "
                         f"{starter.format(n=n_nodes)}")
    return node_arguments(where, job, job_port(args, where, flag))


def job_port(args: argparse.Namespace, where: Dict[str, Any], flag: str) -> int:
    """The first port of a job whose node ``r`` listens on it + r (``--ports P``, default ``DEFAULT_PORT``);
    ValueError for a flag the launcher decides itself (``--node-ids``, ``--address``, ``--attach-to``), several
    ports, or a launch without a secret."""
    from conveyor.engine.parallel.cluster import DEFAULT_PORT

    for given, name in ((args.node_ids, "--node-ids"), (args.address, "--address"), (args.attach_to, "--attach-to")):
        if given is not None:
            raise ValueError(f"{flag}: the job decides {name} (each node is the one of its rank, on its host); "
                             f"leave it out")
    if "secret" not in where:
        raise ValueError(f"{flag}: every node must load the same secret: --secret-file FILE (on a shared file "
                         f"system, or a mounted Secret) or $CONVEYOR_SECRET")
    ports = where["ports"]
    if isinstance(ports, list) and len(ports) != 1:
        raise ValueError(f"{flag}: --ports is the first port (node r listens on it + r), got {args.ports}")
    return ports if isinstance(ports, int) else (ports or [DEFAULT_PORT])[0]


def node_arguments(where: Dict[str, Any], job: Any, port: int) -> Dict[str, Any]:
    """``where`` made the one node ``job.rank`` of ``job`` (a :class:`~conveyor.engine.parallel.cluster.SlurmTask`):
    its id, its host and ``port + rank``, every other node to dial."""
    arguments = job.runner_arguments(port)
    arguments.pop("n_parallel_workers")
    return {**where, **arguments}
