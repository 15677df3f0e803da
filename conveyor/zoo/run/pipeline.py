"""The :class:`Run`: what every entry's ``main()`` shares around the pipeline it builds.

An entry opens a Run, builds its pipeline inline with ``task.use(..., role=task.role.X)``, and calls
:meth:`Run.train`. The same ``main()`` runs in one process, in async mode (its collector-role middleware then
run in a child process) and as every node of a distributed run (the middleware of other roles are dropped).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

import torch
from easydict import EasyDict

from conveyor.data import DequeBuffer, dataset_root, load_dataset
from conveyor.engine import OfflineRLContext, OnlineRLContext, Role, task
from conveyor.envs import env_spaces, make_env_manager
from conveyor.middleware import (CkptSaver, load_checkpoint, offline_logger, online_logger, progress_bar,
                                 termination_checker)
from conveyor.middleware.collector_process import ProcessCollector
from conveyor.policy import DataParallelError, configured_device
from conveyor.schema import ConfigError
from conveyor.zoo.run.clock import RemoteEvaluations
from conveyor.zoo.run.control import (GlobalRNG, TrainingInterrupted, log_evaluations, run_log, seed_everything,
                                      stop_on_signals)
from conveyor.zoo.run.directory import LATEST, LOG_FILE, RunDirError, experiment_dir, prepare
from conveyor.zoo.run.learners import learner_device
from conveyor.zoo.run.nodes import collector_share, current_node, is_offline, learner_share, use_node_links

__all__ = ["Run", "DatasetMissing"]

log = logging.getLogger("conveyor.run")


class DatasetMissing(FileNotFoundError):
    """An offline entry's dataset is not in the local dataset folder; the message says which commands build it."""


