"""What every online zoo entry does around its pipeline: the run directory, the config, envs, the saved
state, resume, signals.

Rules (docs/checkpoints.md): a run lives in ``runs/<exp_name>/`` (``config.json``, ``ckpt/``, ``tb/``, and
``nodes.json`` for a distributed run); a new run refuses a name that already holds a run (continue it with
``resume=True``, or pick another name); ``resume=True`` reads the saved config and ``ckpt/latest.pth.tar``
and goes on exactly where that checkpoint was, in the layout it was trained in (one process, or
distributed), or starts the run over from its saved config when it stopped before its first checkpoint
(a failed or killed start); SIGINT or SIGTERM finish the current iteration, write ``final`` and
``latest`` and raise :class:`TrainingInterrupted` (a second signal stops at once).
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import random
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Type

import numpy as np
import torch
from easydict import EasyDict

from conveyor.config import TOP_SCHEMA, compile_config
from conveyor.engine import OnlineRLContext, task
from conveyor.envs import make_env_manager
from conveyor.middleware import (CheckpointError, CkptSaver, load_checkpoint, online_logger, progress_bar,
                                 termination_checker)
from conveyor.middleware.collector_process import ProcessCollector, collection_builder
from conveyor.schema import ConfigError

__all__ = ["prepare", "experiment_dir", "read_run_config", "seed_everything", "collection_and_evaluator_env",
           "use_reporting", "use_saving", "train_online", "run_pipeline", "counters", "GlobalRNG", "RunDirError",
           "TrainingInterrupted", "check_exp_name", "stop_on_signals", "run_directory", "check_layout", "NODES_FILE"]

log = logging.getLogger(__name__)

RUNS = Path("runs")
CONFIG_FILE = "config.json"
LATEST = "latest.pth.tar"
NODES_FILE = "nodes.json"
"""In the run directory of a distributed run: every node's id, roles, pid, host and address (the learner writes it)."""


class RunDirError(ValueError):
    """A run directory cannot be used as asked: it already holds a run, or holds another algorithm's run."""


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on SIGINT or SIGTERM after writing its final checkpoints."""

    def __init__(self, signum: int, ctx: Any, ckpt_dir: Path) -> None:
        self.signum = signum
        self.ctx = ctx
        self.ckpt_dir = ckpt_dir
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at {counters(ctx)}; final and latest checkpoints in {ckpt_dir}")


def counters(ctx: Any) -> str:
    """``env_step=... train_iter=...`` of a final context (no ``env_step`` for an offline one)."""
    return " ".join(f"{key}={getattr(ctx, key)}" for key in ("env_step", "train_iter") if hasattr(ctx, key))


def check_exp_name(name: Any) -> str:
    """``name`` if it is a usable run name: one non-empty path component, not ``.`` or ``..``."""
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name:
        raise ConfigError(f"exp_name {name!r} is not a run name: use one folder name such as 'cartpole_dqn_2' "
                          f"(no '/', not empty, not '.' or '..'); runs go under {RUNS}/")
    return name


def experiment_dir(cfg: Mapping[str, Any]) -> Path:
    """``runs/<exp_name>``: where an entry's config, logs and checkpoints go."""
    return RUNS / check_exp_name(cfg["exp_name"])


def run_directory(cfg: Mapping[str, Any], exp_name: Optional[str] = None) -> Path:
    """The run directory of an entry run with config ``cfg`` (raw: its ``exp_name`` may be left to the default)
    and the ``exp_name`` argument, which wins."""
    return experiment_dir({"exp_name": exp_name if exp_name is not None else
                           cfg.get("exp_name", TOP_SCHEMA["exp_name"].default)})


