"""Loggers: TensorBoard (tensorboardX) or Weights & Biases scalars, and progress: a bar on a terminal, a line
every few seconds in a log file (CI, Slurm).

Their files and bars live as long as the pipeline: they flush when a run ends (``FINISH_EVENT``) and
close when the ``with task.start():`` block exits (``CLOSE_EVENT``), so a second ``run()`` in the same
block goes on writing to them. Evaluations reach them through ``EVAL_EVENT`` as they happen, at the env
step they were taken at: also the one that reached the stop value and ended its iteration before the
logger's turn.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, TextIO

import numpy as np

from conveyor.engine import CLOSE_EVENT, FINISH_EVENT, OfflineRLContext, OnlineRLContext, declares, task
from conveyor.middleware.collector import EPISODE_EVENT
from conveyor.middleware.evaluator import EVAL_EVENT, EVAL_PROGRESS_EVENT

__all__ = ["online_logger", "offline_logger", "wandb_online_logger", "progress_bar", "ProgressLines", "progress_display"]


MAX_AGENTS_LOGGED = 1024
"""At most this many agents' returns are logged (the scalars of a result from another node are bounded)."""


def agent_scalars(prefix: str, returns: Any) -> Dict[str, float]:
    """``{prefix}/<i>`` for agent ``i``'s return in ``returns`` (a list over agents); nothing unless it is a list of
    at most :data:`MAX_AGENTS_LOGGED` finite numbers (an evaluation may come from another node)."""
    if not isinstance(returns, (list, tuple)) or len(returns) > MAX_AGENTS_LOGGED or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and np.isfinite(r) for r in returns):
        return {}
    return {f"{prefix}/{i}": float(r) for i, r in enumerate(returns)}


def eval_scalars(result: Dict[str, Any]) -> Dict[str, float]:
    """The scalars of one evaluation (an ``EVAL_EVENT`` result): mean and std of the return (a team's: summed over
    agents), the env crashes and episodes dropped for them, and for a team each agent's mean return
    (``eval/agent_return/<i>``)."""
    return {"eval/return": float(result["mean"]), "eval/return_std": float(result["std"]),
            "eval/crashes": float(result.get("crashes", 0)), "eval/dropped": float(result.get("dropped", 0)),
            **agent_scalars("eval/agent_return", result.get("agent_mean"))}


class _Scalars:
    """Turns what an iteration left in the context into scalars: mean losses, throughput (of the context's
    ``counter``: env steps online, train iterations offline), training episode returns and per-middleware
    time from ``task.stats()``."""

    def __init__(self, train_show_freq: int, counter: str = "env_step") -> None:
        if not isinstance(train_show_freq, int) or train_show_freq <= 0:
            raise ValueError(f"train_show_freq must be an int > 0, got {train_show_freq!r}")
        self._freq = train_show_freq
        self._outputs: List[Dict[str, Any]] = []
        self._returns: List[float] = []
        self._agent_returns: List[List[float]] = []  # a team's training episodes: each agent's return
        self._last_shown: Optional[int] = None
        self._clock = (time.perf_counter(), 0)
        self._counter = counter
        task.on(EPISODE_EVENT, self._on_episode)

    def _on_episode(self, env_index: int, ret: float, length: int, agent_returns: Optional[List[float]] = None) -> None:
        self._returns.append(ret)
        if agent_returns is not None:
            self._agent_returns.append(agent_returns)

    def __call__(self, ctx: OnlineRLContext) -> Dict[str, float]:
        scalars: Dict[str, float] = {}
        output = ctx.train_output
        if isinstance(output, dict):
            output = [output]
        if output:
            self._outputs.extend(output)
        if self._last_shown is None or ctx.train_iter - self._last_shown >= self._freq:
            self._last_shown = ctx.train_iter
            scalars.update(self._train_scalars(ctx))
        return scalars

    def _train_scalars(self, ctx: OnlineRLContext) -> Dict[str, float]:
        scalars: Dict[str, float] = {}
        merged: Dict[str, List[float]] = defaultdict(list)
        for out in self._outputs:
            for key, value in out.items():
                if isinstance(value, (int, float, np.floating, np.integer)):
                    merged[key].append(float(value))
        scalars.update({key: float(np.mean(values)) for key, values in merged.items()})
        self._outputs = []
        if self._returns:
            scalars["charts/episode_return"] = float(np.mean(self._returns))
            self._returns = []
        if self._agent_returns:
            scalars.update(agent_scalars("charts/agent_episode_return", np.mean(self._agent_returns, axis=0).tolist()))
            self._agent_returns = []
        now, count = time.perf_counter(), getattr(ctx, self._counter)
        then, then_count = self._clock
        if now > then and count > then_count:
            scalars[f"charts/{self._counter}s_per_s"] = (count - then_count) / (now - then)
        self._clock = (now, count)
        for name, stat in task.stats().items():
            scalars[f"time/{name}_ms"] = stat["mean_s"] * 1000
        return scalars