class Run:
    """One training run of an entry: its run directory, config, policy, envs, saved state and end.

    ``main`` is the entry function itself (an async run's collector process runs it again to build its
    collection middleware there); ``main_config``, ``policy_cls`` and ``cfg`` (default ``main_config``) give the
    run's config. The other arguments are the entry's options: ``seed``, ``exp_name``, ``resume``, the budgets
    ``max_env_step`` and ``max_train_iter``, ``async_mode``, ``progress`` (the bar), ``ckpt_freq`` (gradient
    steps between ``latest`` checkpoints) and ``ckpt_interval`` (seconds), ``no_stop`` (train past
    ``env.stop_value``: only the budget ends the run), and for an offline entry (its config names
    ``policy.other.dataset``) ``build_dataset``, the commands that record its dataset, quoted when it is missing.

    Entering it compiles the config (a new run saves it in ``runs/<exp_name>/``; ``resume=True`` reads it
    back), seeds everything, builds the policy and opens the pipeline (``task.start``). Inside, ``run.cfg``,
    ``run.policy``, ``run.env(kind)``, ``run.buffer()`` and ``run.dataset`` serve the middleware;
    :meth:`train` adds the checkpoint saver, logger, budgets and progress bar, resumes, and runs. Leaving it
    closes the envs and processes it started.
    """

    def __init__(self, main: Callable[..., Any], main_config: Mapping[str, Any], policy_cls: Type[Any],
                 cfg: Optional[Mapping[str, Any]] = None, *, seed: Optional[int] = None, exp_name: Optional[str] = None,
                 max_env_step: Optional[int] = None, max_train_iter: Optional[int] = None, resume: bool = False,
                 async_mode: bool = False, progress: bool = True, ckpt_freq: int = 1000,
                 ckpt_interval: Optional[float] = None, no_stop: bool = False,
                 build_dataset: Optional[str] = None) -> None:
        self._main, self._main_config, self._policy_cls, self._given = main, main_config, policy_cls, cfg
        self._seed, self._exp_name, self._resume, self._async = seed, exp_name, resume, async_mode
        self._max_env_step, self._max_train_iter, self._progress = max_env_step, max_train_iter, progress
        self._ckpt_freq, self._ckpt_interval, self._no_stop = ckpt_freq, ckpt_interval, no_stop
        self._build_dataset = build_dataset or "conveyor collect ... --dataset-id <id> (docs/offline.md)"
        self._capture = _capturing
        self._distributed = bool(task.roles) and self._capture is None
        self._offline = is_offline(cfg if cfg is not None else main_config)
        self._states: Dict[str, Any] = {}
        self._envs: Dict[str, Any] = {}
        self._collector: Optional[ProcessCollector] = None
        self._resources = contextlib.ExitStack()
        self.cfg: EasyDict = EasyDict()
        self.policy: Any = None
        self.dataset: Any = None
        """An offline entry's dataset (``policy.other.dataset.id``); None for an online entry."""

    # --- opening -----------------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        try:
            self._open()
        except BaseException:
            self._resources.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._resources.close()

    def _open(self) -> None:
        if self._capture is not None:  # in an async run's collector process: build the collection middleware
            self.cfg = self._capture.cfg
            seed_everything(self.cfg.seed)
            self.policy = self._policy_cls(self.cfg.policy, device="cpu")  # collectors act on CPU; learners may not
            self._env_stack = self._resources.enter_context(contextlib.ExitStack())
            self._resources.enter_context(task.start(ctx=OnlineRLContext()))
            task.add_role(Role.COLLECTOR)
            return
        self._check_options()
        node = current_node() if self._distributed else None
        learner = node is None or task.has_role(Role.LEARNER)
        # with data-parallel learners, rank 0 (node 0) alone owns the run: its directory, checkpoints and logs
        owner = learner and (node is None or node.layout.learners == 1 or task.router.node_id == 0)
        if self._offline and not self._resume:  # found before the run directory is made: a missing one leaves none
            self.dataset = self._load_dataset(self._given if self._given is not None else self._main_config)
        self.cfg = cfg = prepare(self._main_config, self._policy_cls, self._given, seed=self._seed,
                                 exp_name=self._exp_name, resume=self._resume, owner=owner,
                                 distributed=self._distributed)
        if self._offline and self.dataset is None:
            self.dataset = self._load_dataset(cfg)
        self._stop_value = cfg.env.get("stop_value")
        self._stop_here = None  # rank 0 of several learners: the stop value its own evaluations end the run at
        if node is not None and node.layout.learners > 1 and task.has_role(Role.EVALUATOR) and not self._no_stop:
            self._stop_here, cfg.env.stop_value = self._stop_value, None
        if self._no_stop:
            cfg.env.stop_value = None  # the evaluators never end the run; the saved config keeps the value
        seed_everything(cfg.seed)
        several = node is not None and node.layout.learners > 1  # data-parallel learners (learners.py)
        self.policy = self._policy_cls(cfg.policy, device=self._device(learner, several))
        self.run_dir = experiment_dir(cfg)
        self._owner = owner
        if owner:
            self._resources.enter_context(run_log(self.run_dir / LOG_FILE))
            log.info("run '%s' %s: %s, seed %s", cfg.exp_name, "resumed" if self._resume else "started",
                     self._policy_cls.__name__, cfg.seed)
        buffered = "replay_buffer" in cfg.policy.other
        if self._distributed and task.has_role(Role.COLLECTOR):
            self.cfg = collector_share(cfg, current_node().layout.collectors)
        elif learner and several and not buffered:  # a replay shard samples its part itself (ShardBuffer)
            self.cfg = learner_share(cfg, node.layout.learners)
        self._env_stack = self._resources.enter_context(contextlib.ExitStack())  # envs close after the pipeline
        if self._async and not self._offline and cfg.env.async_collector != "thread":
            self.env("evaluator")  # first: a ProcessCollector may pin this thread, which later processes inherit
            self._collector = self._resources.enter_context(
                ProcessCollector(_CollectionBuilder(self._main, cfg), self.policy))
        ctx = OfflineRLContext() if self._offline else OnlineRLContext()
        self._resources.enter_context(task.start(async_mode=self._async, ctx=ctx))
        if self._collector is not None:  # the collector-role middleware run in the collector process
            task.add_role(Role.LEARNER).add_role(Role.EVALUATOR)
        if self._distributed:
            on_policy = getattr(self._policy_cls, "learns_on_policy", not buffered)
            if owner:  # listening before node 0 sends its first weights: an evaluator node's first result is kept
                layout = current_node().layout
                self._evaluations = RemoteEvaluations(self.policy, stop_value=self._stop_here, evaluators=range(
                    layout.learners + layout.collectors, layout.n_nodes))
            self._clock = use_node_links(self.policy, self.run_dir, on_policy=on_policy, buffered=buffered,
                                         spaces=env_spaces(cfg.env) if learner else None)

    def _device(self, learner: bool, several: bool) -> Optional[str]:
        """Where this process's policy runs: collector and evaluator nodes act on CPU; a learner takes
        ``policy.device`` (None: the policy reads it), and one of several learners on a host its own GPU for a
        plain ``'cuda'`` (:func:`~conveyor.zoo.run.learners.learner_device`)."""
        if not learner:
            return "cpu"
        if not several:
            return None
        return learner_device(str(configured_device(self.cfg.policy)), current_node().local_rank,
                              torch.cuda.device_count)

    def _check_options(self) -> None:
        if self._distributed and self._async:
            raise ConfigError("async_mode: in a distributed run collection already overlaps training (collectors are "
                              "their own processes); leave --async out")
        if self._distributed and self._offline:
            raise ConfigError("an offline entry trains from a dataset, with no collectors or evaluators to spread over "
                              "processes: run it in one process (no roles, no --collectors)")
        if self._offline and self._max_env_step is not None:
            raise ConfigError(f"max_env_step={self._max_env_step}: an offline entry takes no env steps; bound it with "
                              f"max_train_iter (--max-train-iter) or policy.learn.max_train_iter")
        if self._max_train_iter is not None and (not isinstance(self._max_train_iter, int)
                                                 or self._max_train_iter <= 0):
            raise ConfigError(f"max_train_iter={self._max_train_iter!r}: must be an int > 0")

    def _load_dataset(self, cfg: Mapping[str, Any]) -> Any:
        source = cfg.get("policy", {}).get("other", {}).get("dataset", {}).get("id")
        if source is None:
            raise ConfigError("config key 'policy.other.dataset.id' is not set: name the dataset to train on (a "
                              f"Minari dataset id or a file path); build one with: {self._build_dataset}")
        try:
            return load_dataset(source)
        except FileNotFoundError:
            raise DatasetMissing(f"dataset '{source}' is not in {dataset_root()} (nothing is downloaded); build it "
                                 f"with: {self._build_dataset}") from None

    # --- what the middleware use -------------------------------------------------------------------
    def env(self, kind: str) -> Any:
        """The env manager of ``kind`` ('collector' or 'evaluator'), started on first use and closed with the run.

        Where this process lacks the role (a distributed node of another role), a stand-in that only knows its
        ``env_num``: the middleware built on it are dropped by ``task.use(..., role=...)``. In async mode with a
        collector process (``env.async_collector``), asking for the collector env puts that process's
        ``ProcessCollector`` into the pipeline at this point: the collector-role middleware run inside it.
        """
        if kind not in ("collector", "evaluator"):
            raise ValueError(f"run.env({kind!r}): kind must be 'collector' or 'evaluator'")
        if kind not in self._envs:
            if kind == "collector" and self._collector is not None:
                task.use(self._collector)
                self._envs[kind] = _Absent(kind, self.cfg.env.collector_env_num)
            elif not task.has_role(Role(kind)):
                self._envs[kind] = _Absent(kind, self.cfg.env[f"{kind}_env_num"])
            else:
                self._envs[kind] = self._env_stack.enter_context(make_env_manager(self.cfg.env, kind,
                                                                                  seed=self.cfg.seed))
        return self._envs[kind]

    def buffer(self) -> DequeBuffer:
        """The replay buffer ``policy.other.replay_buffer`` describes, seeded with the run, saved in checkpoints."""
        replay = self.cfg.policy.other.replay_buffer
        buffer = DequeBuffer(replay.size, prioritized=replay.prioritized, alpha=replay.alpha, beta=replay.beta,
                             beta_end=replay.beta_end, beta_anneal_steps=replay.beta_anneal_steps, seed=self.cfg.seed,
                             frame_stack=replay.get("frame_stack", "auto"))
        self.save_state("buffer", buffer)
        sync = current_node().sync if self._distributed else None
        return buffer if sync is None else sync.shard(buffer)  # one of data-parallel learners: its shard

    def save_state(self, name: str, obj: Any) -> Any:
        """Save ``obj`` (with ``state_dict()`` / ``load_state_dict()``) in the run's checkpoints under ``name``,
        after the policy; returns it."""
        self._states[name] = obj
        return obj

    # --- running -----------------------------------------------------------------------------------
    def train(self) -> Any:
        """Add the run's tail to the pipeline and run it; returns the final context.

        The learner's tail (one process, or node 0): the policy, the saved states and the global generators
        registered, the checkpoint saver (``latest`` every ``ckpt_freq`` gradient steps and ``ckpt_interval``
        seconds, ``final`` at the end), the TensorBoard logger, the budgets and the progress bar; ``resume``
        loads ``latest`` into all of it. SIGINT or SIGTERM finish the iteration, write ``final`` and raise
        :class:`TrainingInterrupted`.
        """
        if self._capture is not None:
            self._capture.took(self.policy, [mw.fn for mw in task.middleware], self._resources.pop_all().close)
            raise _Captured
        node = current_node() if self._distributed else None
        if self._owner:
            if self._distributed:  # before the saver and the loggers: it sees each result first
                task.use(self._evaluations)
            saver = self._use_tail()
            if node is not None and node.auto_recover and not self._resume:
                saver.save(LATEST)  # a restarted learner always finds a checkpoint to resume
        if node is not None:
            task.run()  # SIGTERM from the launcher (Parallel.runner's worker handler) finishes the iteration
            node.collected, node.first_step_at = self._clock.collected, self._clock.first_step_at
            if task.has_role(Role.LEARNER):
                from conveyor.zoo.run.learners import parameters_digest
                node.params_sha256 = parameters_digest(self.policy)
            if node.sync is not None and node.sync.error is not None:
                raise DataParallelError(f"node {task.router.node_id} (learner rank {node.sync.group.rank}): the "
                                        f"learners' group failed, so this learner ended its run"
                                        f"{' and wrote its final checkpoint' if self._owner else ''}: "
                                        f"{node.sync.error}") from node.sync.error
            return task.ctx
        with stop_on_signals() as stop:
            task.run()
        if stop.signum is not None:
            raise TrainingInterrupted(stop.signum, task.ctx, self.run_dir / "ckpt")
        return task.ctx

    def _use_tail(self) -> CkptSaver:
        cfg, policy = self.cfg, self.policy
        task.register_state("policy", policy)
        for name, obj in self._states.items():
            task.register_state(name, obj)
        task.register_state("rng", GlobalRNG())
        meta = {"policy": type(policy).__name__, "exp_name": cfg.exp_name}
        saver = CkptSaver(policy, self.run_dir, train_freq=self._ckpt_freq, interval_s=self._ckpt_interval, meta=meta)
        task.use(saver)
        if self._offline:
            budget = self._max_train_iter if self._max_train_iter is not None else cfg.policy.learn.max_train_iter
            task.use(offline_logger(str(self.run_dir / "tb")))
            task.use(termination_checker(max_train_iter=budget))
            if self._progress:
                task.use(progress_bar(budget, counter="train_iter"))
        else:
            task.use(online_logger(str(self.run_dir / "tb")))
            if self._max_env_step is not None or self._max_train_iter is not None:
                task.use(termination_checker(max_env_step=self._max_env_step, max_train_iter=self._max_train_iter))
            if self._progress:
                task.use(progress_bar(self._max_env_step, stop_value=self._stop_value))
        log_evaluations()
        latest = self.run_dir / "ckpt" / LATEST
        if self._resume and latest.is_file():  # without one, prepare() has started the run over
            _resume(latest, meta["policy"])
        return saver


