"""How a :class:`~conveyor.run.Run` opens, in each of its layouts: the one place that decides which it is.

:func:`open_run` picks one of :func:`single_process`, :func:`offline`, :func:`asynchronous`,
:func:`distributed`, :func:`data_parallel` and :func:`inference_server`; each compiles the run's config (:func:`_configure`), builds
its policy where it acts or learns and starts the pipeline (``task.start``) with what that layout adds. An
async run's collector process opens with :func:`in_collector_process` instead
(:class:`conveyor.run.core.CollectorSide`). ``run`` is a :class:`~conveyor.run.Run` throughout.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping

import torch
from easydict import EasyDict

from conveyor.data import dataset_root, load_dataset
from conveyor.engine import OfflineRLContext, OnlineRLContext, Role, task
from conveyor.engine.parallel.cluster import NodeTable
from conveyor.middleware import ModelExchanger
from conveyor.middleware.collector_process import ProcessCollector
from conveyor.middleware.distributed import EXCHANGE_TIMEOUT_S, PROGRESS_TOPIC, RemoteEvaluations
from conveyor.middleware.inference import InferenceServer, RemoteActing
from conveyor.envs import env_spaces, make_env_manager
from conveyor.middleware.double_buffer import EnvGroups
from conveyor.policy import configured_device
from conveyor.schema import ConfigError
from conveyor.run.control import run_log, seed_everything
from conveyor.run.directory import LOG_FILE, experiment_dir, prepare
from conveyor.run.nodes import Node, collector_share, current_node, learner_share, use_node_links

__all__ = ["DatasetMissing", "asynchronous", "data_parallel", "distributed", "env_manager", "in_collector_process",
           "inference_server", "offline", "open_run", "single_process"]

log = logging.getLogger("conveyor.run")


class DatasetMissing(FileNotFoundError):
    """An offline entry's dataset is not in the local dataset folder; the message says which commands build it."""


def open_run(run: Any) -> None:
    """Open ``run`` in its layout: a node of a distributed run (given roles before the entry's ``main()``), with
    one learner or several; else offline, async, or in one process."""
    _check_options(run)
    if task.roles:
        node = current_node()
        if task.router.node_id == node.layout.server:
            inference_server(run, node)
        else:
            (data_parallel if node.layout.learners > 1 else distributed)(run, node)
    elif run._offline:
        offline(run)
    elif run._async:
        asynchronous(run)
    else:
        single_process(run)


def single_process(run: Any) -> None:
    """Every middleware in this process, one after the other."""
    _configure(run)
    run.policy = run._policy_cls(run.cfg.policy)
    _own_run_dir(run)
    _start(run, OnlineRLContext())


def offline(run: Any) -> None:
    """One process training from the entry's dataset (``run.dataset``), found before the run directory is made:
    a missing one leaves none."""
    if not run._resume:
        run.dataset = _load_dataset(run, run._given if run._given is not None else run._main_config)
    _configure(run)
    if run.dataset is None:
        run.dataset = _load_dataset(run, run.cfg)
    run.policy = run._policy_cls(run.cfg.policy)
    _own_run_dir(run)
    _start(run, OfflineRLContext(), async_mode=run._async)


def asynchronous(run: Any) -> None:
    """Collection overlaps training: the collector-role middleware run in a child process (a
    :class:`ProcessCollector` built by calling the entry's pipeline there), or with ``env.async_collector:
    thread`` in a thread of this process."""
    _configure(run)
    run.policy = run._policy_cls(run.cfg.policy)
    _own_run_dir(run)
    if run.cfg.env.async_collector == "thread":
        _start(run, OnlineRLContext(), async_mode=True)
        return
    run._env_stack = run._resources.enter_context(contextlib.ExitStack())
    run.env("evaluator")  # first: a ProcessCollector may pin this thread, which later processes inherit
    run._collector = run._resources.enter_context(ProcessCollector(run.collector_side(), run.policy))
    run._resources.enter_context(task.start(async_mode=True, ctx=OnlineRLContext()))
    task.add_role(Role.LEARNER).add_role(Role.EVALUATOR)  # the collector role is the child's


def distributed(run: Any, node: Node) -> None:
    """A node of a distributed run with one learner: node 0 learns and owns the run, the others collect or
    evaluate on CPU (conveyor/run/nodes.py)."""
    learner = task.has_role(Role.LEARNER)
    _configure(run, owner=learner, distributed=True)
    run.policy = run._policy_cls(run.cfg.policy, device=None if learner else "cpu")
    _node_links(run, node, learner)


