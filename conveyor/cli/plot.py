"""``conveyor plot``: learning curves from runs' TensorBoard logs.

    conveyor plot runs/dqn_s0 runs/dqn_s1 runs/dqn_lr2e-3_s0 runs/dqn_lr2e-3_s1 [--out curves.png]
                  [--metric eval/return] [--x env_step|wall] [--band minmax|std]

Runs whose saved configs are the same but for the seed (and the run name) are one experiment: it is drawn
as the mean over its runs with a band (min to max, or one std either side). Each run's curve is interpolated
onto the union of the experiment's x values and holds its last value after it stopped (a run that solved
early stays solved). Several experiments are overlaid, each labelled with its run names and the config keys
that tell it apart from the others. A return is drawn with the stop value of the runs' env (``env.stop_value``
in their ``config.json``) as a dashed line.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from conveyor.cli._common import message, os_message, usage_error

__all__ = ["register", "run", "read_curve", "experiments", "draw", "Curve", "IMAGE_SUFFIXES", "image_path_problem",
           "agg_figure", "seed_stem"]

IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg")
"""The files ``--out`` can write (matplotlib picks the format by suffix)."""

_SEED_SUFFIX = re.compile(r"[_-](?:seed|s)[_-]?\d+$", re.IGNORECASE)


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``plot`` subcommand."""
    parser = commands.add_parser("plot", help="plot learning curves of runs (seeds aggregated, experiments overlaid)",
                                 description="Plot a metric of runs from their TensorBoard logs: the runs of one "
                                             "experiment (same config but the seed) as a mean and a band, several "
                                             "experiments overlaid.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (runs/<exp-name>)")
    parser.add_argument("--out", default="curves.png", help="image to write (.png, .pdf, .svg, .jpg; default "
                                                            "curves.png)")
    parser.add_argument("--metric", default="eval/return", help="TensorBoard scalar to plot (default eval/return)")
    parser.add_argument("--x", choices=("env_step", "wall"), default="env_step",
                        help="x axis: env steps, or wall-clock seconds since the run started (default env_step)")
    parser.add_argument("--band", choices=("minmax", "std"), default="minmax",
                        help="band around an experiment's mean: min to max over its runs, or +-1 std")
    parser.set_defaults(run=run)


@dataclass
class Curve:
    """One run's metric: its directory, its config minus seed and name (``None`` without config.json), x and y,
    and the stop value its env trains to (``None`` when unknown)."""

    run_dir: Path
    config: Any
    x: List[float]
    y: List[float]
    stop_value: Optional[float] = None


def run(args: argparse.Namespace) -> int:
    """Read, group and plot; returns the exit code."""
    if (problem := image_path_problem(args.out)) is not None:
        return usage_error(problem)
    from conveyor.run import RunDirError
    try:
        curves = [read_curve(Path(d), args.metric, args.x) for d in dict.fromkeys(args.runs)]
        groups = experiments(curves)
        draw(groups, args.out, metric=args.metric, x=args.x, band=args.band)
    except (RunDirError, FileNotFoundError, LookupError, ImportError) as exc:
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    print(f"wrote {args.out}: {len(groups)} experiment{'s' * (len(groups) != 1)} from {len(curves)} "
          f"run{'s' * (len(curves) != 1)} ({args.metric} against {args.x})")
    return 0


def image_path_problem(out: str) -> Optional[str]:
    """What is wrong with an ``--out`` whose suffix names no image format written here (``None``: nothing)."""
    if Path(out).suffix.lower() not in IMAGE_SUFFIXES:
        return f"--out {out}: the file must end in {', '.join(IMAGE_SUFFIXES)}"
    return None


def seed_stem(name: str) -> str:
    """A run name without its trailing seed tag: ``_s<N>``, ``-s<N>``, ``_seed<N>``, ``_seed_<N>`` (any case;
    ``dqn_s3`` and ``curve_seed0`` give ``dqn`` and ``curve``); a bare number is kept (``lr1e-3`` stays)."""
    return _SEED_SUFFIX.sub("", name) or name


