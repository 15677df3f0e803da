"""Distributed runs: L learners, N collectors and M evaluators as separate processes (``Parallel.runner``).

    conveyor train cartpole/dqn --collectors 2 --evaluators 1
    conveyor train cartpole/dqn --collectors 2 --learners 2     # two data-parallel learners (learners.py)

Every node runs the entry's own ``main()``. :func:`train_distributed` starts the nodes; each gets its role
from its node id (0..L-1 the learners, then N collectors, then the evaluators) before it calls ``main()``, whose
:class:`~conveyor.run.Run` then builds this node's part of the pipeline: ``task.use(..., role=...)`` drops
the middleware of the other roles, and ``run.env(kind)`` starts only the envs this node uses.

- all: :class:`~conveyor.middleware.distributed.LearnerClock`, ``ModelExchanger``, ``ContextExchanger`` first
  (:func:`use_node_links`), then the entry's middleware of the node's role.
- learner: trains on what the collectors send (with several, each on its collectors' share, as one
  data-parallel group: conveyor/run/learners.py); node 0 (rank 0) owns the checkpoints (saver, logger,
  progress bar, ``--resume``), ``runs/<exp>/nodes.json`` (every node's id, roles, pid, host and address) and
  the end of the run (its budget, or an evaluation at the stop value), which it tells the others.
- collector: its share of the collection (``collector_env_num`` and ``n_sample`` divided by N, rounded up,
  so the collectors together bring per learner iteration what one process would collect), seed + node id.
  A collector runs at most ``COLLECTOR_LEAD`` iterations per learner iteration (collection overlaps
  training without taking the learner's CPU); on-policy entries (no replay buffer, unless the policy class says
  ``learns_on_policy = False``, as IMPALA's does) collect each batch on the newest weights (``max_staleness=0``).
- evaluator: waits until the learner's counters move, then evaluates as the entry does (on the learner's
  ``env_step`` and ``train_iter``, and the first evaluator with the run's seed, so on the episodes one
  process evaluates on); its results reach the learner, whose saver writes ``eval_best`` with the
  weights that were evaluated.
- inference server (``inference="server"``, the last node): acts for every collector in one forward pass
  (:mod:`conveyor.middleware.inference`, on CUDA where there is one); the nodes then dial each other (a mesh).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from easydict import EasyDict

from conveyor.engine import Role, task
from conveyor.engine.parallel.cluster import NodeTable
from conveyor.middleware import ContextExchanger, ModelExchanger
from conveyor.middleware.ledger import LEDGER_DIR, SendLedger, TakeLedger, transition_account
from conveyor.policy import configured_device
from conveyor.schema import ConfigError
from conveyor.middleware.distributed import COLLECTOR_LEAD, EXCHANGE_TIMEOUT_S, LearnerClock
from conveyor.run.acting import INFERENCE, default_inference
from conveyor.run.directory import NODES_FILE, check_layout, check_new, run_directory
from conveyor.run.entries import entry_reference, import_entry

log = logging.getLogger("conveyor.run")

__all__ = ["DistributedRun", "Layout", "Node", "check_learners", "check_peer_timeout", "collector_share",
           "current_node", "is_offline", "learner_share", "train_distributed", "use_node_links"]


def is_offline(config: Mapping[str, Any]) -> bool:
    """Whether an entry with ``config`` (its ``main_config``) trains from a dataset (``policy.other.dataset``)."""
    return "dataset" in (config or {}).get("policy", {}).get("other", {})


@dataclass(frozen=True)
class Layout:
    """Which node does what: nodes ``0..learners-1`` learn (data-parallel, rank = node id; node 0, rank 0, owns the
    run), the next ``collectors`` collect, the next ``evaluators`` evaluate, and with ``inference="server"`` one
    more node acts for the collectors (:attr:`server`); with no evaluator nodes node 0 evaluates too (between its
    updates, as in one process), so ``stop_value`` still ends the run."""

    collectors: int
    evaluators: int = 0
    learners: int = 1
    inference: str = "local"

    def __post_init__(self) -> None:
        if self.inference not in INFERENCE:
            close = [name for name in INFERENCE if str(self.inference).lower().startswith(name[:2])]
            raise ConfigError(f"--inference {self.inference!r}: must be one of {', '.join(INFERENCE)}"
                              + (f"; did you mean {close[0]}?" if close else ""))
        for name, value, least in (("collectors", self.collectors, 1), ("evaluators", self.evaluators, 0),
                                   ("learners", self.learners, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"--{name} {value!r}: must be an int >= {least}")
        if self.learners > self.collectors:
            raise ConfigError(f"--learners {self.learners} with --collectors {self.collectors}: each learner trains on "
                              f"its own collectors' data (the i-th collector sends to learner i mod L), so give at "
                              f"least as many collectors as learners")

    @property
    def n_nodes(self) -> int:
        """Learners, collectors, evaluators and the inference server together."""
        return self.learners + self.collectors + self.evaluators + (self.inference == "server")

    @property
    def server(self) -> Optional[int]:
        """The node id of the inference server (the last node), or None with ``inference="local"``."""
        return self.n_nodes - 1 if self.inference == "server" else None

    def role(self, node_id: int) -> Role:
        """The role of node ``node_id``."""
        if not isinstance(node_id, int) or not 0 <= node_id < self.n_nodes:
            learners = "0 the learner" if self.learners == 1 else f"0..{self.learners - 1} the learners"
            raise ConfigError(f"node id {node_id!r}: this run has nodes 0..{self.n_nodes - 1} ({learners}, "
                              f"{self.learners}..{self.learners + self.collectors - 1} collectors, then "
                              f"{self.evaluators} evaluators" + (", then the inference server" if self.server else "")
                              + ")")
        if node_id < self.learners:
            return Role.LEARNER
        if node_id == self.server:
            return Role.COLLECTOR  # it acts for the collectors: a receiver of the learner's weights
        return Role.COLLECTOR if node_id < self.learners + self.collectors else Role.EVALUATOR

    def roles(self, node_id: int) -> List[Role]:
        """The roles node ``node_id`` takes: :meth:`role`, and node 0 also evaluates when no node does."""
        role = self.role(node_id)
        return [role, Role.EVALUATOR] if node_id == 0 and self.evaluators == 0 else [role]

    def learner_of(self, node_id: int) -> int:
        """The rank (node id) of the learner that collector ``node_id`` sends to: the i-th collector's is ``i mod
        learners``; a learner's is its own."""
        if self.role(node_id) is Role.LEARNER:
            return node_id
        return (node_id - self.learners) % self.learners

    def seed_offset(self, node_id: int) -> int:
        """What node ``node_id`` adds to the run's seed: the i-th collector (from 0) i + 1 (each its own env stream,
        its node id with one learner), the k-th evaluator k (the first evaluates on the episodes one process would),
        a learner 0."""
        role = self.role(node_id)
        if role is Role.COLLECTOR:
            return node_id - self.learners + 1
        return node_id - self.learners - self.collectors if role is Role.EVALUATOR else 0