def prepare(main_config: Mapping[str, Any], policy: Type[Any], cfg: Optional[Mapping[str, Any]] = None, *,
            seed: Optional[int] = None, exp_name: Optional[str] = None, resume: bool = False) -> EasyDict:
    """The compiled config of a run, with its run directory ready.

    A new run: ``cfg`` (default ``main_config``) with the overrides; its name must not hold a run yet;
    the directory is created and the resolved config saved in it. ``resume=True``: the config saved by
    the run (``cfg`` and ``seed``, if given, must agree with it).
    """
    raw = EasyDict(copy.deepcopy(dict(cfg if cfg is not None else main_config)))
    if exp_name is not None:
        raw.exp_name = exp_name
    if not task.has_role(task.role.LEARNER):  # a node of a distributed run: the run directory is the learner's
        return compile_config(raw if seed is None else EasyDict(raw, seed=seed), policy=policy)
    run_dir = experiment_dir(raw)
    if resume:
        return _saved_config(run_dir, policy, None if cfg is None else raw, seed)
    if seed is not None:
        raw.seed = seed
    compiled = compile_config(raw, policy=policy)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunDirError(f"{run_dir} already holds a run: continue it with --resume, or choose another --exp-name")
    _write_config(run_dir, policy, compiled)
    return compiled


def _write_config(run_dir: Path, policy: Type[Any], cfg: EasyDict) -> None:
    path = run_dir / CONFIG_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"policy": policy.__name__, "config": cfg}, indent=2) + "\n")
    except OSError as exc:
        raise CheckpointError("write", path, exc, what="run config") from exc


def read_run_config(run_dir: Path) -> Dict[str, Any]:
    """What a run saved in its ``config.json``: ``{"policy": <policy class name>, "config": <compiled config>}``.

    A missing file is a ``FileNotFoundError``, an unreadable one a :class:`RunDirError`, each naming the path.
    """
    path = Path(run_dir) / CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a run directory (runs/<exp-name>)?") from None
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path} is unreadable ({' '.join(str(exc).split())})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise RunDirError(f"{path} is not a run's config: it has no 'config' section")
    return saved


def check_layout(run_dir: Path, distributed: bool) -> None:
    """Refuse to resume the run in ``run_dir`` in another layout than the one its checkpoint was trained in:
    in one process, or distributed (then the run has a ``nodes.json``). A run with no checkpoint fits any."""
    nodes = run_dir / NODES_FILE
    if not (run_dir / "ckpt" / LATEST).is_file() or nodes.is_file() == distributed:
        return
    if distributed:
        raise RunDirError(f"cannot resume '{run_dir.name}' as a distributed run: it was trained in one process "
                          f"({run_dir} has no {NODES_FILE}); resume it without --collectors and --evaluators")
    try:
        roles = [role for row in json.loads(nodes.read_text()) for role in row["roles"]]
        collectors, evaluators = roles.count("collector"), roles.count("evaluator")
        flags = f"--collectors {collectors}" + (f" --evaluators {evaluators}" if evaluators else "")
        layout = f"1 learner and {collectors} collector{'s' * (collectors != 1)}" + \
            (f" and {evaluators} evaluator{'s' * (evaluators != 1)}" if evaluators else "")
    except (OSError, ValueError, TypeError, KeyError):
        flags, layout = "--collectors N as it was started", "a distributed run"
    raise RunDirError(f"cannot resume '{run_dir.name}' in one process: it was trained as {layout} ({nodes}); "
                      f"resume it with {flags}")


