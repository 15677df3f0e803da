"""``conveyor report``: groups of runs compared by their final return, as the rliable protocol does.

    conveyor report runs/dqn_s0 runs/dqn_s1 runs/dqn_s2 runs/ppo_s0 runs/ppo_s1 runs/ppo_s2 [--out report.png]
    conveyor report runs/* --group dqn='runs/dqn_*' --group ppo='runs/ppo_*' [--seed 0]

A run's final return is the mean return of its last evaluation: the last ``eval/return`` its logger wrote under
``tb/`` (read by :func:`conveyor.cli.plot.read_curve`; a team's return for a team of agents). Runs are grouped by
their name without its seed tag (:func:`conveyor.cli.plot.seed_stem`: ``dqn_s0`` and ``dqn_s1`` are ``dqn``), or
by ``--group NAME=GLOB``. Per group: the interquartile mean (IQM) of its final returns with a 95% percentile
interval of a stratified bootstrap; between groups, the probability of improvement P(X > Y). This is the protocol
of Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice" (NeurIPS; the
``rliable`` package). P(X > Y) is rliable's own estimator (``rliable.metrics``). The IQM and its bootstrap are
computed here with numpy, by the same definitions: ``rliable.library`` (its bootstrap) imports the ``arch``
package, which does not import with pandas 3 (arch 7.2.0), and calls the statistic once per resample.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from conveyor.cli._common import message, number, os_message, usage_error
from conveyor.cli.plot import agg_figure, image_path_problem, read_curve, seed_stem

__all__ = ["register", "run", "final_return", "group_runs", "iqm", "iqm_interval", "probability_of_improvement",
           "summarize", "table", "draw", "GroupStats", "GroupError", "MIN_RUNS", "REPS"]

MIN_RUNS = 5
"""Below this many runs a group's interval says little (the protocol asks for 5 runs at least, 10 is better)."""
REPS = 50_000
"""Bootstrap resamples per interval (rliable's default)."""
_CHUNK = 1 << 20
"""Resampled scores held at once while bootstrapping (8 MiB of float64), whatever the number of runs."""


class GroupError(ValueError):
    """A ``--group`` that cannot be used: bad syntax, a name given twice, no run, or a run in none or two."""


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``report`` subcommand."""
    parser = commands.add_parser("report", help="compare groups of runs: IQM of their final returns with a bootstrap "
                                                "interval, probability of improvement",
                                 description="Compare groups of runs (the seeds of an experiment) by their final "
                                             "return, the mean return of each run's last evaluation: per group the "
                                             "interquartile mean (IQM) with a 95% stratified-bootstrap interval, "
                                             "between groups the probability of improvement P(X > Y) (the rliable "
                                             "protocol, Agarwal et al. 2021); a table on stdout and a figure.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (runs/<exp-name>); without --group, the runs whose names are the same "
                             "but for a trailing seed tag (_s0, -s1, _seed2) are one group")
    parser.add_argument("--group", action="append", default=[], metavar="NAME=GLOB",
                        help="a group: the RUN_DIRs whose path or name matches GLOB (quote it); repeat for each group")
    parser.add_argument("--out", default="report.png",
                        help="figure of each group's IQM and interval (.png, .pdf, .svg, .jpg; default report.png)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the bootstrap (default 0): the same runs and seed give the same intervals")
    parser.set_defaults(run=run)


@dataclass
class GroupStats:
    """One group's final returns (one per run, in the order given) and their IQM with its 95% interval."""

    name: str
    finals: List[float]
    iqm: float
    low: float
    high: float


def run(args: argparse.Namespace) -> int:
    """Group, read, compare, draw and print; returns the exit code."""
    if (problem := image_path_problem(args.out)) is not None:
        return usage_error(problem)
    if args.seed < 0:
        return usage_error(f"--seed {args.seed}: the bootstrap's seed must be >= 0")
    from conveyor.run import RunDirError
    try:
        _require_extra()
        groups = group_runs(list(dict.fromkeys(Path(d) for d in args.runs)), args.group)
        stats = summarize({name: [final_return(d) for d in dirs] for name, dirs in groups.items()}, seed=args.seed)
        draw(stats, args.out)
    except (GroupError, RunDirError, FileNotFoundError, LookupError, ImportError) as exc:
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    print(table(stats, seed=args.seed))
    print(f"wrote {args.out}")
    return 0