@dataclass
class Node:
    """This worker's part of a distributed run: its layout, whether a lost learner is restarted, and what the
    node did (``ran``: its main() trained in a Run, its policy on ``device``; ``collected`` env steps from
    ``first_step_at``; a learner: ``local_rank`` among the learners on its host, ``received`` env steps by collector
    node id, ``params_sha256`` of its final weights, and ``sync``, the learners' agreement where there are several;
    ``ledger``: its transition count, :mod:`conveyor.middleware.ledger`; ``exchanger``: its ContextExchanger)."""

    layout: Layout
    auto_recover: bool = False
    local_rank: int = 0
    ran: bool = False
    device: Optional[str] = None
    collected: int = 0
    first_step_at: Optional[float] = None
    received: Dict[str, int] = field(default_factory=dict)
    params_sha256: Optional[str] = None
    sync: Any = None
    ledger: Any = None
    exchanger: Any = None


_node: Optional[Node] = None


@dataclass
class DistributedRun:
    """What :func:`train_distributed` returns: the learner's counters and last evaluation (when the learner
    ran on another host: the newest the nodes here heard of), and a summary of every node started here
    (``node_id``, ``role``, ``pid``, ``device``: where its policy ran, ``env_step``, ``train_iter``,
    ``last_eval_value``, ``collected``: env steps a collector collected, ``first_step_at``: the ``time.time()`` of
    its first collected step; a learner's ``rank``, ``received``: the env steps it received, ``received_from``: those
    by collector node id, ``shared_batches``: the batches among them that came through shared memory,
    ``params_sha256``: a hash of its final weights and optimizer state, equal on every learner
    of the group, and with several learners of an entry without a replay buffer (conveyor/run/learners.py)
    ``kept``: the env steps it trained on, the same on every learner, and ``dropped``: those it left out).
    ``transitions``: the run's transition account (:func:`~conveyor.middleware.ledger.transition_account`) where it
    had one learner and every node ran here, else None."""

    env_step: Optional[int] = None
    train_iter: Optional[int] = None
    last_eval_value: Optional[float] = None
    nodes: List[Dict[str, Any]] = field(default_factory=list)
    transitions: Optional[Dict[str, Any]] = None