def _saved_config(run_dir: Path, policy: Type[Any], given: Optional[EasyDict], seed: Optional[int]) -> EasyDict:
    latest = run_dir / "ckpt" / LATEST
    path = run_dir / CONFIG_FILE
    if not latest.is_file() and not path.is_file():
        raise FileNotFoundError(f"cannot resume '{run_dir.name}': no checkpoint at {latest}; start without "
                                f"--resume, or pass the --exp-name of an earlier run")
    try:
        saved = read_run_config(run_dir)
    except FileNotFoundError:
        raise FileNotFoundError(f"cannot resume '{run_dir.name}': {path} is missing (a run from an older "
                                f"version?); start a new run") from None
    except RunDirError as exc:
        raise RunDirError(f"cannot resume '{run_dir.name}': {exc}") from None
    if saved.get("policy") != policy.__name__:
        raise RunDirError(f"cannot resume '{run_dir.name}' with {policy.__name__}: it is a {saved.get('policy')} "
                          f"run; resume it with its own entry, or choose another --exp-name")
    check_layout(run_dir, distributed=bool(task.roles))
    cfg = compile_config(EasyDict(saved["config"]), policy=policy)
    if seed is not None and seed != cfg.seed:
        raise RunDirError(f"--seed {seed} differs from the seed {cfg.seed} of run '{run_dir.name}': leave --seed "
                          f"out to resume it")
    if given is not None:
        mine = json.loads(json.dumps(compile_config(given, policy=policy)))
        if mine != json.loads(json.dumps(cfg)):
            raise RunDirError(f"the config given differs from the one run '{run_dir.name}' saved in {path}: resume "
                              f"without a config, or start a new run")
    if not latest.is_file():
        log.warning("run '%s' stopped before its first checkpoint (a failed or killed start): it starts over from "
                    "its saved config", run_dir.name)
        (run_dir / NODES_FILE).unlink(missing_ok=True)  # the nodes of that start; this one writes its own
    return cfg


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch, and use one intra-op thread: on these small networks a second
    thread costs 2-3x the CPU for no wall-clock gain."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)


class GlobalRNG:
    """The global generators (``random``, ``numpy.random``, torch's CPU generator) as one saveable state."""

    def state_dict(self) -> Dict[str, Any]:
        """The three generators' states."""
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the three generators back where :meth:`state_dict` found them."""
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])


Collection = Callable[[Any, Any, Any], List[Any]]
"""``collection(cfg, policy, collector_env)``: an entry's collection middleware, a collector first."""


@contextlib.contextmanager
def collection_and_evaluator_env(cfg: Mapping[str, Any], policy: Any, collection: Collection, *,
                                 async_mode: bool) -> Iterator[tuple]:
    """The entry's collection middleware and the evaluator's env manager, closed on the way out.

    The middleware of ``collection`` run here, over the collector env manager; in async mode with
    ``env.async_collector`` 'process' or 'auto' one ProcessCollector runs them in a child process instead:
    two threads of one process hand their GIL to each other around every torch operator, which costs the
    learner more than the overlap saves, so only collection in its own process overlaps it (docs/engine.md).
    """
    with contextlib.ExitStack() as resources:
        # first: a ProcessCollector may pin this thread to one CPU (split_cpus), which processes started later inherit
        evaluator_env = resources.enter_context(make_env_manager(cfg["env"], "evaluator", seed=cfg["seed"]))
        if async_mode and _collect_in_process(cfg):
            build = collection_builder(cfg, type(policy), collection)
            stage = [resources.enter_context(ProcessCollector(build, policy))]
        else:
            collector_env = resources.enter_context(make_env_manager(cfg["env"], "collector", seed=cfg["seed"]))
            stage = collection(cfg, policy, collector_env)
        yield stage, evaluator_env


def _collect_in_process(cfg: Mapping[str, Any]) -> bool:
    """Whether async mode collects in a child process: 'process' and 'auto' do, from one lock-step per call
    (pendulum/sac's 2 gain 1.07x, where collection in a thread costs 0.8x; docs/engine.md)."""
    return cfg["env"]["async_collector"] != "thread"


def use_reporting(cfg: Mapping[str, Any], max_env_step: Optional[int], progress: bool, *,
                  max_train_iter: Optional[int] = None) -> None:
    """The tail of every zoo pipeline: TensorBoard logger, the env-step and train-iteration budgets if any, the
    progress bar (its total the env-step budget, its eval return shown against ``env.stop_value``)."""
    task.use(online_logger(str(experiment_dir(cfg) / "tb")))
    if max_env_step is not None or max_train_iter is not None:
        task.use(termination_checker(max_env_step=max_env_step, max_train_iter=max_train_iter))
    if progress:
        task.use(progress_bar(max_env_step, stop_value=cfg["env"].get("stop_value")))


