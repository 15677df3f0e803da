"""``conveyor tune``: search an entry's hyperparameters with Optuna, each trial a ``conveyor train`` run.

    conveyor tune cartpole/dqn --trials 20 --param 'policy.learn.learning_rate=loguniform(1e-4,1e-2)' \\
        --param 'policy.learn.batch_size=choice(32,64,128)' --max-env-step 20000
    conveyor tune cartpole/dqn --trials 10 --param ...      # the same study again: 10 more trials in it

The study lives in a database (default ``sqlite:///runs/<study>/study.db``): the same ``--study`` and ``--storage``
add trials to it. A trial trains the entry with the sampled values as ``--set`` overrides through ``conveyor
train``'s own code (:func:`conveyor.cli.train.trained`; ``--collectors`` too) into ``runs/<study>/trial_<n>/``
(``seed_<s>/`` in it for each of ``--seeds K``); its value is the mean of the seeds' last evaluation returns. The
first seed's evaluations go to the trial at their env steps (:class:`~conveyor.cli._tune_space.TrialReporter`, the
run's evaluation hook), where the pruner may end the run after its iteration, with its final checkpoint. At the end:
a table of the study's trials, the best value and params, and ``runs/<study>/best.yaml``, the best trial's
overrides as a config file for ``conveyor train ENTRY --config``.

``--jobs J`` starts J worker processes, each a ``conveyor tune`` of the same study running its share of the trials:
processes rather than Optuna's ``n_jobs`` threads, because a trial trains in its process's one pipeline runtime
(``conveyor.engine.task``), which threads would share; the workers share the study's database. Ctrl-C (SIGINT) or
SIGTERM ends the trial in progress as it ends a training (its iteration, its final checkpoint); the trial is
recorded as failed, the table printed, and the command exits with 130 / 143: the same command goes on with the study.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Optional

from conveyor.cli._common import message, number, usage_error
from conveyor.cli._tune_space import PRUNED_AT, PRUNERS, Param, TrialReporter, make_pruner, parse_param

__all__ = ["register", "run", "BEST_FILE"]

BEST_FILE = "best.yaml"
"""In ``runs/<study>/``: the best trial's overrides, for ``conveyor train ENTRY --config``."""
_OVERRIDES, _RETURNS = "overrides", "returns"  # the user attributes of a trial: its --set list, each seed's return


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``tune`` subcommand."""
    tune = commands.add_parser("tune", help="search hyperparameters with Optuna, a study of conveyor train runs "
                                            "(pip install \"conveyor[tune]\")",
                               description="Train ENTRY once per trial with values Optuna samples for each --param, in "
                                           "a study that the same --study and --storage resume; print the trials "
                                           "and write the best trial's config to runs/<study>/best.yaml.")
    tune.add_argument("entry", help="zoo entry as <env>/<algo> (`conveyor list`), or a .py file with main_config and "
                                    "main()")
    tune.add_argument("--trials", type=int, required=True, metavar="N", help="trials to run now (added to the study's)")
    tune.add_argument("--param", dest="params", action="append", default=[], metavar="KEY=DIST",
                      help="a config key to search, as --set names it, and its range: loguniform(a,b), uniform(a,b), "
                           "int(a,b) or choice(x,y,...), e.g. 'policy.learn.learning_rate=loguniform(1e-4,1e-2)' "
                           "(repeatable)")
    tune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="a config value every trial trains with, as conveyor train --set (repeatable)")
    tune.add_argument("--study", default=None, metavar="NAME",
                      help="the study's name and folder runs/NAME/ (default: the entry's exp_name + _tune)")
    tune.add_argument("--storage", default=None, metavar="URL",
                      help="the study's database, e.g. sqlite:///study.db (default sqlite:///runs/<study>/study.db)")
    tune.add_argument("--jobs", type=int, default=1, metavar="J", help="trials at once, each worker a process "
                                                                       "(default 1)")
    tune.add_argument("--pruner", choices=PRUNERS, default="median",
                      help="median: stop a trial whose best evaluation is below the median of the finished trials' "
                           "at the same env step (from the third trial on); none: train every trial to its budget")
    tune.add_argument("--max-env-step", type=int, default=None, metavar="N", help="each run's budget in env steps")
    tune.add_argument("--seeds", type=int, default=1, metavar="K",
                      help="train each trial with K seeds (from --seed on); its value is the mean of their last "
                           "evaluation returns (default 1)")
    tune.add_argument("--seed", type=int, default=None, help="the first seed (default: the entry's config)")
    tune.add_argument("--collectors", type=int, default=None, metavar="N",
                      help="train each run distributed, as conveyor train --collectors N")
    tune.add_argument("--evaluators", type=int, default=0, metavar="M",
                      help="with --collectors: M evaluator processes, as conveyor train --evaluators M")
    tune.add_argument("--no-progress", dest="progress", action="store_false", help="hide each run's progress bar")
    tune.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one of --jobs J: trials, no table
    tune.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the trials, print the study's table and write the best config; returns the exit code."""
    for flag, value in (("--trials", args.trials), ("--jobs", args.jobs), ("--seeds", args.seeds)):
        if value < 1:
            return usage_error(f"{flag} must be >= 1, got {value}")
    if args.max_env_step is not None and args.max_env_step <= 0:
        return usage_error(f"--max-env-step must be > 0, got {args.max_env_step}")
    if args.collectors is not None and args.collectors < 1:
        return usage_error(f"--collectors must be >= 1, got {args.collectors}")
    if args.evaluators and args.collectors is None:
        return usage_error(f"--evaluators {args.evaluators} needs --collectors N (a distributed run's collectors)")
    if not args.params:
        return usage_error("nothing to search: give one --param KEY=DIST or more, e.g. --param "
                           "'policy.learn.learning_rate=loguniform(1e-4,1e-2)'")
    try:
        import optuna
    except ImportError:
        return usage_error("conveyor tune needs Optuna: pip install \"conveyor[tune]\"")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # each trial's line is tune's own
    from conveyor.run.directory import RunDirError, runs_root
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError, load_entry

    try:
        space = _space(args.params)
        entry = load_entry(args.entry)
        name = _study_name(args.study, entry)
        folder = runs_root() / name
        storage = args.storage or f"sqlite:///{folder / 'study.db'}"
        if not args.worker:
            _check_keys(entry, args, space)
        study = _open_study(storage, name, args.pruner, folder if args.storage is None else None)
    except (UnknownEntryError, ConfigError, RunDirError, FileNotFoundError) as exc:
        return usage_error(message(exc))
    code = _workers(args, storage, name) if args.jobs > 1 else \
        _Trials(args, space, storage, name, _seeds(entry, args)).optimize(study)
    if args.worker:
        return code
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        print(f"conveyor: tune stopped by {signal.Signals(code - 128).name}: the trial in progress wrote its final "
              f"checkpoint and is recorded as failed; the same command adds more trials to study '{name}'",
              file=sys.stderr)
    reported = _report(study, args.entry, entry, folder)
    return code or reported