def train_distributed(entry: ModuleType, *, collectors: int, evaluators: int = 0, learners: int = 1,
                      cfg: Optional[Mapping[str, Any]] = None,
                      seed: Optional[int] = None, exp_name: Optional[str] = None, max_env_step: Optional[int] = None,
                      max_train_iter: Optional[int] = None, resume: bool = False, progress: bool = True,
                      ckpt_interval: Optional[float] = None, no_stop: bool = False,
                      evaluation_hook: Optional[Callable[[Dict[str, Any]], bool]] = None,
                      protocol: str = "ipc", address: Optional[str] = None,
                      ports: Union[int, Sequence[int], None] = None,
                      node_ids: Optional[Sequence[int]] = None, attach_to: Optional[Sequence[str]] = None,
                      secret: Optional[bytes] = None, auto_recover: bool = False,
                      max_retries: Optional[int] = None, ready_timeout_s: float = 60.0,
                      grace_s: float = 30.0, restarts_before: int = 0,
                      peer_timeout_s: Optional[float] = None, inference: Optional[str] = None) -> DistributedRun:
    """Train ``entry`` (an entry module: ``conveyor.zoo.load_entry("cartpole/dqn")``) with ``learners``
    data-parallel learners (conveyor/run/learners.py), ``collectors`` collectors and ``evaluators`` evaluators,
    each its own process; the other arguments are the entry ``main()``'s
    and ``Parallel.runner``'s. Several learners refuse ``resume`` and ``auto_recover`` (:func:`check_learners`).

    ``node_ids``: the nodes to start here (default all); give each host its share and the others'
    addresses (``attach_to``), with the same secret on every host, to spread one run over several.
    ``grace_s``: how long a stopped launch (SIGTERM, Ctrl-C) lets its nodes finish their iteration, the
    learner write its final checkpoint, before they are killed. ``auto_recover``: a node that dies is
    started again (up to ``max_retries`` times); a collector or evaluator rejoins with the newest weights,
    a learner resumes from the run's latest checkpoint (it writes one as it starts) while the others wait
    for it (at most :data:`EXCHANGE_TIMEOUT_S`) and rejoin it. ``restarts_before``: how many times the nodes
    here were restarted before this call, by whatever started it again (``--launcher ray``: Ray restarting the
    node's actor); a learner among them above 0 resumes as a restarted one does. ``evaluation_hook`` (it must
    pickle) goes to node 0's ``main()`` alone: the :class:`~conveyor.run.Run` option, where the run is owned.
    ``peer_timeout_s``: how long every node's router tolerates a silent peer before it is lost (None: the
    :class:`~conveyor.engine.parallel.router.Router`'s 5 s; its heartbeat is a quarter of one under 2 s). ``inference``:
    ``"server"`` adds an inference server node acting for every collector (one host's run only), ``"local"`` has each
    collector act itself; None: :func:`~conveyor.run.acting.default_inference`. The learners
    end the launch: a node here still running a peer timeout after they returned (it missed the run's end: stopped,
    or cut off) is stopped as on SIGTERM (``Parallel.runner``'s ``ends_with``).
    """
    from conveyor.engine import Parallel

    if inference is None:
        inference = default_inference(cfg if cfg is not None else entry.main_config, torch.cuda.is_available(),
                                      one_host=node_ids is None and not attach_to, collectors=collectors)
    layout = Layout(collectors, evaluators, learners, inference)
    if layout.server is not None and (node_ids is not None or attach_to):
        raise ConfigError("--inference server: the server acts for the collectors of one host's run, started here "
                          "whole; with --node-ids or --attach-to use --inference local")
    check_peer_timeout(peer_timeout_s)
    ids = list(range(layout.n_nodes)) if node_ids is None else list(node_ids)
    for node_id in ids:
        layout.role(node_id)
    loaded, entry = entry, entry_reference(entry)
    if is_offline(loaded.main_config):
        raise ConfigError(f"{entry} trains offline from a dataset, with no collectors or evaluators to spread "
                          f"over processes: drop --collectors/--evaluators")
    if learners > 1:
        config = cfg if cfg is not None else loaded.main_config
        check_learners(entry, config, resume=resume, auto_recover=auto_recover, learners=learners)
        from conveyor.run.learners import check_learner_gpus
        check_learner_gpus(str(configured_device(config.get("policy", {}))), sum(i < learners for i in ids),
                           torch.cuda.device_count)
    if 0 in ids:  # the learner's run directory is here: a taken name, or a one-process run, refused before any start
        run_dir = run_directory(cfg if cfg is not None else loaded.main_config, exp_name)
        if resume:
            check_layout(run_dir, distributed=True)
            _check_one_learner(run_dir)
        elif restarts_before == 0:  # a restarted learner resumes the run it finds there
            check_new(run_dir)
    options = {"cfg": None if cfg is None else EasyDict(copy.deepcopy(dict(cfg))), "seed": seed,
               "exp_name": exp_name, "max_env_step": max_env_step, "max_train_iter": max_train_iter, "resume": resume,
               "progress": progress,
               "ckpt_interval": ckpt_interval, "auto_recover": auto_recover, "no_stop": no_stop, "started_here": ids,
               "evaluation_hook": evaluation_hook}
    router_options = None if peer_timeout_s is None else {"peer_timeout_s": peer_timeout_s}
    # a mesh where collectors send to every learner's rank, not node 0's alone, or to the inference server
    topology = "star" if learners == 1 and layout.server is None else "mesh"
    results = Parallel.runner(len(ids), topology=topology, protocol=protocol, address=address, ports=ports,
                              attach_to=attach_to, node_ids=ids, secret=secret, auto_recover=auto_recover,
                              max_retries=max_retries, ready_timeout_s=ready_timeout_s, grace_s=grace_s,
                              restarts_before=restarts_before, router_options=router_options,
                              ends_with=range(layout.learners))(_node_main, entry, layout, options)
    nodes = [r for r in results if r is not None]
    told = [n for n in nodes if n["node_id"] == 0] or nodes  # else: as the nodes here heard it
    newest = max(told, key=lambda n: (n["env_step"], n["last_eval_value"] is not None), default=None)
    if newest is None:
        return DistributedRun()
    account = None
    if learners == 1 and len(ids) == layout.n_nodes:  # every ledger is in this host's run directory
        try:
            account = transition_account(run_directory(cfg if cfg is not None else loaded.main_config, exp_name))
        except (OSError, ValueError) as e:
            log.warning("no transition account for this run: %s", e)
    if account is not None:
        log.info("transitions collected %d = in replay %d + replaced %d + dropped %d %s + unaccounted %d",
                 account["collected"], account["in_replay"], account["replaced"], sum(account["dropped"].values()),
                 account["dropped"], account["unaccounted"])
    return DistributedRun(newest["env_step"], newest["train_iter"], newest["last_eval_value"], nodes, account)