def data_parallel(run: Any, node: Node) -> None:
    """A node of a distributed run with several learners (conveyor/run/learners.py): rank 0 (node 0) alone owns
    the run; each learner takes its GPU and, without a replay buffer, its share of each minibatch; rank 0's own
    evaluations do not end the run before the other learners' iteration (:class:`RemoteEvaluations` does)."""
    learner = task.has_role(Role.LEARNER)
    _configure(run, owner=learner and task.router.node_id == 0, distributed=True)
    cfg = run.cfg
    if task.has_role(Role.EVALUATOR) and not run._no_stop:
        run._stop_here, cfg.env.stop_value = run._stop_value, None
    if learner:
        from conveyor.run.learners import learner_device
        device = learner_device(str(configured_device(cfg.policy)), node.local_rank, torch.cuda.device_count)
    else:
        device = "cpu"
    run.policy = run._policy_cls(cfg.policy, device=device)
    if learner and "replay_buffer" not in cfg.policy.other:  # a replay shard samples its part itself (ShardBuffer)
        run.cfg = learner_share(cfg, node.layout.learners)
    _node_links(run, node, learner)


def inference_server(run: Any, node: Node) -> None:
    """The inference server node (``--inference server``): a replica of the policy (on CUDA where there is one)
    on the learner's versions, acting for every collector (:class:`InferenceServer`); it builds no pipeline of
    the entry (``run.serving``) and ends with the learners."""
    _configure(run, owner=False, distributed=True)
    run.cfg = collector_share(run.cfg, node.layout.collectors)  # a request holds at most one collector's envs
    run.policy = run._policy_cls(run.cfg.policy, device="cuda" if torch.cuda.is_available() else "cpu")
    run._node, run.serving = node, True
    node.ran, node.device = True, str(run.policy.device)
    _start(run, OnlineRLContext())
    layout = node.layout
    NodeTable.announce(EXCHANGE_TIMEOUT_S)
    task.finish_from(range(layout.learners))
    task.router.on(PROGRESS_TOPIC, lambda progress: None)  # among the nodes a finishing learner tells to stop
    exchanger = ModelExchanger(run.policy, timeout_s=EXCHANGE_TIMEOUT_S, learners=[0])
    task.use(exchanger)
    task.use(InferenceServer(run.policy.collect_mode, lambda: exchanger.loaded_version, env_spaces(run.cfg.env)[0],
                             range(layout.learners, layout.learners + layout.collectors),
                             max_rows=run.cfg.env.collector_env_num, drain_s=EXCHANGE_TIMEOUT_S))


def in_collector_process(run: Any, cfg: EasyDict) -> None:
    """An async run's collector process: the parent's compiled ``cfg``, a CPU replica of the policy (collectors
    act on CPU; learners may not) and the collector role alone, so ``pipeline(run)`` builds the collection."""
    run.cfg = cfg
    seed_everything(cfg.seed)
    run.policy = run._policy_cls(cfg.policy, device="cpu")
    run._env_stack = run._resources.enter_context(contextlib.ExitStack())
    run._resources.enter_context(task.start(ctx=OnlineRLContext()))
    task.add_role(Role.COLLECTOR)


def env_manager(run: Any, kind: str) -> Any:
    """The env manager of ``kind`` ('collector' or 'evaluator') that ``run.env`` starts: a collector acting through
    an inference server gets its envs in two groups, one stepping while the server acts for the other
    (:class:`EnvGroups`), every other node one manager."""
    cfg, seed, node = run.cfg.env, run.cfg.seed, run._node
    if kind != "collector" or node is None or node.layout.server is None or cfg.collector_env_num < 2:
        return make_env_manager(cfg, kind, seed=seed)
    half = cfg.collector_env_num // 2
    first = make_env_manager({**cfg, "collector_env_num": half}, kind, seed=seed)
    try:
        return EnvGroups(first, make_env_manager({**cfg, "collector_env_num": cfg.collector_env_num - half}, kind,
                                                 seed=None if seed is None else seed + half))
    except BaseException:
        first.close()
        raise


# --- what the layouts share --------------------------------------------------------------------------------
def _check_options(run: Any) -> None:
    if task.roles and run._async:
        raise ConfigError("async_mode: in a distributed run collection already overlaps training (collectors are "
                          "their own processes); leave --async out")
    if task.roles and run._offline:
        raise ConfigError("an offline entry trains from a dataset, with no collectors or evaluators to spread over "
                          "processes: run it in one process (no roles, no --collectors)")
    if run._offline and run._max_env_step is not None:
        raise ConfigError(f"max_env_step={run._max_env_step}: an offline entry takes no env steps; bound it with "
                          f"max_train_iter (--max-train-iter) or policy.learn.max_train_iter")
    if run._max_train_iter is not None and (not isinstance(run._max_train_iter, int) or run._max_train_iter <= 0):
        raise ConfigError(f"max_train_iter={run._max_train_iter!r}: must be an int > 0")


