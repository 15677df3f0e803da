"""Distributed zoo runs: one learner, N collectors and M evaluators as separate processes (``Parallel.runner``).

    conveyor train cartpole/dqn --collectors 2 --evaluators 1

Every node runs the entry's own ``main()``. :func:`train_distributed` starts the nodes; each gets its role
from its node id (0 the learner, 1..N collectors, then the evaluators) before it calls ``main()``, so
:func:`~conveyor.zoo._online.prepare` leaves the run directory to the learner and
:func:`~conveyor.zoo._online.train_online` hands over to :func:`train_node`, which builds this node's part of
the entry's pipeline (the entry's ``build`` marks each middleware with its role):

- all: :class:`LearnerClock`, ``ModelExchanger``, ``ContextExchanger`` first, then the entry's middleware of
  the node's role.
- learner: trains on what the collectors send; owns the checkpoints (``use_saving``: CkptSaver, logger,
  progress bar, ``--resume``), ``runs/<exp>/nodes.json`` (every node's id, roles, pid, host and address) and
  the end of the run (its budget, or an evaluation at the stop value), which it tells the others.
- collector: its share of the collection (``collector_env_num`` and ``n_sample`` divided by N, rounded up,
  so the collectors together bring per learner iteration what one process would collect), seed + node id.
  A collector runs at most :data:`COLLECTOR_LEAD` iterations per learner iteration (collection overlaps
  training without taking the learner's CPU); on-policy entries (no replay buffer) collect each batch on
  the newest weights (``max_staleness=0``).
- evaluator: waits until the learner's counters move, then evaluates as the entry does (on the learner's
  ``env_step`` and ``train_iter``, and the first evaluator with the run's seed, so on the episodes one
  process evaluates on); its results reach the learner, whose saver writes ``eval_best`` with the
  weights that were evaluated.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from easydict import EasyDict

from conveyor.engine import FINISH_EVENT, PEER_LOST_EVENT, STOP_EVENT, OnlineRLContext, Role, declares, task
from conveyor.engine.parallel import codec
from conveyor.engine.parallel.cluster import NodeTable
from conveyor.envs import make_env_manager
from conveyor.middleware import EVAL_EVENT, ContextExchanger, ModelExchanger
from conveyor.middleware.messages import Rejections, check_fields
from conveyor.policy.base import Snapshot
from conveyor.schema import ConfigError
from conveyor.zoo._online import (LATEST, NODES_FILE, Collection, check_layout, experiment_dir, run_directory,
                                  use_saving)

__all__ = ["DistributedRun", "EvaluatedWeights", "Layout", "LearnerClock", "NODES_FILE", "PROGRESS_TOPIC",
           "RemoteEvaluations", "train_distributed", "train_node"]

log = logging.getLogger(__name__)

PROGRESS_TOPIC = "conveyor.zoo.progress"
"""Learner -> the other nodes: ``{"node", "train_iter", "env_step", "stop"}`` after each iteration, and once at the end."""
COLLECTOR_LEAD = 2
"""Iterations a collector may run per learner iteration before it waits for the learner."""
EXCHANGE_TIMEOUT_S = 120.0
"""The bound on every wait for another node (a batch, weights, the learner's counters): a shared machine is slow."""


class EvaluatedWeights:
    """The weights an evaluator node evaluated (``version`` and the model's state dict), as the learner gets
    them in place of the evaluator's snapshot; :meth:`RemoteEvaluations` binds them to the learner's policy."""

    def __init__(self, version: int, model: Mapping[str, Any], policy: Any = None) -> None:
        self.version, self.model, self.policy = int(version), model, policy

    def state_dict(self) -> Dict[str, Any]:
        """The learner policy's checkpoint with these model weights and version (as ``Snapshot.state_dict``)."""
        if self.policy is None:
            raise RuntimeError("EvaluatedWeights.state_dict(): not bound to the learner's policy")
        state = self.policy.state_dict()
        state["model"] = dict(self.model)
        state["counters"]["version"] = self.version
        return state

    def __repr__(self) -> str:
        return f"<EvaluatedWeights version {self.version}>"


codec.register(Snapshot, "conveyor.zoo.EvaluatedWeights",
               lambda s: {"version": s.version, "model": s.model_state_dict()},
               lambda d: EvaluatedWeights(d["version"], d["model"]))


@dataclass(frozen=True)
class Layout:
    """Which node does what: node 0 learns, nodes ``1..collectors`` collect, the next ``evaluators`` evaluate."""

    collectors: int
    evaluators: int = 0

    def __post_init__(self) -> None:
        for name, value, least in (("collectors", self.collectors, 1), ("evaluators", self.evaluators, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"--{name} {value!r}: must be an int >= {least}")

    @property
    def n_nodes(self) -> int:
        """Learner, collectors and evaluators together."""
        return 1 + self.collectors + self.evaluators

    def role(self, node_id: int) -> Role:
        """The role of node ``node_id``."""
        if not isinstance(node_id, int) or not 0 <= node_id < self.n_nodes:
            raise ConfigError(f"node id {node_id!r}: this run has nodes 0..{self.n_nodes - 1} (0 the learner, "
                              f"1..{self.collectors} collectors, then {self.evaluators} evaluators)")
        if node_id == 0:
            return Role.LEARNER
        return Role.COLLECTOR if node_id <= self.collectors else Role.EVALUATOR

    def seed_offset(self, node_id: int) -> int:
        """What node ``node_id`` adds to the run's seed: a collector its node id (each its own env stream), the
        k-th evaluator k (the first evaluates on the episodes one process would), the learner 0."""
        role = self.role(node_id)
        return node_id if role is Role.COLLECTOR else node_id - 1 - self.collectors if role is Role.EVALUATOR else 0


@dataclass
class _Node:
    """This worker's part of the run, set by :func:`_node_main` for :func:`train_node`."""

    layout: Layout
    auto_recover: bool = False
    ran: bool = False
    collected: int = 0
    first_step_at: Optional[float] = None


_node: Optional[_Node] = None


@dataclass
class DistributedRun:
    """What :func:`train_distributed` returns: the learner's counters and last evaluation (when the learner
    ran on another host: the newest the nodes here heard of), and a summary of every node started here
    (``node_id``, ``role``, ``pid``, ``env_step``, ``train_iter``, ``last_eval_value``, ``collected``: env
    steps a collector collected, ``first_step_at``: the ``time.time()`` of its first collected step)."""

    env_step: Optional[int] = None
    train_iter: Optional[int] = None
    last_eval_value: Optional[float] = None
    nodes: List[Dict[str, Any]] = field(default_factory=list)


def train_distributed(entry: str, *, collectors: int, evaluators: int = 0, cfg: Optional[Mapping[str, Any]] = None,
                      seed: Optional[int] = None, exp_name: Optional[str] = None, max_env_step: Optional[int] = None,
                      max_train_iter: Optional[int] = None, resume: bool = False, progress: bool = True,
                      ckpt_interval: Optional[float] = None,
                      protocol: str = "ipc", address: Optional[str] = None,
                      ports: Union[int, Sequence[int], None] = None,
                      node_ids: Optional[Sequence[int]] = None, attach_to: Optional[Sequence[str]] = None,
                      secret: Optional[bytes] = None, auto_recover: bool = False,
                      max_retries: Optional[int] = None, ready_timeout_s: float = 60.0,
                      grace_s: float = 30.0) -> DistributedRun:
    """Train zoo ``entry`` with 1 learner, ``collectors`` collectors and ``evaluators`` evaluators, each its
    own process; the other arguments are the entry ``main()``'s and ``Parallel.runner``'s.

    ``node_ids``: the nodes to start here (default all); give each host its share and the others'
    addresses (``attach_to``), with the same secret on every host, to spread one run over several.
    ``grace_s``: how long a stopped launch (SIGTERM, Ctrl-C) lets its nodes finish their iteration, the
    learner write its final checkpoint, before they are killed. ``auto_recover``: a node that dies is
    started again (up to ``max_retries`` times); a collector or evaluator rejoins with the newest weights,
    a learner resumes from the run's latest checkpoint (it writes one as it starts) while the others wait
    for it (at most :data:`EXCHANGE_TIMEOUT_S`) and rejoin it.
    """
    from conveyor.engine import Parallel
    from conveyor.zoo import load_entry

    layout = Layout(collectors, evaluators)
    ids = list(range(layout.n_nodes)) if node_ids is None else list(node_ids)
    for node_id in ids:
        layout.role(node_id)
    from conveyor.zoo._offline import is_offline
    loaded = load_entry(entry)  # an unknown name fails here, before any process starts
    if is_offline(loaded):
        raise ConfigError(f"{entry} trains offline from a dataset, with no collectors or evaluators to spread "
                          f"over processes: drop --collectors/--evaluators")
    if resume and 0 in ids:  # the learner's run directory is here: a one-process run is refused before any start
        check_layout(run_directory(cfg if cfg is not None else loaded.main_config, exp_name), distributed=True)
    options = {"cfg": None if cfg is None else EasyDict(copy.deepcopy(dict(cfg))), "seed": seed,
               "exp_name": exp_name, "max_env_step": max_env_step, "max_train_iter": max_train_iter, "resume": resume,
               "progress": progress,
               "ckpt_interval": ckpt_interval, "auto_recover": auto_recover}
    results = Parallel.runner(len(ids), topology="star", protocol=protocol, address=address, ports=ports,
                              attach_to=attach_to, node_ids=ids, secret=secret, auto_recover=auto_recover,
                              max_retries=max_retries, ready_timeout_s=ready_timeout_s,
                              grace_s=grace_s)(_node_main, entry, layout, options)
    nodes = [r for r in results if r is not None]
    told = [n for n in nodes if n["role"] == Role.LEARNER.value] or nodes  # else: as the nodes here heard it
    newest = max(told, key=lambda n: (n["env_step"], n["last_eval_value"] is not None), default=None)
    if newest is None:
        return DistributedRun()
    return DistributedRun(newest["env_step"], newest["train_iter"], newest["last_eval_value"], nodes)


def _node_main(entry_name: str, layout: Layout, options: Dict[str, Any]) -> Dict[str, Any]:
    """One worker: take the role of its node id and run the entry's ``main()``; a summary of what it did."""
    global _node
    from conveyor.zoo import load_entry

    node_id = task.router.node_id
    role = layout.role(node_id)
    entry = load_entry(entry_name)
    seed = options["seed"]
    offset = layout.seed_offset(node_id)
    if offset:
        seed = (seed if seed is not None else (options["cfg"] or entry.main_config).get("seed", 0)) + offset
    _node = node = _Node(layout, options["auto_recover"])
    restarted_learner = role is Role.LEARNER and task.router.restarts > 0  # auto_recover: go on where it died
    task.add_role(role)  # kept through main()'s `with task.start()`, cleared when it exits
    try:
        ctx = entry.main(options["cfg"], seed=seed, exp_name=options["exp_name"], max_env_step=options["max_env_step"],
                         max_train_iter=options["max_train_iter"], resume=options["resume"] or restarted_learner,
                         progress=options["progress"] and role is Role.LEARNER,
                         ckpt_interval=options["ckpt_interval"])
    finally:
        _node = None
    if not node.ran:
        raise ConfigError(f"zoo entry '{entry_name}' has no distributed mode: only online entries (trained by "
                          f"train_online) split into learner, collectors and evaluators")
    return {"node_id": node_id, "role": role.value, "pid": os.getpid(), "restarts": task.router.restarts,
            "env_step": int(ctx.env_step),
            "train_iter": int(ctx.train_iter), "last_eval_value": ctx.last_eval_value, "collected": node.collected,
            "first_step_at": node.first_step_at}


def train_node(cfg: EasyDict, policy: Any, collection: Collection, build: Callable[[List[Any], Any], None],
               report: Callable[[], None], *, buffer: Any, resume: bool, async_mode: bool, ckpt_freq: int,
               ckpt_interval: Optional[float]) -> OnlineRLContext:
    """:func:`~conveyor.zoo._online.train_online` on one node of a distributed run (the process has its role):
    this node's envs and middleware, the exchangers first; the learner also saves, reports and resumes."""
    if async_mode:
        raise ConfigError("async_mode: in a distributed run collection already overlaps training (collectors are "
                          "their own processes); leave --async out")
    node = _node if _node is not None else _Node(Layout(1))
    node.ran = True
    learner, collector, evaluator = (task.has_role(role) for role in (Role.LEARNER, Role.COLLECTOR, Role.EVALUATOR))
    if collector:
        cfg = _collector_share(cfg, node.layout.collectors)
    with contextlib.ExitStack() as resources:
        stage: List[Any] = []
        evaluator_env = None
        if collector:
            stage = collection(cfg, policy, resources.enter_context(make_env_manager(cfg.env, "collector", cfg.seed)))
        if evaluator:
            evaluator_env = resources.enter_context(make_env_manager(cfg.env, "evaluator", cfg.seed))
        with task.start(ctx=OnlineRLContext()):
            if learner:
                NodeTable(experiment_dir(cfg) / NODES_FILE, keep=task.router.restarts > 0)  # none announces again
            else:
                NodeTable.announce(EXCHANGE_TIMEOUT_S)
            rejoin_s = EXCHANGE_TIMEOUT_S if node.auto_recover else 0.0  # a lost learner is restarted: wait for it
            clock = LearnerClock(lead=COLLECTOR_LEAD, timeout_s=EXCHANGE_TIMEOUT_S, rejoin_s=rejoin_s)
            task.use(clock)
            task.use(ModelExchanger(policy, max_staleness=0 if buffer is None else None, timeout_s=EXCHANGE_TIMEOUT_S,
                                    rejoin_s=rejoin_s))
            task.use(ContextExchanger(timeout_s=EXCHANGE_TIMEOUT_S, rejoin_s=rejoin_s))
            build(stage, evaluator_env)
            if learner:
                task.use(RemoteEvaluations(policy))  # before the saver and the loggers: it sees each result first
                saver = use_saving(cfg, policy, report, buffer=buffer, resume=resume, ckpt_freq=ckpt_freq,
                                   ckpt_interval=ckpt_interval)
                if node.auto_recover and not resume:  # a restarted learner always finds a checkpoint to resume
                    saver.save(LATEST)
            task.run()  # SIGTERM from the launcher (Parallel.runner's worker handler) finishes the iteration, then
            ctx = task.ctx  # the run ends normally and the learner writes its final checkpoint
    node.collected, node.first_step_at = clock.collected, clock.first_step_at
    return ctx


def _collector_share(cfg: EasyDict, collectors: int) -> EasyDict:
    """One collector's part: ``1 / collectors`` of the collector envs and of the transitions per call, rounded up."""
    share = copy.deepcopy(cfg)
    share.env.collector_env_num = math.ceil(cfg.env.collector_env_num / collectors)
    share.policy.collect.n_sample = math.ceil(cfg.policy.collect.n_sample / collectors)
    return share


@declares(reads=("train_iter", "env_step"), writes=("train_iter", "env_step"))
class LearnerClock:
    """The learner's counters for the other nodes, and the end of the run.

    Learner: after each iteration it sends ``train_iter`` and ``env_step`` on :data:`PROGRESS_TOPIC`; when
    its run ends it sends ``stop`` (once every live peer listens, at most ``timeout_s`` later).
    Others: before each iteration they take the learner's counters (a collector's ``env_step`` becomes the
    larger of its own and the learner's, so exploration schedules follow the whole run). A collector that
    ran ``lead`` iterations since they last moved waits until they move; an evaluator waits so before
    every iteration but its first. ``stop`` sets ``task.finish``. :attr:`collected` counts the env steps
    this node's own iterations added; :attr:`first_step_at` is the ``time.time()`` when they first added
    any (a collector's start-up ends there). Every wait is bounded by ``timeout_s``, and ends at once when the
    node is asked to stop (:data:`~conveyor.engine.STOP_EVENT`) or the learner is lost (a warning; the
    node's run then ends, as it does on ``stop``: there is nothing left to collect or evaluate for). With
    ``rejoin_s`` > 0 (the zoo's under ``auto_recover``) a lost learner instead restarts the count of
    iterations, and the exchangers (given the same ``rejoin_s``) wait for it to come back.

    Reads / writes ctx: ``train_iter``, ``env_step``. Place it first, before the exchangers.
    """

    def __init__(self, lead: int = COLLECTOR_LEAD, timeout_s: float = EXCHANGE_TIMEOUT_S,
                 rejoin_s: float = 0.0) -> None:
        if not isinstance(lead, int) or lead < 1:
            raise ValueError(f"LearnerClock(lead={lead!r}): must be an int >= 1")
        self.timeout_s, self.rejoin_s = timeout_s, rejoin_s
        self.collected = 0
        self.first_step_at: Optional[float] = None
        self._router = task.router
        self._learner = task.has_role(Role.LEARNER)
        self._lead = lead if task.has_role(Role.COLLECTOR) else 1
        self._since = 0  # iterations since the learner's counters last moved
        self._changed = threading.Condition()
        self._latest: Optional[Dict[str, Any]] = None
        self._seen: Optional[tuple] = None
        self._ended = False  # asked to stop, or the learner is lost
        self._rejections = Rejections(f"LearnerClock on node {self._router.node_id}")
        if self._learner:
            task.on(FINISH_EVENT, self._stop_others)
        else:
            self._router.on(PROGRESS_TOPIC, self._rejections(self._got, PROGRESS_TOPIC))
            task.on(STOP_EVENT, self._end)
            task.on(PEER_LOST_EVENT, self._peer_lost)

    def _end(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def stats(self) -> Dict[str, int]:
        """``rejected``: progress messages dropped on receipt as not what :data:`PROGRESS_TOPIC` carries."""
        return {"rejected": self._rejections.count}

    def _peer_lost(self, node: Any) -> None:
        latest, peers = self._latest, self._router.peers()
        if (latest is not None and str(node) == latest["node"]) or not peers:
            goodbye = str(node) in peers or (latest is not None and latest["stop"])  # it finished, not a loss
            if not goodbye and self.rejoin_s:  # the exchangers wait for it to come back; collect on meanwhile
                log.warning("node %s: the learner (node %s) is lost; waiting up to %ss for it to rejoin",
                            self._router.node_id, node, self.rejoin_s)
                with self._changed:
                    self._since = 0
                    self._changed.notify_all()
                return
            log.log(logging.INFO if goodbye else logging.WARNING, "node %s: the learner (node %s) %s; this node ends "
                    "its run", self._router.node_id, node, "has finished" if goodbye else "is lost")
            self._end()

    def __repr__(self) -> str:
        return f"LearnerClock({'learner' if self._learner else f'lead={self._lead}'}, timeout_s={self.timeout_s})"

    def _got(self, progress: Any) -> None:
        check_fields(progress, node=lambda v: isinstance(v, str), train_iter=int, env_step=int,
                     stop=lambda v: isinstance(v, bool))
        with self._changed:
            self._latest = progress
            self._changed.notify_all()
        if progress["stop"]:
            task.finish = True

    def _moved(self) -> bool:
        latest = self._latest
        return self._ended or latest is not None and (latest["stop"] or
                                                      (latest["train_iter"], latest["env_step"]) != self._seen)

    def __call__(self, ctx: OnlineRLContext) -> Iterator[None]:
        if self._learner:
            yield
            self._router.publish(PROGRESS_TOPIC, self._progress(ctx, stop=False))
            return
        with self._changed:
            if self._since >= self._lead and not self._changed.wait_for(
                    lambda: self._moved() or self._since < self._lead, self.timeout_s):  # 0 again: the learner was lost
                raise TimeoutError(f"node {self._router.node_id}: the learner's counters did not move within "
                                   f"{self.timeout_s}s (live peers: {self._router.peers()}); is the learner running?")
            latest = self._latest
        if self._ended or (latest is not None and latest["stop"]):
            task.finish = True
            task.end_iteration()
            yield
            return
        if self._moved():
            self._seen, self._since = (latest["train_iter"], latest["env_step"]), 0
            ctx.train_iter = max(ctx.train_iter, latest["train_iter"])
            ctx.env_step = max(ctx.env_step, latest["env_step"])
        self._since += 1
        before = ctx.env_step
        yield
        if ctx.env_step > before and self.first_step_at is None:
            self.first_step_at = time.time()
        self.collected += ctx.env_step - before

    def _stop_others(self, error: Optional[BaseException]) -> None:
        peers = self._router.peers()
        try:
            self._router.wait_for_subscribers(PROGRESS_TOPIC, len(peers), timeout=self.timeout_s)
        except TimeoutError as e:
            log.warning("learner: telling the nodes that listen to stop; not every peer does: %s", e)
        self._router.publish(PROGRESS_TOPIC, self._progress(task.ctx, stop=True))

    def _progress(self, ctx: OnlineRLContext, stop: bool) -> Dict[str, Any]:
        return {"node": str(self._router.node_id), "train_iter": int(ctx.train_iter), "env_step": int(ctx.env_step),
                "stop": stop}


@declares(writes=("last_eval_value", "last_eval_iter"))
class RemoteEvaluations:
    """Learner: the evaluations of evaluator nodes (``EVAL_EVENT`` from other processes).

    Each result's weights are bound to the learner's policy (so the checkpoint saver's ``eval_best`` and a
    final checkpoint at the stop value hold the evaluated weights with the learner's optimizer); one that
    reached the stop value ends the run. Before each iteration, and when the run ends, the newest result
    goes into the context. Make it before the checkpoint saver and the loggers, so it sees each result first.

    Writes ctx: ``last_eval_value``, ``last_eval_iter``.
    """

    def __init__(self, policy: Any) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self._newest: Optional[Dict[str, Any]] = None
        self._rejections = Rejections("RemoteEvaluations on the learner")
        task.on(EVAL_EVENT, self._rejections(self._got, EVAL_EVENT))
        task.on(FINISH_EVENT, lambda error: self(task.ctx))

    def stats(self) -> Dict[str, int]:
        """``rejected``: evaluation results dropped on receipt (no ``mean`` number, no ``train_iter`` count)."""
        return {"rejected": self._rejections.count}

    def __repr__(self) -> str:
        return "RemoteEvaluations()"

    def _got(self, result: Any) -> None:
        check_fields(result, mean=lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), train_iter=int)
        snapshot = result.get("snapshot")
        if isinstance(snapshot, EvaluatedWeights):
            snapshot.policy = self._policy
        with self._lock:
            self._newest = result
        if result.get("stop_value_reached"):
            task.finish = True

    def __call__(self, ctx: OnlineRLContext) -> None:
        with self._lock:
            newest = self._newest
        if newest is not None:
            ctx.last_eval_value, ctx.last_eval_iter = newest["mean"], newest["train_iter"]