def _check_one_learner(run_dir: Path) -> None:
    """Refuse to resume a run that several learners trained (its ``nodes.json`` lists more than one): its
    checkpoints hold rank 0's replay shard alone, and the pipeline of another layout."""
    try:
        rows = json.loads((run_dir / NODES_FILE).read_text())
        learners = sum("learner" in row["roles"] for row in rows)
    except (OSError, ValueError, TypeError, KeyError):
        return  # no readable table: check_layout has judged the run
    if learners > 1:
        raise ConfigError(f"cannot resume '{run_dir.name}': {learners} data-parallel learners trained it, and a run "
                          f"of several learners cannot be resumed yet (its checkpoints hold rank 0's replay shard "
                          f"alone); start a new run")


def _node_main(entry_name: str, layout: Layout, options: Dict[str, Any]) -> Dict[str, Any]:
    """One worker: take the role of its node id and run the entry's ``main()``; a summary of what it did."""
    global _node
    node_id = task.router.node_id
    role = layout.role(node_id)
    entry = import_entry(entry_name)
    seed = options["seed"]
    offset = layout.seed_offset(node_id)
    if offset:
        seed = (seed if seed is not None else (options["cfg"] or entry.main_config).get("seed", 0)) + offset
    _node = node = Node(layout, options["auto_recover"])
    if role is Role.LEARNER:
        from conveyor.run.learners import learner_local_rank
        node.local_rank = learner_local_rank(node_id, options["started_here"], layout.learners, os.environ)
    restarted_learner = role is Role.LEARNER and task.router.restarts > 0  # auto_recover: go on where it died
    hook = options["evaluation_hook"] if node_id == 0 else None
    for taken in layout.roles(node_id):
        task.add_role(taken)  # kept through main()'s `with task.start()`, cleared when it exits
    try:
        ctx = entry.main(options["cfg"], seed=seed, exp_name=options["exp_name"], max_env_step=options["max_env_step"],
                         max_train_iter=options["max_train_iter"], resume=options["resume"] or restarted_learner,
                         progress=options["progress"] and node_id == 0,
                         ckpt_interval=options["ckpt_interval"], **({"no_stop": True} if options["no_stop"] else {}),
                         **({"evaluation_hook": hook} if hook is not None else {}))
    finally:
        _node = None
    if not node.ran:
        raise ConfigError(f"entry '{entry_name}' has no distributed mode: only online entries (those whose main() "
                          f"trains in a conveyor.run.Run) split into learner, collectors and evaluators")
    return {"node_id": node_id, "role": "inference" if node_id == layout.server else role.value, "pid": os.getpid(),
            "device": node.device,
            "restarts": task.router.restarts, "env_step": int(ctx.env_step),
            "train_iter": int(ctx.train_iter), "last_eval_value": ctx.last_eval_value, "collected": node.collected,
            "first_step_at": node.first_step_at,
            **({"offered": node.ledger.offered} if isinstance(node.ledger, SendLedger) else {}),
            **({"rank": node_id, "received": sum(node.received.values()), "received_from": dict(node.received),
                "shared_batches": node.exchanger.shared.taken,
                **({"kept": node.sync.kept, "dropped": node.sync.dropped} if node.sync is not None
                   and node.sync.agree_rows else {}),
                "params_sha256": node.params_sha256} if role is Role.LEARNER else {})}