def _configure(run: Any, *, owner: bool = True, distributed: bool = False) -> None:
    """Compile and save (or read back) the run's config and seed everything; ``no_stop`` drops the stop value
    (the saved config keeps it)."""
    cfg = prepare(run._main_config, run._policy_cls, run._given, seed=run._seed, exp_name=run._exp_name,
                  resume=run._resume, owner=owner, distributed=distributed)
    run._stop_value, run._owner = cfg.env.get("stop_value"), owner
    if owner and distributed:  # its run directory made, node 0 ends a run stopped before task.run with its final
        run._resources.enter_context(task.ahead_of_run())  # checkpoint (a worker's SIGTERM sets task.finish)
    if run._no_stop:
        cfg.env.stop_value = None  # the evaluators never end the run
    run.cfg, run.run_dir = cfg, experiment_dir(cfg)
    seed_everything(cfg.seed)


def _own_run_dir(run: Any) -> None:
    """The owner's log file ``runs/<exp_name>/log.txt``, open while the run is."""
    if run._owner:
        run._resources.enter_context(run_log(run.run_dir / LOG_FILE))
        log.info("run '%s' %s: %s, seed %s", run.cfg.exp_name, "resumed" if run._resume else "started",
                 run._policy_cls.__name__, run.cfg.seed)


def _start(run: Any, ctx: Any, async_mode: bool = False) -> None:
    run._env_stack = run._resources.enter_context(contextlib.ExitStack())  # envs close after the pipeline
    run._resources.enter_context(task.start(async_mode=async_mode, ctx=ctx))


def _node_links(run: Any, node: Node, learner: bool) -> None:
    """A node's log, share, pipeline start and first middleware: the evaluations of evaluator nodes (on the
    owner, listening before node 0 sends its first weights) and the links to the other nodes."""
    run._node = node
    _own_run_dir(run)
    if task.has_role(Role.COLLECTOR):
        run.cfg = collector_share(run.cfg, node.layout.collectors)
    _start(run, OnlineRLContext())
    buffered = "replay_buffer" in run.cfg.policy.other
    on_policy = getattr(run._policy_cls, "learns_on_policy", not buffered)
    if run._owner:
        layout = node.layout  # evaluator nodes: their results are the only ones taken
        run._evaluations = RemoteEvaluations(run.policy, stop_value=run._stop_here,
                                             evaluators=range(layout.learners + layout.collectors, layout.n_nodes))
    run._clock = use_node_links(run.policy, run.run_dir, on_policy=on_policy, buffered=buffered,
                                spaces=env_spaces(run.cfg.env) if learner else None, resume=run._resume,
                                shared_memory=run.cfg.get("transport", "auto") != "nng")
    if run._owner and node.layout.learners == 1:  # a checkpoint of a run from before the ledger has none
        run.save_state("ledger", node.ledger, optional=True)
    if task.has_role(Role.COLLECTOR) and node.layout.server is not None:
        run.policy = _Served(run.policy, RemoteActing(run.policy.collect_mode, node.layout.server, EXCHANGE_TIMEOUT_S))


class _Served:
    """A collector's policy whose ``collect_mode`` acts through the inference server; the rest is the policy's own
    (its replica still takes the learner's versions, which the requests name)."""

    def __init__(self, policy: Any, collect_mode: RemoteActing) -> None:
        self._policy, self.collect_mode = policy, collect_mode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


def _load_dataset(run: Any, cfg: Mapping[str, Any]) -> Any:
    dataset = cfg.get("policy", {}).get("other", {}).get("dataset", {})
    source, root = dataset.get("id"), dataset.get("dir")
    if source is None:
        raise ConfigError("config key 'policy.other.dataset.id' is not set: name the dataset to train on (a "
                          f"Minari dataset id or a file path); build one with: {run._build_dataset}")
    try:
        return load_dataset(source, root=root)
    except FileNotFoundError:
        elsewhere = "" if root is not None else " (one written with --dataset-dir DIR: train with --dataset-dir DIR)"
        raise DatasetMissing(f"dataset '{source}' is not in {dataset_root(root)}{elsewhere}; nothing is downloaded: "
                             f"build it with: {run._build_dataset}") from None
