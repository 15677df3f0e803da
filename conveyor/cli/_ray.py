"""``conveyor train ENTRY --collectors C --launcher ray [--ray-address ADDR]``: every node of the layout a Ray actor.

Ray only places the nodes (one actor per node, with the CPU, and with ``--device cuda`` the learner's GPU, of its
role); the nodes still talk over nng with the run's secret, nothing of the run goes through Ray's object store.
The driver (this process) asks each actor for its host, gives node ``r`` the port ``P + r`` (``--ports P``,
default ``DEFAULT_PORT``) and every other node's address, and hands each actor the secret as an argument of the
call that runs its node. Each actor then runs the same per-node code path as a Slurm task or a pod
(:func:`~conveyor.cli._distributed.node_arguments`, :func:`~conveyor.cli._distributed.run_nodes`).

Restarts are ``--auto-recover``'s (bounded by ``--max-retries``, default 3), at two levels. Inside each actor,
its ``Parallel.runner`` starts a node process that dies again. And Ray restarts the actor of a node that dies
(``max_restarts``): its node process, orphaned, leaves the run at once without ending it (``auto_recover``'s rule
for a worker whose launcher is gone), the others go on without it, and the driver calls the restarted actor's
``run`` again with the actor's restart count, whose node starts with the same node id and address, that count as
its ``task.router.restarts``: a collector or an evaluator rejoins as an auto-recover restart does, the learner
resumes from the run's latest checkpoint while the others wait for it. Several learners refuse ``--auto-recover``
before Ray starts. Without ``--auto-recover`` no actor is restarted and the orphaned node stops as on SIGTERM,
which ends the run on every node (final checkpoint written).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from conveyor.cli._placement import job_port, node_arguments, nodes_ahead, run_nodes
from conveyor.cli._ray_local import LocalCluster
from conveyor.schema import ConfigError

__all__ = ["INSTALL", "train_on_ray"]

log = logging.getLogger(__name__)

_PLACE_S = 120.0
"""How long Ray may take to start every node's actor (a cluster without the resources never does)."""