def current_node() -> "Node":
    """This process's part of a distributed run (set while a node runs ``main()``; a 1-collector layout for a
    process given roles by other means)."""
    return _node if _node is not None else Node(Layout(1))


def use_node_links(policy: Any, run_dir: Path, *, on_policy: bool, buffered: bool = True,
                   spaces: Optional[tuple] = None, resume: bool = False, shared_memory: bool = True) -> LearnerClock:
    """The first middleware of every node (inside ``task.start``): node 0 writes ``nodes.json`` (the others
    announce themselves), then :class:`LearnerClock`, ``ModelExchanger`` (``max_staleness=0`` for an on-policy
    entry; node 0 alone sends weights) and ``ContextExchanger`` (to or from this collector's learner). With several
    learners, these form their group and add :class:`~conveyor.run.learners.LearnerSync` (``node.sync``), which
    for an entry without a replay buffer (``buffered`` False) agrees on the rows of ``train_data`` each trains on.
    What a node takes from another is what that node may send: counters, weights and the run's end (``task.finish``)
    from the learners only, batches from
    this learner's collectors only, checked against the env's ``spaces`` (a learner's). A collector on the learner's
    host counts what it sends in ``run_dir/ledger`` (going on from there when restarted or ``resume``; one on
    another host, where node 0 made no run directory, counts nothing), the learner what it takes
    (``node.ledger``, :mod:`conveyor.middleware.ledger`). ``shared_memory``: batches between a collector and
    a learner on one host go through shared memory (config key ``transport``). Returns the clock."""
    node = current_node()
    node.ran, node.device = True, str(getattr(policy, "device", "cpu"))
    node_id, layout = task.router.node_id, node.layout
    learner = task.has_role(Role.LEARNER)
    if node_id == 0:
        NodeTable(run_dir / NODES_FILE, keep=task.router.restarts > 0)
    else:
        NodeTable.announce(EXCHANGE_TIMEOUT_S)
    rejoin_s = EXCHANGE_TIMEOUT_S if node.auto_recover else 0.0  # a lost learner is restarted: wait for it
    task.finish_from(range(layout.learners))  # the learners end the run; another node's task.finish is refused
    clock = LearnerClock(lead=COLLECTOR_LEAD, timeout_s=EXCHANGE_TIMEOUT_S, rejoin_s=rejoin_s,
                         publish=node_id == 0 or not learner, learner=0)
    task.use(clock)
    if node_id == 0 or not learner:
        task.use(ModelExchanger(policy, max_staleness=0 if on_policy else None, timeout_s=EXCHANGE_TIMEOUT_S,
                                rejoin_s=rejoin_s, learners=[0]))
    shard = layout.learner_of(node_id) if node_id < layout.learners + layout.collectors else 0
    collectors = [node for node in range(layout.learners, layout.learners + layout.collectors)
                  if layout.learner_of(node) == shard]
    restarts = task.router.restarts
    if learner:
        node.ledger = TakeLedger(run_dir / LEDGER_DIR / "learner.json" if layout.learners == 1 else None)
    elif task.has_role(Role.COLLECTOR) and run_dir.is_dir():  # the learner's host: another's writes nothing
        node.ledger = SendLedger(run_dir / LEDGER_DIR / f"collector-{node_id}.json", restarts, resume or restarts > 0)
    exchanger = ContextExchanger(timeout_s=EXCHANGE_TIMEOUT_S, rejoin_s=rejoin_s, shard=shard,
                                 spaces=spaces if learner else None, collectors=collectors, ledger=node.ledger,
                                 shared_memory=shared_memory)
    task.use(exchanger)
    node.exchanger = exchanger
    if learner:
        node.received = exchanger.received
    if learner and layout.learners > 1:
        from conveyor.run.learners import LearnerSync, join_learners
        node.sync = LearnerSync(join_learners(policy, node_id, layout.learners, EXCHANGE_TIMEOUT_S),
                                agree_rows=not buffered)
        task.use(node.sync)
    return clock