@declares(backward_reads=("train_output", "env_step", "train_iter"), optional=("train_output",), factory=True)
def online_logger(logdir: str, train_show_freq: int = 100, record_train_iter: bool = False):
    """Writes scalars to TensorBoard under ``logdir`` (tensorboardX), indexed by env step
    (and also by train iteration with ``record_train_iter``).

    Logged: after each evaluation (``EVAL_EVENT``), at the env step it was taken at, ``eval/return``,
    ``eval/return_std``, ``eval/crashes`` and ``eval/dropped`` (and a team's ``eval/agent_return/<i>``); every
    ``train_show_freq`` train iterations the mean of the policy's metrics (``losses/...``, ``charts/...``),
    ``charts/episode_return`` of training episodes (the team's return, and ``charts/agent_episode_return/<i>``
    for a team), ``charts/env_steps_per_s`` and ``time/<middleware>_ms`` from ``task.stats()``.

    Reads ctx: ``train_output``, ``env_step``, ``train_iter``.
    """
    write = _tensorboard(logdir, record_train_iter)
    scalars_of = _Scalars(train_show_freq)
    task.on(EVAL_EVENT, lambda result: write(eval_scalars(result), result["env_step"], result["train_iter"]))

    def _log(ctx: OnlineRLContext):
        yield
        write(scalars_of(ctx), ctx.env_step, ctx.train_iter)

    return _log


@declares(backward_reads=("train_output", "train_iter", "train_epoch"), optional=("train_output",), factory=True)
def offline_logger(logdir: str, train_show_freq: int = 100):
    """Writes scalars of an offline pipeline (``OfflineRLContext``) to TensorBoard under ``logdir``, indexed by
    train iteration; the writer lives as :func:`online_logger`'s does.

    Logged: after each evaluation the ``eval/...`` scalars of :func:`online_logger`; every ``train_show_freq``
    train iterations the mean of the policy's metrics (``losses/...``, ``charts/...``), ``charts/train_epoch``,
    ``charts/train_iters_per_s`` and ``time/<middleware>_ms``.

    Reads ctx: ``train_output``, ``train_iter``, ``train_epoch``.
    """
    write = _tensorboard(logdir)
    scalars_of = _Scalars(train_show_freq, counter="train_iter")
    task.on(EVAL_EVENT, lambda result: write(eval_scalars(result), result["train_iter"], result["train_iter"]))

    def _log(ctx: OfflineRLContext):
        yield
        scalars = scalars_of(ctx)
        if scalars:
            scalars["charts/train_epoch"] = float(ctx.train_epoch)
        write(scalars, ctx.train_iter, ctx.train_iter)

    return _log


