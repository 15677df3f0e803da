"""What a run controls besides its pipeline: seeding, the global generators as saved state, signals, and the
plain-text log of its run directory."""
from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional

import numpy as np
import torch

from conveyor.engine import FINISH_EVENT, task
from conveyor.middleware import EVAL_EVENT

__all__ = ["GlobalRNG", "TrainingInterrupted", "counters", "final_written", "log_evaluations", "run_log",
           "seed_everything", "stop_on_signals"]

log = logging.getLogger("conveyor.run")

class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on SIGINT or SIGTERM after writing its final checkpoints (``final`` False: the learner
    ended without them, only an earlier ``latest`` may be there)."""

    def __init__(self, signum: int, ctx: Any, ckpt_dir: Path, final: bool = True) -> None:
        self.signum = signum
        self.ctx = ctx
        self.ckpt_dir = ckpt_dir
        self.final = final
        name = signal.Signals(signum).name
        written = "final and latest checkpoints in" if final else "no final checkpoint written in"
        super().__init__(f"stopped by {name} at {counters(ctx)}; {written} {ckpt_dir}")


def final_written(ckpt_dir: Path, since: float) -> bool:
    """Whether ``ckpt_dir`` holds a ``final.pth.tar`` written at or after ``since`` (``time.time()``)."""
    try:
        return (Path(ckpt_dir) / "final.pth.tar").stat().st_mtime >= since
    except OSError:
        return False


def counters(ctx: Any) -> str:
    """``env_step=... train_iter=...`` of a final context (no ``env_step`` for an offline one)."""
    return " ".join(f"{key}={getattr(ctx, key)}" for key in ("env_step", "train_iter") if hasattr(ctx, key))


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


@contextlib.contextmanager
def run_log(path: Path) -> Iterator[None]:
    """While inside, the records of the ``conveyor`` loggers (INFO and up) are appended to ``path`` as plain text.

    A resumed run appends to the same file."""
    conveyor_log = logging.getLogger("conveyor")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # with no handler configured, warnings went to stderr through logging's last resort: keep them going there
    handlers = [handler] + ([logging.lastResort] if logging.lastResort and not conveyor_log.hasHandlers() else [])
    level = conveyor_log.level
    if conveyor_log.getEffectiveLevel() > logging.INFO:
        conveyor_log.setLevel(logging.INFO)
    for each in handlers:
        conveyor_log.addHandler(each)
    try:
        yield
    finally:
        for each in handlers:
            conveyor_log.removeHandler(each)
        conveyor_log.setLevel(level)
        handler.close()


def log_evaluations() -> None:
    """Inside ``task.start``: log each evaluation (the progress lines of the run's log file) and the run's end."""
    def on_eval(result: Dict[str, Any]) -> None:
        env_step = result.get("env_step")  # None offline: no env steps
        log.info("evaluation at train_iter %s%s: mean return %s", result.get("train_iter"),
                 "" if env_step is None else f", env_step {env_step}", result.get("summary", result.get("mean")))

    task.on(EVAL_EVENT, on_eval)
    task.on(FINISH_EVENT, lambda error: log.info("run ended at %s%s", counters(task.ctx), _ended_by(error)))


def _ended_by(error: Optional[BaseException]) -> str:
    """`` by <exception>: <why>`` for a run that raised (nothing for one that ended normally)."""
    if error is None:
        return ""
    text = " ".join(str(error).split())
    if not text and isinstance(error, KeyboardInterrupt):
        text = "a second SIGINT or SIGTERM stopped it at once, without a final checkpoint (latest.pth.tar is kept)"
    return f" by {type(error).__name__}: {text or 'no message'}"
