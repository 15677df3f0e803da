"""``conveyor train ENTRY --collectors C --launcher ray [--ray-address ADDR]``: every node of the layout a Ray actor.

Ray only places the nodes (one actor per node, with the CPU, and with ``--device cuda`` the learner's GPU, of its
role); the nodes still talk over nng with the run's secret, nothing of the run goes through Ray's object store.
Restarts are ``--auto-recover``'s, inside each actor: a node process that dies is started again by its actor's
``Parallel.runner`` and rejoins. Ray does not restart an actor that dies (``max_restarts=0``): its node process,
orphaned, stops as on SIGTERM, which ends the run on every node (final checkpoint written), so a restarted actor
would find no run to rejoin. The driver (this process) asks each actor for its host,
gives node ``r`` the port ``P + r`` (``--ports P``, default ``DEFAULT_PORT``) and every other node's address,
and hands each actor the secret as an argument of the call that runs its node. Each actor then runs the same
per-node code path as a Slurm task or a pod (:func:`~conveyor.cli._distributed.node_arguments`,
:func:`~conveyor.cli._distributed.run_nodes`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Dict, List, Optional, Tuple

from conveyor.cli._placement import job_port, node_arguments, run_nodes
from conveyor.schema import ConfigError

__all__ = ["INSTALL", "train_on_ray"]

_PLACE_S = 120.0
"""How long Ray may take to start every node's actor (a cluster without the resources never does)."""

_GRACE_S = 60.0
"""How long a stopped run's actors get to end their nodes (each node's own ``grace_s``, 30 s, and a margin)."""

INSTALL = 'pip install "conveyor[ray]"'
"""What makes ``--launcher ray`` available."""


class _Node:
    """One node of the run in a Ray actor: where it is, then its part of the run."""

    def host(self) -> Tuple[str, str, int]:
        """The address other nodes reach this actor's host at (Ray's own address of the host), the Ray node it
        runs on and its process id (to interrupt it, see :func:`_stop`)."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, args: argparse.Namespace, cfg: Optional[Any], where: Dict[str, Any], job: Any, port: int) -> Any:
        """Node ``job.rank`` of ``job``: ``where`` (the launch options and the secret) placed as a Slurm task's."""
        return run_nodes(args, cfg, node_arguments(where, job, port))