_RETRY_S = 0.5
"""Between two calls to an actor that Ray is restarting (no event tells when it is back)."""

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

    def run(self, args: argparse.Namespace, cfg: Optional[Any], where: Dict[str, Any], job: Any, port: int,
            restarts: int = 0) -> Any:
        """Node ``job.rank`` of ``job``: ``where`` (the launch options and the secret) placed as a Slurm task's.
        ``restarts``: how many times Ray restarted this actor (the driver's count of the restarts it waited for), its
        node's ``task.router.restarts`` before any restart inside the actor: a learner above 0 resumes.

        Ctrl-C is how :func:`_stop` ends the node (its ``Parallel.runner`` stops the node process gracefully), but
        Ray blocks SIGINT in every thread of an actor, and an actor whose cluster a process with SIGINT ignored
        started (a driver run in the background) ignores it too: while the node runs, this thread (the main one)
        takes SIGINT with Python's default handler.

        The node's zygote starts first, so that its imports (torch among them, about 2 s) overlap this process's
        own: an actor, started or restarted, has its node running that much sooner where a CPU is free."""
        handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            with nodes_ahead():
                return run_nodes(args, cfg, {**node_arguments(where, job, port), "restarts_before": restarts})
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            signal.signal(signal.SIGINT, handler)

    def final_written(self, ckpt_dir: Any, since: float) -> bool:
        """Whether the run's ``final.pth.tar`` in ``ckpt_dir`` on this actor's host was written since ``since``."""
        from conveyor.run.control import final_written

        return final_written(ckpt_dir, since)


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
    is already connected to, or a local one started here with token authentication on (a
    :class:`~conveyor.cli._ray_local.LocalCluster`, shut down at the end); returns the learner's
    :class:`~conveyor.run.DistributedRun` (``nodes``: every node's summary). SIGTERM or Ctrl-C stops every
    node as the local launcher's Ctrl-C does (final checkpoint), ends the actors and raises
    ``TrainingInterrupted``."""
    from conveyor.engine.parallel.cluster import SlurmTask
    from conveyor.engine.parallel.frame import generate_secret
    from conveyor.run import DistributedRun, Layout, TrainingInterrupted

    ray = _import_ray()
    layout = Layout(args.collectors, args.evaluators, args.learners)
    if layout.learners > 1:  # what several learners refuse (--auto-recover among it), before a cluster starts
        from conveyor.zoo import load_entry
        from conveyor.run.nodes import check_learners
        check_learners(args.entry, cfg if cfg is not None else load_entry(args.entry).main_config,
                       resume=args.resume, auto_recover=args.auto_recover, learners=layout.learners)
    where = {"secret": generate_secret(), **where}  # --secret-file / $CONVEYOR_SECRET when given
    port = job_port(args, where, "--launcher ray")
    started = not ray.is_initialized()
    local = None  # the cluster started here, private and with token authentication
    if started and args.ray_address is None:
        local = LocalCluster(ray, layout.n_nodes).start()
    elif started:
        try:
            ray.init(address=args.ray_address, log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            raise ConfigError(f"--ray-address {args.ray_address}: {exc}") from None
    bound = _restarts(args)
    since = time.time()  # a final checkpoint older than this run's start is not its own
    actors: List[Any] = []
    calls: List[Any] = []  # the call running each node, by node id (a restarted actor's replaces its first)
    places: List[Tuple[str, str, int]] = []
    main_thread = threading.current_thread() is threading.main_thread()  # only it may take signals
    previous = signal.signal(signal.SIGTERM, _interrupted) if main_thread else None
    try:
        actor_class = ray.remote(_Node)
        for node_id in range(layout.n_nodes):
            learner = node_id < layout.learners
            gpus = 1 if learner and args.device == "cuda" else 0
            actors.append(actor_class.options(num_cpus=1, num_gpus=gpus, max_restarts=bound or 0).remote())
        try:
            places = ray.get([actor.host.remote() for actor in actors], timeout=_PLACE_S)
        except ray.exceptions.GetTimeoutError:  # the actors end below
            raise ConfigError(f"--launcher ray: Ray placed not all {layout.n_nodes} actors within {_PLACE_S:g} s (each "
                              f"asks for 1 CPU, the learner's also for 1 GPU with --device cuda); the cluster has "
                              f"{ray.cluster_resources()}") from None
        hosts = [host for host, _, _ in places]

        def run(rank: int, restarts: int = 0) -> Any:
            return actors[rank].run.remote(args, cfg, where, SlurmTask(rank, hosts), port, restarts)

        calls += [run(rank) for rank in range(layout.n_nodes)]
        return _gathered(ray, _Restarts(ray, actors, calls, places, run, bound))
    except KeyboardInterrupt:
        if main_thread:  # a second SIGTERM is the same stop: the nodes keep their grace (a second Ctrl-C ends it)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(ray, calls, places)
        signum = _signals.pop() if _signals else signal.SIGINT
        ckpt_dir = _ckpt_dir(args, cfg)
        final = bool(calls) and _final_written(ray, actors[0], calls[0], ckpt_dir, since)
        raise TrainingInterrupted(signum, DistributedRun(), ckpt_dir, final=final) from None
    finally:
        for actor in actors:  # now, not when the garbage collector drops the last handle: a cluster that outlives
            ray.kill(actor, no_restart=True)  # the run gets its CPUs back at once
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if local is not None:
            local.stop()
        elif started:
            ray.shutdown()


_signals: List[int] = []
"""The signals that stopped this process's runs (SIGTERM's handler notes it: Ray re-raises a plain
KeyboardInterrupt)."""


def _interrupted(signum: int, frame: Any) -> None:
    _signals.append(signum)
    raise KeyboardInterrupt


def _stop(ray: Any, calls: List[Any], places: List[Tuple[str, str, int]]) -> None:
    """Stop every node as a launcher's Ctrl-C does: SIGINT to each actor's process, sent by a task on its Ray node
    (the actor itself is busy running its node); its ``Parallel.runner`` gives its node ``grace_s`` to end the
    run, the learner to write its final checkpoint. The caller ends the actors."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    interrupt = ray.remote(num_cpus=0)(_interrupt)
    ray.get([interrupt.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid)
             for _, node, pid in places], timeout=_GRACE_S)
    if calls:
        ray.wait(calls, num_returns=len(calls), timeout=_GRACE_S)


def _final_written(ray: Any, learner: Any, call: Any, ckpt_dir: Any, since: float) -> bool:
    """Whether node 0's actor, once its ``call`` (its node) has ended, finds the run's final checkpoint written since
    ``since`` on its host (False where its node has not ended, or it cannot tell: never claim one not seen)."""
    try:
        if not ray.wait([call], timeout=0)[0]:
            return False
        return bool(ray.get(learner.final_written.remote(ckpt_dir, since), timeout=_PLACE_S))
    except (ray.exceptions.RayError, OSError):
        return False


def _ckpt_dir(args: argparse.Namespace, cfg: Optional[Any]) -> Any:
    from conveyor.zoo import load_entry
    from conveyor.run.directory import run_directory

    return run_directory(cfg if cfg is not None else load_entry(args.entry).main_config, args.exp_name) / "ckpt"


def _restarts(args: argparse.Namespace) -> Optional[int]:
    """How many times Ray may restart a node's actor: ``--max-retries`` (default ``DEFAULT_MAX_RETRIES``) with
    ``--auto-recover``, else None (never)."""
    from conveyor.engine.parallel.runner import DEFAULT_MAX_RETRIES

    if not args.auto_recover:
        return None
    return DEFAULT_MAX_RETRIES if args.max_retries is None else args.max_retries