def _tensorboard(logdir: str, record_train_iter: bool = False) -> Callable[[Dict[str, float], int, int], None]:
    """``write(scalars, step, train_iter)`` to a tensorboardX writer under ``logdir`` (also by train iteration,
    as ``<key>_iter``, with ``record_train_iter``); flushed when a run ends, closed with the task."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(logdir)
    task.on(FINISH_EVENT, lambda error: writer.flush())
    task.once(CLOSE_EVENT, writer.close)

    def write(scalars: Dict[str, float], step: int, train_iter: int) -> None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
            if record_train_iter:
                writer.add_scalar(f"{key}_iter", value, train_iter)
        if scalars:
            writer.flush()

    return write


@declares(backward_reads=("train_output", "env_step", "train_iter"), optional=("train_output",), factory=True)
def wandb_online_logger(project: str, config: Optional[Dict[str, Any]] = None, train_show_freq: int = 100,
                        **init_kwargs: Any):
    """Like :func:`online_logger`, to Weights & Biases (``pip install wandb``); metrics are stepped by env step.

    Reads ctx: ``train_output``, ``env_step``, ``train_iter``.
    """
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("wandb_online_logger needs the wandb package: pip install wandb") from exc

    run = wandb.init(project=project, config=config, **init_kwargs)
    scalars_of = _Scalars(train_show_freq)
    task.on(EVAL_EVENT, lambda result: run.log({**eval_scalars(result), "train_iter": result["train_iter"]},
                                               step=result["env_step"]))
    task.once(CLOSE_EVENT, run.finish)

    def _log(ctx: OnlineRLContext):
        yield
        scalars = scalars_of(ctx)
        if scalars:
            run.log({**scalars, "train_iter": ctx.train_iter}, step=ctx.env_step)

    return _log


class ProgressLines:
    """Progress as plain lines, for output that is not a terminal (a CI log, a Slurm output file): one line
    ``train: 4160/50000 step (8%), eval_return=312.5/475, 1234 step/s, 0:01:23 elapsed`` at most every
    ``interval`` seconds, and the last state when the run ends if any line was written (a short run stays
    quiet). It takes the calls :func:`progress_bar` makes on a tqdm bar; ``clock`` and ``file`` (default:
    ``sys.stderr`` when writing) are there to be replaced in tests.
    """

    def __init__(self, total: Optional[int] = None, desc: str = "train", unit: str = "step", *,
                 interval: float = 5.0, clock: Optional[Callable[[], float]] = None, file: Optional[TextIO] = None,
                 **_tqdm_options: Any) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.postfix: Dict[str, Any] = {}
        self._interval, self._clock, self._file = interval, clock or time.monotonic, file
        self._start = self._clock()
        self._last = (self._start, 0)  # when the last line was written, and the count it showed
        self._written = False

    def update(self, n: int = 1) -> None:
        """Count ``n`` more; write a line if ``interval`` seconds have passed since the last one."""
        self.n += n
        if self._clock() - self._last[0] >= self._interval:
            self._write()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        """What the next line shows after the count (``eval_return=...``)."""
        self.postfix = values

    def refresh(self) -> None:
        """Write the state now if it changed since the last line and lines are being written at all."""
        if self._written and self.n != self._last[1]:
            self._write()

    def close(self) -> None:
        """Nothing to release: every line is written when it is made."""

    def _write(self) -> None:
        now = self._clock()
        count = f"{self.n}/{self.total} {self.unit} ({100 * self.n // max(self.total, 1)}%)" if self.total \
            else f"{self.n} {self.unit}"
        rate = (self.n - self._last[1]) / max(now - self._last[0], 1e-9)
        elapsed = int(now - self._start)
        parts = [count, *(f"{k}={v}" for k, v in self.postfix.items()), f"{rate:.0f} {self.unit}/s",
                 f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d} elapsed"]
        print(f"{self.desc}: {', '.join(parts)}", file=self._file or sys.stderr, flush=True)
        self._last, self._written = (now, self.n), True


def progress_display(total: Optional[int], desc: str, unit: str) -> Any:
    """A tqdm bar on stderr when stderr is a terminal, else :class:`ProgressLines` (a line every few seconds)."""
    if sys.stderr is not None and sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=None)
    return ProgressLines(total=total, desc=desc, unit=unit)


@declares(backward_reads=("env_step",), factory=True)
def progress_bar(total_env_step: Optional[int] = None, desc: str = "train",
                 make_bar: Optional[Callable[..., Any]] = None, *, stop_value: Optional[float] = None,
                 counter: str = "env_step"):
    """Progress of env steps (or of the context's ``counter``, e.g. ``train_iter`` offline; out of
    ``total_env_step`` when there is a budget) with the latest eval return (against ``stop_value`` when given; and
    its env crashes and dropped episodes, when there were any) and steps/s: a tqdm bar on stderr when stderr is a
    terminal, else a line every few seconds (:class:`ProgressLines`), so CI and Slurm logs show it too; during an
    evaluation also its episodes (``evaluating=3/10 episodes``, from :data:`EVAL_PROGRESS_EVENT`). ``make_bar``
    (called as tqdm is) replaces :func:`progress_display`.

    Reads ctx: ``env_step`` (or ``counter``).
    """
    shape = dict(total=total_env_step, desc=desc, unit="step" if counter == "env_step" else "iter")
    bar = progress_display(**shape) if make_bar is None else make_bar(**shape, dynamic_ncols=True, disable=None)
    crashes = [0, 0]  # env crashes and dropped episodes over all evaluations
    postfix: Dict[str, Any] = {}
    evaluated = [-1]  # episodes of the evaluation in progress shown last

    def on_eval(result: Dict[str, Any]) -> None:
        crashes[0] += result.get("crashes", 0)
        crashes[1] += result.get("dropped", 0)
        shown = f"{result['mean']:.1f}"
        postfix.clear()
        postfix["eval_return"] = shown if stop_value is None else f"{shown}/{stop_value:g}"
        if crashes[0]:
            postfix.update(eval_crashes=crashes[0], eval_dropped=crashes[1])
        bar.set_postfix(refresh=False, **postfix)
        evaluated[0] = -1

    def on_eval_step(episodes: int, asked: int) -> None:
        if episodes != evaluated[0]:  # a bar redraws for each episode; lines come at most every few seconds
            bar.set_postfix(**postfix, evaluating=f"{episodes}/{asked} episodes")
            evaluated[0] = episodes
        bar.update(0)

    task.on(EVAL_EVENT, on_eval)
    task.on(EVAL_PROGRESS_EVENT, on_eval_step)
    task.on(FINISH_EVENT, lambda error: bar.refresh())
    task.once(CLOSE_EVENT, bar.close)
    shown = [0]

    @declares(backward_reads=(counter,))
    def _progress(ctx: OnlineRLContext):
        yield
        count = getattr(ctx, counter)
        if total_env_step is not None and count > total_env_step:
            bar.total = count  # the last collection overshoots the budget by less than one round
        bar.update(count - shown[0])
        shown[0] = count

    return _progress
