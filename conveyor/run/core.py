"""The :class:`Run`: what every entry shares around the pipeline function it hands over.

An entry writes its pipeline as ``def pipeline(run: Run) -> None`` (``task.use(..., role=task.role.X)`` for
each middleware) and trains with ``Run(pipeline, main_config, Policy, cfg, **options).train()``. The same
function builds the pipeline in one process, in an async run's collector process (with the collector role
alone) and on every node of a distributed run (the middleware of other roles are dropped); which of these a
run is, :mod:`conveyor.run.modes` decides.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

from easydict import EasyDict

from conveyor.data import DequeBuffer
from conveyor.engine import Role, task
from conveyor.middleware import (EVAL_EVENT, CkptSaver, load_checkpoint, offline_logger, online_logger,
                                 progress_bar, termination_checker)
from conveyor.policy import DataParallelError
from conveyor.run import modes
from conveyor.run.control import GlobalRNG, TrainingInterrupted, log_evaluations, stop_on_signals
from conveyor.run.directory import LATEST, RunDirError, mark_failed
from conveyor.run.nodes import is_offline

__all__ = ["CollectorSide", "EvaluationHook", "Pipeline", "Run"]

log = logging.getLogger("conveyor.run")

EvaluationHook = Callable[[Dict[str, Any]], bool]
"""``hook(result) -> stop``: sees each evaluation's result (an ``EVAL_EVENT``'s) in the process that owns the run;
True ends the run after the iteration, with its final checkpoint (``conveyor tune``'s pruner)."""

Pipeline = Callable[["Run"], None]
"""An entry's pipeline: ``pipeline(run)`` adds its middleware (``task.use(..., role=...)``) and returns nothing."""

_HOW = ("write the pipeline as `def pipeline(run): task.use(...)` and train it with "
        "`Run(pipeline, main_config, Policy, cfg, **options).train()` (docs/quickstart.md)")


class Run:
    """One training run of an entry's ``pipeline``: its run directory, config, policy, envs, saved state and end.

    ``pipeline(run)`` adds the entry's middleware (an async run's collector process calls it again, with the
    collector role alone); ``main_config``, ``policy_cls`` and ``cfg`` (default ``main_config``) give the run's
    config. The other arguments are the entry's options: ``seed``, ``exp_name``, ``resume``, the budgets
    ``max_env_step`` and ``max_train_iter``, ``async_mode``, ``progress`` (the bar), ``ckpt_freq`` (gradient
    steps between ``latest`` checkpoints) and ``ckpt_interval`` (seconds), ``no_stop`` (train past
    ``env.stop_value``: only the budget ends the run), ``evaluation_hook`` (an :data:`EvaluationHook`: called with
    each evaluation's result where the run is owned, one process or node 0; its True ends the run after the
    iteration, with its final checkpoint), and for an offline entry (its config names
    ``policy.other.dataset``) ``build_dataset``, the commands that record its dataset, quoted when it is missing.

    :meth:`train` compiles the config (a new run saves it in ``runs/<exp_name>/``; ``resume=True`` reads it
    back), seeds everything, builds the policy, opens the pipeline (``task.start``) in the run's layout
    (:func:`conveyor.run.modes.open_run`), calls ``pipeline(run)``, adds the run's tail and runs; it closes
    the envs and processes it started. Inside ``pipeline``, ``run.cfg``, ``run.policy``, ``run.env(kind)``,
    ``run.buffer()`` and ``run.dataset`` serve the middleware.
    """

    def __init__(self, pipeline: Pipeline, main_config: Mapping[str, Any], policy_cls: Type[Any],
                 cfg: Optional[Mapping[str, Any]] = None, *, seed: Optional[int] = None, exp_name: Optional[str] = None,
                 max_env_step: Optional[int] = None, max_train_iter: Optional[int] = None, resume: bool = False,
                 async_mode: bool = False, progress: bool = True, ckpt_freq: int = 1000,
                 ckpt_interval: Optional[float] = None, no_stop: bool = False,
                 evaluation_hook: Optional[EvaluationHook] = None, build_dataset: Optional[str] = None) -> None:
        if not callable(pipeline):
            raise TypeError(f"Run({pipeline!r}, ...): the first argument is the entry's pipeline function; {_HOW}")
        self.pipeline, self._main_config, self._policy_cls, self._given = pipeline, main_config, policy_cls, cfg
        self._seed, self._exp_name, self._resume, self._async = seed, exp_name, resume, async_mode
        self._max_env_step, self._max_train_iter, self._progress = max_env_step, max_train_iter, progress
        self._ckpt_freq, self._ckpt_interval, self._no_stop = ckpt_freq, ckpt_interval, no_stop
        self._evaluation_hook = evaluation_hook
        self._build_dataset = build_dataset or "conveyor collect ... --dataset-id <id> (docs/offline.md)"
        self._offline = is_offline(cfg if cfg is not None else main_config)
        self._states: Dict[str, Any] = {}
        self._optional: set = set()  # names in _states that a checkpoint may lack (save_state's optional)
        self._envs: Dict[str, Any] = {}
        self._collector: Any = None  # an async run's ProcessCollector
        self._node: Any = None  # a distributed run's node (conveyor.run.nodes.Node)
        self._owner = True  # writes the run directory, checkpoints and logs
        self._stop_value: Optional[float] = None
        self._stop_here: Optional[float] = None  # rank 0 of several learners: where its evaluations end the run
        self._evaluations: Any = None  # the owner of a distributed run: RemoteEvaluations
        self._clock: Any = None  # a distributed node: its LearnerClock
        self.serving = False
        """Whether this process is a distributed run's inference server, which builds no pipeline of the entry."""
        self._resources = contextlib.ExitStack()
        self._env_stack = contextlib.ExitStack()
        self.cfg: EasyDict = EasyDict()
        self.policy: Any = None
        self.run_dir: Optional[Path] = None
        self.dataset: Any = None
        """An offline entry's dataset (``policy.other.dataset.id``); None for an online entry."""

    def __enter__(self) -> "Run":
        raise TypeError(f"`with Run(main, ...) as run:` is the old form of an entry: {_HOW}")

    def __exit__(self, *exc_info: Any) -> None:
        """Never reached: :meth:`__enter__` refuses the old form."""

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
                self._envs[kind] = self._env_stack.enter_context(modes.env_manager(self, kind))
        return self._envs[kind]

    def buffer(self) -> DequeBuffer:
        """The replay buffer ``policy.other.replay_buffer`` describes, seeded with the run, saved in checkpoints."""
        replay = self.cfg.policy.other.replay_buffer
        buffer = DequeBuffer(replay.size, prioritized=replay.prioritized, alpha=replay.alpha, beta=replay.beta,
                             beta_end=replay.beta_end, beta_anneal_steps=replay.beta_anneal_steps, seed=self.cfg.seed,
                             frame_stack=replay.get("frame_stack", "auto"))
        self.save_state("buffer", buffer)
        if self._node is not None and self._node.ledger is not None and task.has_role(Role.LEARNER):
            self._node.ledger.replay = buffer  # the transition account reports what it holds
        sync = self._node.sync if self._node is not None else None
        return buffer if sync is None else sync.shard(buffer)  # one of data-parallel learners: its shard

    def save_state(self, name: str, obj: Any, optional: bool = False) -> Any:
        """Save ``obj`` (with ``state_dict()`` / ``load_state_dict()``) in the run's checkpoints under ``name``,
        after the policy; returns it. ``optional``: a checkpoint without it (written before it was saved) resumes,
        ``obj`` keeping its fresh state."""
        self._states[name] = obj
        if optional:
            self._optional.add(name)
        return obj

    def collector_side(self) -> "CollectorSide":
        """What an async run's collector process builds its chain with: this run's pipeline, config and policy."""
        return CollectorSide(self.pipeline, self.cfg, self._policy_cls)

    # --- running -----------------------------------------------------------------------------------
    def train(self) -> Any:
        """Open the run in its layout, build ``pipeline(run)``, add the run's tail and run it; returns the final
        context.

        The learner's tail (one process, or node 0): the policy, the saved states and the global generators
        registered, the checkpoint saver (``latest`` every ``ckpt_freq`` gradient steps and ``ckpt_interval``
        seconds, ``final`` at the end), the TensorBoard logger, the budgets and the progress bar; ``resume``
        loads ``latest`` into all of it. SIGINT or SIGTERM finish the iteration, write ``final`` and raise
        :class:`TrainingInterrupted`.
        """
        if self.policy is not None:
            raise RuntimeError("Run.train(): this Run has trained already; make a new Run (resume=True goes on)")
        try:
            with self._resources:
                modes.open_run(self)
                if not self.serving:
                    self.pipeline(self)
                if self._node is not None:
                    return self._run_node()
                self._use_tail()
                with stop_on_signals() as stop:
                    task.run()
                if stop.signum is not None:
                    raise TrainingInterrupted(stop.signum, task.ctx, self.run_dir / "ckpt")
                return task.ctx
        except BaseException as exc:
            if self._owner and self.run_dir is not None:
                mark_failed(self.run_dir, exc)  # before its first checkpoint: the same command starts it over
            raise

    def _run_node(self) -> Any:
        """A distributed node's end of :meth:`train`: node 0 adds the tail; every node runs until the learner ends."""
        node = self._node
        if self._owner:
            task.use(self._evaluations)  # before the saver and the loggers: it sees each result first
            saver = self._use_tail()
            if node.auto_recover and not self._resume:
                saver.save(LATEST)  # a restarted learner always finds a checkpoint to resume
        if task.finish:  # a SIGTERM on its way here (task.ahead_of_run): no iteration, the saver's final checkpoint
            log.info("worker %s: asked to stop before its run started; the run ends as it starts", task.router.node_id)
        task.run()  # SIGTERM from the launcher (Parallel.runner's worker handler) finishes the iteration
        if self._clock is not None:  # the inference server has none
            node.collected, node.first_step_at = self._clock.collected, self._clock.first_step_at
        if task.has_role(Role.LEARNER):
            from conveyor.run.learners import parameters_digest
            node.params_sha256 = parameters_digest(self.policy)
        if node.sync is not None and node.sync.error is not None:
            raise DataParallelError(f"node {task.router.node_id} (learner rank {node.sync.group.rank}): the "
                                    f"learners' group failed, so this learner ended its run"
                                    f"{' and wrote its final checkpoint' if self._owner else ''}: "
                                    f"{node.sync.error}") from node.sync.error
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
            task.use(offline_logger(str(self.run_dir / "tb"), train_show_freq=cfg.policy.learn.log_freq))
            task.use(termination_checker(max_train_iter=budget))
            if self._progress:
                task.use(progress_bar(budget, counter="train_iter"))
        else:
            task.use(online_logger(str(self.run_dir / "tb"), train_show_freq=cfg.policy.learn.log_freq))
            if self._max_env_step is not None or self._max_train_iter is not None:
                task.use(termination_checker(max_env_step=self._max_env_step, max_train_iter=self._max_train_iter))
            if self._progress:
                task.use(progress_bar(self._max_env_step, stop_value=self._stop_value))
        log_evaluations()
        if self._evaluation_hook is not None:
            task.on(EVAL_EVENT, self._evaluated)
        latest = self.run_dir / "ckpt" / LATEST
        if self._resume and latest.is_file():  # without one, prepare() has started the run over
            _resume(latest, meta["policy"], {name: self._states[name] for name in self._optional})
        return saver

    def _evaluated(self, result: Dict[str, Any]) -> None:
        """Hand an evaluation's result to the ``evaluation_hook``; its True ends the run after this iteration."""
        if self._evaluation_hook(result):
            task.finish = True


def _resume(path: Path, policy_name: str, optional: Mapping[str, Any]) -> None:
    state = load_checkpoint(path)
    for name, obj in optional.items():
        if name not in state.get("objects", {}):
            log.warning("%s holds no %r (written before it was saved): it starts afresh", path, name)
            state.setdefault("objects", {})[name] = obj.state_dict()
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


class CollectorSide:
    """``ProcessCollector``'s build hook: in the child, a :class:`~conveyor.run.Run` opened by
    :func:`~conveyor.run.modes.in_collector_process`, ``pipeline(run)`` called on it, and the collector-role
    chain it built."""

    def __init__(self, pipeline: Pipeline, cfg: EasyDict, policy_cls: Type[Any]) -> None:
        self.pipeline, self.cfg, self.policy_cls = pipeline, cfg, policy_cls

    def __call__(self) -> Tuple[List[Any], Any, Callable[[], None]]:
        run = Run(self.pipeline, self.cfg, self.policy_cls)
        with run._resources:
            modes.in_collector_process(run, self.cfg)
            self.pipeline(run)
            return [mw.fn for mw in task.middleware], run.policy, run._resources.pop_all().close