class _Interrupted(Exception):
    """A trial's training stopped on SIGINT or SIGTERM: the study ends here (``code`` the training's exit code)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"interrupted (exit {code})")
        self.code = code


class _Failed(Exception):
    """A trial's training failed (it printed why); the study goes on with the next trial."""


class _Trials:
    """Optuna's objective: a trial is the entry trained with the sampled values, once per seed, through ``conveyor
    train``'s code; its value the mean of the seeds' last evaluation returns. Prints one line as each trial ends."""

    def __init__(self, args: argparse.Namespace, space: List[Param], storage: str, study_name: str,
                 seeds: List[Optional[int]]) -> None:
        self._args, self._space, self._storage, self._study = args, space, storage, study_name
        self._seeds = seeds

    def optimize(self, study: Any) -> int:
        """Run ``--trials`` trials of ``study``; the exit code (128 + the signal where one stopped them)."""
        try:
            study.optimize(self, n_trials=self._args.trials, catch=(_Failed,), callbacks=[self._said],
                           gc_after_trial=False)
        except _Interrupted as stop:
            return stop.code
        except KeyboardInterrupt:  # between trials, or a second Ctrl-C
            return 130
        return 0

    def __call__(self, trial: Any) -> float:
        import optuna
        from conveyor.run.directory import runs_root

        overrides = [*self._args.overrides, *(f"{p.key}={p.suggest(trial)}" for p in self._space)]
        trial.set_user_attr(_OVERRIDES, overrides)
        folder = f"trial_{trial.number}"
        returns = []
        for k, seed in enumerate(self._seeds):
            root, name = (runs_root() / self._study, folder) if len(self._seeds) == 1 else \
                (runs_root() / self._study / folder, f"seed_{seed}")
            # The first seed's evaluations: one curve per trial for the pruner. Optuna names a trial in its storage by
            # _trial_id (its own integrations read it so); the reporter opens it again in another process with it.
            reporter = TrialReporter(self._storage, self._study, trial._trial_id, self._args.pruner, trial) \
                if k == 0 else None
            code, ctx = self._train(overrides, root, name, seed, reporter)
            if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
                raise _Interrupted(code)
            if code != 0 or ctx is None:
                raise _Failed(f"its training exited with {code}")  # and said why
            if PRUNED_AT in trial.user_attrs:
                raise optuna.TrialPruned()
            if ctx.last_eval_value is None:
                print(f"conveyor: trial {trial.number} failed: its run ended before its first evaluation; give it a "
                      f"larger --max-env-step", file=sys.stderr)
                raise _Failed("no evaluation")
            returns.append(float(ctx.last_eval_value))
        trial.set_user_attr(_RETURNS, returns)
        return sum(returns) / len(returns)

    def _train(self, overrides: List[str], root: Path, name: str, seed: Optional[int], reporter: Any) -> Any:
        """``conveyor train`` of one seed, into ``root/name``: its exit code and final context."""
        from conveyor.cli import parser
        from conveyor.cli.train import trained

        args = self._args
        argv = ["train", args.entry, "--exp-name", name, *(word for text in overrides for word in ("--set", text))]
        for flag, value in (("--seed", seed), ("--max-env-step", args.max_env_step), ("--collectors", args.collectors),
                            ("--evaluators", args.evaluators or None)):
            if value is not None:
                argv += [flag, str(value)]
        train = parser().parse_args(argv + ([] if args.progress else ["--no-progress"]))
        train.evaluation_hook = reporter
        with _runs_under(root):
            return trained(train)

    def _said(self, study: Any, trial: Any) -> None:
        """One line as a trial ends: its state, value or why, and its params."""
        params = ", ".join(f"{key}={_shown(value)}" for key, value in trial.params.items())
        print(f"trial {trial.number}: {_outcome(trial)}; {params}", flush=True)