class _Stop:
    signum: Optional[int] = None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[_Stop]:
    """While inside, SIGINT and SIGTERM set ``task.finish`` (the iteration in progress completes, the run ends
    normally and the checkpoint saver writes ``final``); a second signal raises ``KeyboardInterrupt`` at once.
    Only in the main thread (elsewhere signals cannot be caught); handlers are restored on the way out."""
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.signum is not None:
            raise KeyboardInterrupt
        stop.signum = signum
        task.finish = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def train_online(cfg: EasyDict, policy: Any, collection: Collection, build: Callable[[List[Any], Any], None], *,
                 resume: bool, async_mode: bool, max_env_step: Optional[int], progress: bool, ckpt_freq: int,
                 ckpt_interval: Optional[float], buffer: Any = None,
                 max_train_iter: Optional[int] = None) -> OnlineRLContext:
    """Run an entry's pipeline: ``build(stage, evaluator_env)`` adds its middleware, with ``stage`` the
    collection middleware of :func:`collection_and_evaluator_env` in its place, then come the
    checkpoint saver, the logger, the budgets (``max_env_step``, ``max_train_iter``) and the progress bar (see
    :func:`run_pipeline`). In a process with roles (one node of a distributed run) :func:`train_node` builds
    this node's part instead.
    """
    def report() -> None:
        use_reporting(cfg, max_env_step, progress, max_train_iter=max_train_iter)

    if task.roles:  # one node of a distributed run (conveyor/zoo/_distributed.py)
        from conveyor.zoo._distributed import train_node
        return train_node(cfg, policy, collection, build, report, buffer=buffer, resume=resume, async_mode=async_mode,
                          ckpt_freq=ckpt_freq, ckpt_interval=ckpt_interval)
    with collection_and_evaluator_env(cfg, policy, collection, async_mode=async_mode) as (stage, evaluator_env):
        return run_pipeline(cfg, policy, OnlineRLContext(), lambda: build(stage, evaluator_env), report,
                            resume=resume, async_mode=async_mode, ckpt_freq=ckpt_freq, ckpt_interval=ckpt_interval,
                            buffer=buffer)


def run_pipeline(cfg: EasyDict, policy: Any, ctx: Any, build: Callable[[], None], report: Callable[[], None], *,
                 resume: bool, async_mode: bool, ckpt_freq: int, ckpt_interval: Optional[float],
                 buffer: Any = None) -> Any:
    """Run a pipeline in ``ctx`` (an online or offline context): ``build()`` adds its middleware, then
    :func:`use_saving` the checkpoint saver and ``report()``'s (logger, budget, progress bar).
    Returns the final context; a signal raises :class:`TrainingInterrupted` once the final checkpoints are written.
    """
    with task.start(async_mode=async_mode, ctx=ctx):
        build()
        use_saving(cfg, policy, report, buffer=buffer, resume=resume, ckpt_freq=ckpt_freq, ckpt_interval=ckpt_interval)
        with stop_on_signals() as stop:
            task.run()
        ctx = task.ctx
    if stop.signum is not None:
        raise TrainingInterrupted(stop.signum, ctx, experiment_dir(cfg) / "ckpt")
    return ctx


def use_saving(cfg: EasyDict, policy: Any, report: Callable[[], None], *, buffer: Any, resume: bool, ckpt_freq: int,
               ckpt_interval: Optional[float]) -> CkptSaver:
    """The learner's end of a pipeline, after its other middleware: the policy, the buffer and the global RNGs
    registered as saved state, the checkpoint saver (returned), then ``report()``'s middleware (logger,
    budgets, progress bar); ``resume`` loads ``latest`` into all of it."""
    exp_dir = experiment_dir(cfg)
    meta = {"policy": type(policy).__name__, "exp_name": cfg.exp_name}
    task.register_state("policy", policy)
    if buffer is not None:
        task.register_state("buffer", buffer)
    task.register_state("rng", GlobalRNG())
    saver = CkptSaver(policy, exp_dir, train_freq=ckpt_freq, interval_s=ckpt_interval, meta=meta)
    task.use(saver)
    report()
    latest = exp_dir / "ckpt" / LATEST
    if resume and latest.is_file():  # without one, prepare() has started the run over
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