def _resume(path: Path, policy_name: str) -> None:
    state = load_checkpoint(path)
    saved_by = state.get("meta", {}).get("policy")
    if saved_by != policy_name or "middleware" not in state:
        raise RunDirError(f"cannot resume from {path} with {policy_name}: it was written by "
                          f"{saved_by or 'an older version'}; resume it with its own entry, or start a new run")
    state.pop("meta")
    task.load_state_dict(state)


class _Absent:
    """Stands in for an env manager this process does not run: only its ``env_num`` is known."""

    def __init__(self, kind: str, env_num: int) -> None:
        self.kind, self.env_num = kind, env_num

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the {self.kind} envs do not run in this process (it lacks the {self.kind} role): give "
                           f"the middleware that uses them role=task.role.{self.kind.upper()}")

    def __repr__(self) -> str:
        return f"<{self.kind} envs of another process ({self.env_num})>"


# --- an async run's collector process -------------------------------------------------------------------
class _Captured(BaseException):
    """Raised by :meth:`Run.train` in a collector process once the collection middleware are built."""


class _Capture:
    """What the collector process's ``main()`` built: the policy replica, the chain, and what closes its envs."""

    def __init__(self, cfg: EasyDict) -> None:
        self.cfg = cfg
        self.built: Optional[Tuple[List[Any], Any, Callable[[], None]]] = None

    def took(self, policy: Any, chain: List[Any], close: Callable[[], None]) -> None:
        self.built = (chain, policy, close)


_capturing: Optional[_Capture] = None


class _CollectionBuilder:
    """``ProcessCollector``'s build hook: in the child, run the entry's ``main()`` with only the collector role;
    its Run hands over the collection middleware it built instead of training."""

    def __init__(self, main: Callable[..., Any], cfg: EasyDict) -> None:
        self.main, self.cfg = main, cfg

    def __call__(self) -> Tuple[List[Any], Any, Callable[[], None]]:
        global _capturing
        _capturing = capture = _Capture(self.cfg)
        try:
            self.main()
        except _Captured:
            pass
        finally:
            _capturing = None
        if capture.built is None:
            raise RuntimeError(f"{getattr(self.main, '__qualname__', self.main)}() returned without calling "
                               f"run.train() in a conveyor.zoo.run.Run: no collection middleware to run")
        return capture.built