def _outcome(trial: Any) -> str:
    import optuna

    if trial.state == optuna.trial.TrialState.COMPLETE:
        return f"value {number(trial.value)}"
    if trial.state == optuna.trial.TrialState.PRUNED:
        return f"pruned at env step {trial.user_attrs.get(PRUNED_AT, '-')}"
    return "failed" if trial.state == optuna.trial.TrialState.FAIL else trial.state.name.lower()


def _shown(value: Any) -> str:
    return number(value) if isinstance(value, float) else str(value)


@contextlib.contextmanager
def _runs_under(root: Path) -> Iterator[None]:
    """Runs go under ``root`` inside the block (``$CONVEYOR_RUNS``, which the run's processes inherit)."""
    from conveyor.run.directory import RUNS_ENV

    before = os.environ.get(RUNS_ENV)
    os.environ[RUNS_ENV] = str(root)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RUNS_ENV, None)
        else:
            os.environ[RUNS_ENV] = before


def _space(texts: List[str]) -> List[Param]:
    from conveyor.schema import ConfigError

    space = [parse_param(text) for text in texts]
    keys = [param.key for param in space]
    for key in keys:
        if keys.count(key) > 1:
            raise ConfigError(f"--param {key}: given {keys.count(key)} times; search each key once")
    return space


def _study_name(given: Optional[str], entry: ModuleType) -> str:
    from conveyor.run.directory import check_exp_name
    from conveyor.schema import ConfigError

    name = given if given is not None else f"{entry.main_config.get('exp_name', 'experiment')}_tune"
    try:
        return check_exp_name(name)
    except ConfigError:
        raise ConfigError(f"--study {name!r}: use one folder name such as 'dqn_lr' (runs/<study>/ holds its "
                          f"trials)") from None


def _check_keys(entry: ModuleType, args: argparse.Namespace, space: List[Param]) -> None:
    """Build the entry's pipeline once (not trained) with every --set and each --param at its lowest value (a
    choice's first), so an unknown key or a value of the wrong type is a ConfigError naming it before any trial."""
    from conveyor.config import apply_overrides
    from conveyor.schema import ConfigError
    from conveyor.testing import inspect_main

    cfg = apply_overrides(entry.main_config, [*args.overrides, *(f"{p.key}={p.first()}" for p in space)])
    try:
        inspect_main(entry, cfg=cfg)
    except ConfigError:
        raise
    except Exception as exc:  # the entry's own code failed while it was built
        raise ConfigError(f"{args.entry} does not build with the lowest values of the --param ranges: "
                          f"{type(exc).__name__}: {message(exc)}") from None


def _open_study(storage: str, name: str, pruner: str, folder: Optional[Path]) -> Any:
    """The study ``name`` in ``storage``, created (maximizing the return) where it is not there yet."""
    import optuna
    from conveyor.schema import ConfigError

    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True,
                                    pruner=make_pruner(pruner))
    except Exception as exc:  # a URL SQLAlchemy cannot parse or a database it cannot open: the user's input
        text = " ".join(str(exc).split("\n")[0].split())
        raise ConfigError(f"--storage {storage}: cannot open the study's database ({type(exc).__name__}: {text}); "
                          f"give a URL such as sqlite:///study.db") from None
    if study.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise ConfigError(f"study '{name}' in {storage} minimizes its value; conveyor tune maximizes the return: "
                          f"give another --study")
    return study