def _require_extra() -> None:
    try:
        import matplotlib  # noqa: F401
        import rliable.metrics  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"conveyor report needs the report extra ({exc.name or 'rliable'} is missing): "
                          f"pip install 'conveyor[report]'") from None


def final_return(run_dir: Path) -> float:
    """The mean return of the run's last evaluation (a team's return for a team of agents): the last ``eval/return``
    its logger wrote, read as ``conveyor plot`` reads it."""
    try:
        value = read_curve(run_dir, "eval/return", "env_step").y[-1]
    except LookupError:
        raise LookupError(f"{run_dir} has no evaluation: its TensorBoard log holds no eval/return yet (report "
                          f"compares each run's last evaluation)") from None
    if not np.isfinite(value):
        raise LookupError(f"{run_dir}: the mean return of its last evaluation is {value}, not a return to compare")
    return value


def group_runs(runs: Sequence[Path], specs: Sequence[str]) -> Dict[str, List[Path]]:
    """The runs by group, in the order given. Without ``specs``, by name without the seed tag (:func:`seed_stem`);
    with ``NAME=GLOB`` specs, the runs whose path (as given, or absolute) or name matches GLOB, each run in one
    group and each group with a run (else :class:`GroupError`)."""
    if not specs:
        by_stem: Dict[str, List[Path]] = {}
        for run_dir in runs:
            by_stem.setdefault(seed_stem(run_dir.name), []).append(run_dir)
        return by_stem
    globs: Dict[str, str] = {}
    for spec in specs:
        name, equals, glob = (part.strip() for part in spec.partition("="))
        if not equals or not name or not glob:
            raise GroupError(f"--group {spec!r}: expected NAME=GLOB, e.g. --group dqn='runs/dqn_s*'")
        if name in globs:
            raise GroupError(f"--group {name} is given twice: one GLOB per group (a GLOB may use *, ? and [...])")
        globs[name] = glob
    grouped: Dict[str, List[Path]] = {name: [] for name in globs}
    for run_dir in runs:
        names = [name for name, glob in globs.items() if _matches(run_dir, glob)]
        if not names:
            raise GroupError(f"{run_dir} matches no --group: add a group that matches it, or leave it out")
        if len(names) > 1:
            raise GroupError(f"{run_dir} matches --group {' and --group '.join(names)}: a run belongs to one group, "
                             f"make their GLOBs tell it apart")
        grouped[names[0]].append(run_dir)
    for name, dirs in grouped.items():
        if not dirs:
            shown = ", ".join(str(d) for d in runs[:3]) + (", ..." if len(runs) > 3 else "")
            raise GroupError(f"--group {name}={globs[name]} matches none of the runs given ({shown}): a group needs "
                             f"at least one run")
    return grouped


def _matches(run_dir: Path, glob: str) -> bool:
    pattern = str(Path(glob))  # ./runs/x_* and runs/x_*/ match runs/x_s0 as given
    return any(fnmatchcase(text, pattern) for text in (str(run_dir), str(run_dir.absolute()), run_dir.name))