class _Restarts:
    """The driver's side of Ray's actor restarts: ``again(node_id)`` calls ``run`` of node ``node_id``'s restarted
    actor (``run(node_id, restarts)``) once Ray has started it, and notes its new process for :func:`_stop`."""

    def __init__(self, ray: Any, actors: List[Any], calls: List[Any], places: List[Tuple[str, str, int]],
                 run: Any, bound: Optional[int]) -> None:
        self.ray, self.actors, self.calls, self.places, self.run, self.bound = ray, actors, calls, places, run, bound
        self.counts = [0] * len(actors)
        self.failed: Dict[int, str] = {}  # node id -> why Ray's restart of its actor did not answer

    def again(self, node_id: int) -> bool:
        """Whether node ``node_id`` runs again in its restarted actor (False: its restarts are spent, or Ray
        could not restart it within ``_PLACE_S``)."""
        ray = self.ray
        if self.counts[node_id] >= (self.bound or 0):
            return False
        self.counts[node_id] += 1
        log.warning("the Ray actor of node %d died; Ray restarts it (restart %d of %d) and its node %s", node_id,
                    self.counts[node_id], self.bound,
                    "resumes the run from its latest checkpoint" if node_id == 0 else "rejoins the run")
        deadline = time.monotonic() + _PLACE_S
        while True:  # until the restarted actor answers: calls sent before Ray saw it die fail as unavailable
            try:
                self.places[node_id] = ray.get(self.actors[node_id].host.remote(),
                                               timeout=max(0.0, deadline - time.monotonic()))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    self.failed[node_id] = f"still unavailable {_PLACE_S:g} s after restart {self.counts[node_id]}"
                    return False
                time.sleep(_RETRY_S)
            except ray.exceptions.GetTimeoutError:
                self.failed[node_id] = f"not restarted within {_PLACE_S:g} s"
                return False
            except ray.exceptions.RayActorError as exc:
                self.failed[node_id] = f"{type(exc).__name__} at restart {self.counts[node_id]}"
                return False
        self.calls[node_id] = self.run(node_id, self.counts[node_id])
        return True

    def why(self, node_id: int, exc: BaseException) -> str:
        """Node ``node_id``, whose actor died of ``exc`` for good, and why it was not restarted (again)."""
        what = f"node {node_id} ({type(exc).__name__}) died"
        if self.bound is None:
            return f"{what} (Ray restarts actors only with --auto-recover)"
        if node_id in self.failed:
            return f"{what} ({self.failed[node_id]})"
        count = self.counts[node_id]
        if count < self.bound:
            return f"{what} as the run was ending"
        return f"{what} after {count} restart{'s' * (count != 1)} (--max-retries {self.bound})"


def _gathered(ray: Any, restarts: _Restarts) -> Any:
    """The learner's result with every node's summary, once every node has ended (a node's own exception, the
    learner's first, is raised then). An actor that dies runs its node again once Ray has restarted it, while its
    restarts last and the run goes on: a collector's or an evaluator's while the learner runs, the learner's while
    no node has ended (as ``Parallel.runner`` restarts no worker once one has returned); ``WorkerError`` naming the
    nodes whose actor died for good, with the others' results, once the others have ended. Without
    ``--auto-recover`` a loss ends the run: the others are stopped as on Ctrl-C and given ``_GRACE_S``."""
    from conveyor.engine.parallel.runner import WorkerError

    calls = restarts.calls
    results: List[Any] = [None] * len(calls)
    errors: Dict[int, BaseException] = {}
    lost: List[str] = []
    pending = set(range(len(calls)))
    stopped: Optional[float] = None  # when the others were stopped after a loss that ends the run
    while pending:
        running = {calls[node_id]: node_id for node_id in pending}
        timeout = None if stopped is None else max(0.0, stopped + _GRACE_S - time.monotonic())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
        if not ready:
            lost += [f"node {node_id} (still running {_GRACE_S:g} s after it was stopped)"
                     for node_id in sorted(pending)]
            break
        node_id = running[ready[0]]
        pending.discard(node_id)
        try:
            results[node_id] = ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            goes_on = 0 in pending if node_id else not (errors or any(result is not None for result in results))
            if goes_on and restarts.again(node_id):
                pending.add(node_id)
            else:
                lost.append(restarts.why(node_id, exc))
                if restarts.bound is None and pending and stopped is None:
                    stopped = time.monotonic()  # the loss ends the run: the others stop as on Ctrl-C
                    _stop(ray, [], [restarts.places[other] for other in sorted(pending)])
        except ray.exceptions.TaskCancelledError:  # Ray's reading of the Ctrl-C that ends a node stopped above
            if stopped is None:
                raise
        except ray.exceptions.RayTaskError as exc:  # an instance of the node's exception's class too
            if node_id and restarts.counts[node_id] and 0 not in pending:
                log.warning("node %d, restarted by Ray, found the run ended: %s", node_id, exc)
            else:
                errors[node_id] = exc
    if errors:
        raise errors[min(errors)]
    if lost:
        raise WorkerError(f"the Ray actor of {'; of '.join(lost)}; the other nodes ended the run", results)
    learner = results[0]
    learner.nodes = [node for result in results if result is not None for node in result.nodes]
    return learner