def _seeds(entry: ModuleType, args: argparse.Namespace) -> List[Optional[int]]:
    """Each trial's seeds: the entry's (None) for one seed without --seed, else K from --seed or the config's."""
    from conveyor.config import apply_overrides

    if args.seeds == 1 and args.seed is None:
        return [None]
    first = args.seed if args.seed is not None else apply_overrides(entry.main_config, args.overrides).get("seed", 0)
    return [first + k for k in range(args.seeds)]


def _workers(args: argparse.Namespace, storage: str, study_name: str) -> int:
    """``--jobs J``: J ``conveyor tune --worker`` processes on the study, each with its share of the trials; a
    SIGINT or SIGTERM here goes to each once (each ends its trial as a training does). Their exit code."""
    shares = [n for n in (args.trials // args.jobs + (i < args.trials % args.jobs) for i in range(args.jobs)) if n]
    argv = [sys.executable, "-m", "conveyor", "tune", args.entry, "--study", study_name, "--storage", storage,
            "--pruner", args.pruner, "--seeds", str(args.seeds), "--worker",
            *(word for text in args.params for word in ("--param", text)),
            *(word for text in args.overrides for word in ("--set", text))]
    for flag, value in (("--seed", args.seed), ("--max-env-step", args.max_env_step),
                        ("--collectors", args.collectors), ("--evaluators", args.evaluators or None)):
        if value is not None:
            argv += [flag, str(value)]
    argv += [] if args.progress else ["--no-progress"]
    workers = _Workers()
    with workers.forwarding():
        for share in shares:
            workers.start(argv + ["--trials", str(share)])
        codes = workers.wait()
    stopped = [code for code in codes if code in (128 + signal.SIGINT, 128 + signal.SIGTERM)]
    return stopped[0] if stopped else next((code for code in codes if code), 0)


class _Workers:
    """The worker processes of ``--jobs J``: each in its own session (a terminal's Ctrl-C reaches this process
    alone, which passes it on once), all stopped on the way out if this process fails."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []

    def start(self, argv: List[str]) -> None:
        """Start one worker running ``argv``."""
        self.procs.append(subprocess.Popen(argv, start_new_session=True))

    def wait(self) -> List[int]:
        """Wait for every worker; their exit codes."""
        return [proc.wait() for proc in self.procs]

    def _forward(self, signum: int, frame: Any) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    @contextlib.contextmanager
    def forwarding(self) -> Iterator[None]:
        """SIGINT and SIGTERM go to the workers inside the block; any left when it raises are killed."""
        before = {signum: signal.signal(signum, self._forward) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)
            for proc in self.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _report(study: Any, label: str, entry: ModuleType, folder: Path) -> int:
    """Print the study's trials and its best; write the best trial's config. 1 where no trial has a value."""
    import optuna

    trials = study.get_trials(deepcopy=False)
    keys = list(dict.fromkeys(key for trial in trials for key in trial.params))
    rows = [["trial", "state", "value", "returns", *keys]]
    for trial in trials:
        returns = trial.user_attrs.get(_RETURNS)
        rows.append([str(trial.number), _outcome(trial) if trial.state != optuna.trial.TrialState.COMPLETE
                     else "complete", number(trial.value) if trial.value is not None else "-",
                     " ".join(number(value) for value in returns) if returns else "-",
                     *(_shown(trial.params[key]) if key in trial.params else "-" for key in keys)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if not any(trial.state == optuna.trial.TrialState.COMPLETE for trial in trials):
        print(f"no trial of study '{study.study_name}' has completed yet: no best config", file=sys.stderr)
        return 1
    best = study.best_trial
    path = folder / BEST_FILE
    _write_best(path, entry, best, study.study_name, label)
    params = ", ".join(f"{key}={_shown(value)}" for key, value in best.params.items())
    print(f"best: trial {best.number}, value {number(best.value)}; {params}")
    print(f"best config: {path} (conveyor train {label} --config {path})")
    return 0


def _write_best(path: Path, entry: ModuleType, trial: Any, study_name: str, label: str) -> None:
    """The trial's overrides (its --set and params) as a nested YAML mapping, each value typed as the run read it."""
    import yaml
    from conveyor.config import apply_overrides

    overrides = trial.user_attrs.get(_OVERRIDES, [])
    cfg = apply_overrides(entry.main_config, overrides)
    out: Dict[str, Any] = {}
    for text in overrides:
        parts = text.partition("=")[0].strip().split(".")
        value, node = cfg, out
        for part in parts:
            value = value[part]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = json.loads(json.dumps(value))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# conveyor tune, study '{study_name}': trial {trial.number}, value {number(trial.value)} (the "
                    f"mean last evaluation return)\n# conveyor train {label} --config {path}\n"
                    + yaml.safe_dump(out, sort_keys=False))