def iqm(scores: Any) -> np.ndarray:
    """The interquartile mean along the last axis: the mean of what is left once the lowest and the highest quarter
    (``n // 4`` scores each) are cut; ``scipy.stats.trim_mean(x, 0.25)``, which rliable's ``aggregate_iqm`` is."""
    ordered = np.sort(np.asarray(scores, dtype=np.float64), axis=-1)
    n = ordered.shape[-1]
    return ordered[..., n // 4:n - n // 4].mean(axis=-1)


def iqm_interval(scores: Sequence[float], *, seed: int = 0, reps: int = REPS,
                 size: float = 0.95) -> Tuple[float, float]:
    """The ``size`` percentile interval of the IQM of ``scores`` over ``reps`` bootstrap resamples drawn with ``seed``.
    Each resample draws the runs with replacement: the strata of rliable's stratified bootstrap are the tasks, and a
    group is one task (Efron and Tibshirani 1993, the percentile interval)."""
    values = np.asarray(scores, dtype=np.float64)
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK // len(values))
    stats = np.concatenate([iqm(values[rng.integers(0, len(values), size=(min(chunk, reps - done), len(values)))])
                            for done in range(0, reps, chunk)])
    low, high = np.percentile(stats, [50 * (1 - size), 50 * (1 + size)])
    return float(low), float(high)


def probability_of_improvement(x: Sequence[float], y: Sequence[float]) -> float:
    """P(X > Y): how likely a run of group X ends above a run of group Y, a tie counting half (the Mann-Whitney U
    statistic over all pairs of runs, normalised); rliable's ``probability_of_improvement`` on one task."""
    from rliable.metrics import probability_of_improvement as rliable_pi
    return float(rliable_pi(np.asarray(x, dtype=np.float64)[:, None], np.asarray(y, dtype=np.float64)[:, None]))


def summarize(finals: Dict[str, Sequence[float]], *, seed: int = 0) -> List[GroupStats]:
    """Each group's IQM and 95% interval, in the order given; every group's bootstrap starts from ``seed``, so a
    group's interval does not depend on the other groups reported with it."""
    return [GroupStats(name, [float(v) for v in values], float(iqm(values)), *iqm_interval(values, seed=seed))
            for name, values in finals.items()]


def table(groups: Sequence[GroupStats], *, seed: int = 0) -> str:
    """The report as printed: a row per group (runs, IQM, interval), P(X > Y) for the two groups or for each ordered
    pair of more, and a note on groups of fewer than :data:`MIN_RUNS` runs."""
    rows = [("group", "runs", "IQM", "CI low", "CI high")]
    rows += [(g.name, str(len(g.finals)), number(g.iqm), number(g.low), number(g.high)) for g in groups]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"final return (mean return of each run's last evaluation): IQM and 95% bootstrap interval (seed {seed})"]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    pairs = [(groups[0], groups[1])] if len(groups) == 2 else \
        [(x, y) for x in groups for y in groups if x is not y]
    lines += [f"P({x.name} > {y.name}) = {probability_of_improvement(x.finals, y.finals):.3f}" for x, y in pairs]
    few = [f"{g.name} ({len(g.finals)} run{'s' * (len(g.finals) != 1)})" for g in groups if len(g.finals) < MIN_RUNS]
    if few:
        lines.append(f"note: {', '.join(few)}: with fewer than {MIN_RUNS} runs the interval (and P(X > Y)) says "
                     f"little; run {MIN_RUNS} seeds or more, 10 is better")
    return "\n".join(lines)


def draw(groups: Sequence[GroupStats], out: str) -> Any:
    """Each group on its own row, the first on top: its 95% interval as a bar, its IQM as a line, its runs' final
    returns as dots; written to ``out`` (Agg, no display needed). Returns the matplotlib figure."""
    figure = agg_figure((6.5, 1.4 + 0.6 * len(groups)))
    axes = figure.add_subplot()
    rows = np.arange(len(groups))[::-1]
    for row, group, color in zip(rows, groups, _colors(len(groups))):
        axes.barh(row, group.high - group.low, left=group.low, height=0.5, color=color, alpha=0.35)
        axes.vlines(group.iqm, row - 0.25, row + 0.25, color=color, linewidth=2.5)
        axes.scatter(group.finals, np.full(len(group.finals), row), s=14, color="0.2", alpha=0.6, zorder=3)
    axes.set_yticks(rows, [f"{g.name} ({len(g.finals)} run{'s' * (len(g.finals) != 1)})" for g in groups])
    axes.set_ylim(-0.6, len(groups) - 0.4)
    axes.set_xlabel("final return: IQM (line), 95% bootstrap interval (bar), runs (dots)")
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    return figure


def _colors(n: int) -> List[Any]:
    from matplotlib import colormaps
    return [colormaps["tab10"](i % 10) for i in range(n)]