def read_curve(run_dir: Path, metric: str, x: str) -> Curve:
    """``metric`` of the run in ``run_dir`` from the event files under ``run_dir/tb`` (a resumed run's files
    are read in order; a step logged twice keeps its last value)."""
    from conveyor.schema import closest
    from conveyor.run.directory import read_run_config
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ImportError("conveyor plot reads TensorBoard logs with the tensorboard package: pip install "
                          "tensorboard") from None
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}")
    logdir = run_dir / "tb"
    if not any(logdir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event files in {logdir}: is {run_dir} a run directory "
                                f"(runs/<exp-name>) that has trained?")
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    if metric not in tags:
        hint = closest(metric, tags)
        shown = sorted(tags, key=lambda tag: (not tag.startswith(("eval/", "charts/")), tag))
        listed = ", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "")
        raise LookupError(f"{run_dir} logged no '{metric}'" + (f": did you mean '{hint}'?" if hint else "") +
                          f" (it has {listed or 'no scalars'})")
    start = events.FirstEventTimestamp()
    points = {(e.step if x == "env_step" else e.wall_time - start): e.value for e in events.Scalars(metric)}
    xs = sorted(points)
    config, stop = None, None
    try:
        saved = read_run_config(run_dir)
        config = {"policy": saved.get("policy"),
                  "config": {k: v for k, v in saved["config"].items() if k not in ("seed", "exp_name")}}
        stop = (saved["config"].get("env") or {}).get("stop_value")
    except FileNotFoundError:
        pass
    return Curve(run_dir, config, [float(v) for v in xs], [float(points[v]) for v in xs],
                 None if stop is None else float(stop))


def experiments(curves: Sequence[Curve]) -> Dict[str, List[Curve]]:
    """The curves grouped by config (runs without a config.json alone), keyed by their legend label: the run
    names, then what tells the group apart from the others (``dqn_s0, dqn_s1: learning_rate=0.003``)."""
    grouped: Dict[str, List[Curve]] = {}
    for curve in curves:
        key = json.dumps(curve.config, sort_keys=True, default=str) if curve.config is not None else str(curve.run_dir)
        grouped.setdefault(key, []).append(curve)
    flats = {key: _flatten(runs[0].config) for key, runs in grouped.items()}
    differing = sorted({k for flat in flats.values() for k in flat
                        if len({json.dumps(f.get(k), default=str) for f in flats.values()}) > 1})
    labelled = {}
    for key, runs in grouped.items():
        label = _names(runs)
        if runs[0].config is None or not differing:
            pass
        elif "policy" in differing:  # another algorithm: its name says more than the keys that differ with it
            label += f" ({runs[0].config['policy']})"
        else:
            label += ": " + ", ".join(f"{k.rpartition('.')[2]}={flats[key].get(k)}" for k in differing[:3])
        labelled[label] = runs
    return labelled


def _flatten(config: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    out: Dict[str, Any] = {}
    for key, value in config.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _names(runs: Sequence[Curve]) -> str:
    """The runs' names (``dqn_s0, dqn_s1``); of more than three, their common name without the seed number
    and their count (``dqn (5 runs)``)."""
    if len(runs) <= 3:
        return ", ".join(run.run_dir.name for run in runs)
    stems = {seed_stem(run.run_dir.name) for run in runs}
    return f"{stems.pop() if len(stems) == 1 else runs[0].run_dir.name + ', ...'} ({len(runs)} runs)"


def agg_figure(size: Tuple[float, float]) -> Any:
    """A matplotlib figure of ``size`` inches drawn by Agg, off-screen: no display, whatever the backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("drawing figures needs matplotlib: pip install matplotlib") from None
    figure = Figure(figsize=size)
    FigureCanvasAgg(figure)
    return figure


def draw(groups: Dict[str, List[Curve]], out: str, *, metric: str = "eval/return", x: str = "env_step",
         band: str = "minmax") -> Any:
    """One mean line and band per experiment (:func:`experiments`) on one axes, and the stop value of a return,
    written to ``out`` (Agg, no display needed); returns the matplotlib figure."""
    import numpy as np
    figure = agg_figure((7, 4.5))
    axes = figure.add_subplot()
    for label, runs in groups.items():
        grid = np.unique(np.concatenate([run.x for run in runs]))
        ys = np.stack([np.interp(grid, run.x, run.y) for run in runs])
        mean = ys.mean(axis=0)
        line, = axes.plot(grid, mean, label=label, marker="o" if len(grid) <= 30 else None, markersize=3)
        if len(runs) > 1:
            low, high = (ys.min(axis=0), ys.max(axis=0)) if band == "minmax" else \
                (mean - ys.std(axis=0), mean + ys.std(axis=0))
            axes.fill_between(grid, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    if metric.endswith("return"):  # on the scale the stop value is judged on
        for stop in sorted({run.stop_value for runs in groups.values() for run in runs} - {None}):
            axes.axhline(stop, color="0.4", linestyle="--", linewidth=1, label=f"stop value {stop:g}")
    axes.set_xlabel("env steps" if x == "env_step" else "wall-clock seconds")
    axes.set_ylabel(metric)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    return figure