def check_peer_timeout(peer_timeout_s: Optional[float]) -> None:
    """Refuse, in one line, a peer timeout (``--peer-timeout``, ``peer_timeout_s``) that is not a finite number of
    seconds > 0; None (the router's default) passes."""
    if peer_timeout_s is None:
        return
    if isinstance(peer_timeout_s, bool) or not isinstance(peer_timeout_s, (int, float)) \
            or not 0 < peer_timeout_s < math.inf:
        raise ConfigError(f"--peer-timeout {peer_timeout_s!r}: must be a number of seconds > 0, how long a silent peer "
                          f"is tolerated before it is lost (e.g. --peer-timeout 2; default 5)")


def check_learners(entry: str, config: Mapping[str, Any], *, resume: bool, auto_recover: bool,
                   learners: int) -> None:
    """Refuse, in one line, what several data-parallel learners do not do: an on-policy ``batch_size`` that
    ``learners`` do not divide (:func:`learner_share`), ``resume`` and ``auto_recover``."""
    policy = config.get("policy", {})
    if "replay_buffer" not in policy.get("other", {}):
        batch_size = policy.get("learn", {}).get("batch_size")
        if isinstance(batch_size, int):  # else the schema's default, checked as each learner starts
            _check_batch_size(f"{entry}'s policy.learn.batch_size", batch_size, learners)
    if resume:
        raise ConfigError("--learners > 1 with --resume: a run of several learners cannot be resumed yet (only rank "
                          "0's replay shard is in its checkpoints); start a new run")
    if auto_recover:
        raise ConfigError("--learners > 1 with --auto-recover: a restarted learner cannot rejoin the learners' group; "
                          "leave --auto-recover out")


def learner_share(cfg: EasyDict, learners: int) -> EasyDict:
    """One of ``learners`` data-parallel learners' part of an entry without a replay buffer: ``1 / learners`` of
    ``policy.learn.batch_size`` (PPO's minibatch, IMPALA's unrolls per step), so the group's minibatch is the one
    of one learner; a ConfigError where it does not divide (:func:`check_learners` says so before any start)."""
    share = copy.deepcopy(cfg)
    batch_size = cfg.policy.learn.batch_size
    _check_batch_size("policy.learn.batch_size", batch_size, learners)
    share.policy.learn.batch_size = batch_size // learners
    return share


def _check_batch_size(key: str, batch_size: int, learners: int) -> None:
    if batch_size % learners:
        raise ConfigError(f"--learners {learners}: {key} ({batch_size}) must be a multiple of the learners (each "
                          f"takes batch_size / L of every minibatch): set it to "
                          f"{batch_size // learners * learners or learners} or change --learners")


def collector_share(cfg: EasyDict, collectors: int) -> EasyDict:
    """One collector's part: ``1 / collectors`` of the collector envs and of the transitions per call, rounded up."""
    share = copy.deepcopy(cfg)
    share.env.collector_env_num = math.ceil(cfg.env.collector_env_num / collectors)
    share.policy.collect.n_sample = math.ceil(cfg.policy.collect.n_sample / collectors)
    return share