def _interrupt(pid: int) -> None:
    """Ctrl-C to process ``pid`` (an actor, on this Ray node)."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--launcher ray needs Ray: {INSTALL}") from None
    return ray


def train_on_ray(args: argparse.Namespace, cfg: Optional[Any], where: Dict[str, Any]) -> Any:
    """Run ``args.entry`` with one Ray actor per node, on the cluster at ``args.ray_address``, the one this process
    is already connected to, or a local one started here (and shut down at the end); returns the learner's
    :class:`~conveyor.zoo.run.DistributedRun` (``nodes``: every node's summary). SIGTERM or Ctrl-C stops every
    node as the local launcher's Ctrl-C does (final checkpoint), ends the actors and raises
    ``TrainingInterrupted``."""
    from conveyor.engine.parallel.cluster import SlurmTask
    from conveyor.engine.parallel.frame import generate_secret
    from conveyor.zoo.run import DistributedRun, Layout, TrainingInterrupted

    ray = _import_ray()
    layout = Layout(args.collectors, args.evaluators, args.learners)
    where = {"secret": generate_secret(), **where}  # --secret-file / $CONVEYOR_SECRET when given
    port = job_port(args, where, "--launcher ray")
    started = not ray.is_initialized()
    temp_dir = None  # a local cluster's session folder (its logs, sockets), removed with it
    if started and args.ray_address is None:
        temp_dir = tempfile.mkdtemp(prefix="conveyor-ray-")
        ray.init(num_cpus=layout.n_nodes, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    elif started:
        try:
            ray.init(address=args.ray_address, log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            raise ConfigError(f"--ray-address {args.ray_address}: {exc}") from None
    actors: List[Any] = []
    calls: List[Any] = []
    places: List[Tuple[str, str, int]] = []
    main_thread = threading.current_thread() is threading.main_thread()  # only it may take signals
    previous = signal.signal(signal.SIGTERM, _interrupted) if main_thread else None
    try:
        actor_class = ray.remote(_Node)
        for node_id in range(layout.n_nodes):
            gpus = 1 if node_id < layout.learners and args.device == "cuda" else 0
            actors.append(actor_class.options(num_cpus=1, num_gpus=gpus, max_restarts=0).remote())
        try:
            places = ray.get([actor.host.remote() for actor in actors], timeout=_PLACE_S)
        except ray.exceptions.GetTimeoutError:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise ConfigError(f"--launcher ray: Ray placed not all {layout.n_nodes} actors within {_PLACE_S:g} s (each "
                              f"asks for 1 CPU, the learner's also for 1 GPU with --device cuda); the cluster has "
                              f"{ray.cluster_resources()}") from None
        hosts = [host for host, _, _ in places]
        calls += [actor.run.remote(args, cfg, where, SlurmTask(rank, hosts), port) for rank, actor in enumerate(actors)]
        return _gathered(ray, calls)
    except KeyboardInterrupt:
        _stop(ray, actors, calls, places)
        signum = _signals.pop() if _signals else signal.SIGINT
        raise TrainingInterrupted(signum, DistributedRun(), _ckpt_dir(args, cfg)) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if started:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


_signals: List[int] = []
"""The signals that stopped this process's runs (SIGTERM's handler notes it: Ray re-raises a plain
KeyboardInterrupt)."""


def _interrupted(signum: int, frame: Any) -> None:
    _signals.append(signum)
    raise KeyboardInterrupt


def _stop(ray: Any, actors: List[Any], calls: List[Any], places: List[Tuple[str, str, int]]) -> None:
    """Stop every node as a launcher's Ctrl-C does: SIGINT to each actor's process, sent by a task on its Ray node
    (the actor itself is busy running its node); its ``Parallel.runner`` gives its node ``grace_s`` to end the
    run, the learner to write its final checkpoint. Then end the actors."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    interrupt = ray.remote(num_cpus=0)(_interrupt)
    ray.get([interrupt.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid)
             for _, node, pid in places], timeout=_GRACE_S)
    if calls:
        ray.wait(calls, num_returns=len(calls), timeout=_GRACE_S)
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _ckpt_dir(args: argparse.Namespace, cfg: Optional[Any]) -> Any:
    from conveyor.zoo import load_entry
    from conveyor.zoo.run import run_directory

    return run_directory(cfg if cfg is not None else load_entry(args.entry).main_config, args.exp_name) / "ckpt"


def _gathered(ray: Any, calls: List[Any]) -> Any:
    """The learner's result with every node's summary, once every node has ended (a node's own exception, the
    learner's first, is raised then); ``WorkerError`` naming the nodes whose actor died with its restarts spent,
    with the others' results."""
    from conveyor.engine.parallel.runner import WorkerError

    results: List[Any] = []
    errors: List[BaseException] = []
    lost: List[str] = []
    for node_id, call in enumerate(calls):
        try:
            results.append(ray.get(call))
        except ray.exceptions.RayActorError as exc:
            results.append(None)
            lost.append(f"node {node_id} ({type(exc).__name__})")
        except ray.exceptions.RayTaskError as exc:  # an instance of the node's exception's class too
            results.append(None)
            errors.append(exc)
    if errors:
        raise errors[0]
    if lost:
        raise WorkerError(f"the Ray actor of {', '.join(lost)} died (Ray does not restart it: --auto-recover restarts "
                          f"a node's process inside its actor); the other nodes ended the run", results)
    learner = results[0]
    learner.nodes = [node for result in results for node in result.nodes]
    return learner
