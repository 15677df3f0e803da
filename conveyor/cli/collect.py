"""``conveyor collect``: record a dataset with a trained policy, for offline RL.

    conveyor collect cartpole/dqn --ckpt runs/cartpole_dqn/ckpt/eval_best.pth.tar --episodes 100 \\
        --dataset-id cartpole/expert-v0 [--noise 0.5] [--seed 0] [--dataset-dir datasets] [--overwrite]
    conveyor collect mujoco/sac --d4rl medium|medium-replay [--env Hopper-v5] [--seed N] [--max-env-step N] \\
        [--target-return R] [--transitions N] [--set KEY=VALUE ...]

The second form trains the entry and writes D4RL-style datasets of that run (:mod:`conveyor.cli.d4rl`).

The policy is the one the checkpoint holds (a ``CkptSaver`` file of a run of entry NAME: ``eval_best``,
``latest`` or ``final``), built with the config its run saved (``runs/<exp>/config.json``, else NAME's);
it acts greedily (deterministically), with ``--noise EPS``: a uniformly random action with probability EPS
for discrete actions, Gaussian noise of std ``EPS * (high - low)`` (clipped to the bounds) for continuous
ones. The first ``--episodes`` episodes to finish on the entry's collector envs are written as a Minari
dataset ``<dataset-dir>/<dataset-id>`` (``--dataset-dir`` default: ``$MINARI_DATASETS_PATH``, else
``~/.minari/datasets``). :func:`collect_dataset` does the same from Python.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from conveyor.cli._common import message, os_message, usage_error
from conveyor.cli._recording import CollectError, collect_dataset

__all__ = ["register", "run", "collect_dataset", "CollectError"]


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``collect`` subcommand."""
    collect = commands.add_parser(
        "collect", help="record a Minari dataset with a trained policy, e.g. for cartpole/bc",
        description="Run the policy of a checkpoint for N episodes (optionally with noise) and write them as a "
                    "Minari dataset; or, with --d4rl, train the entry and write D4RL-style datasets of that run.")
    collect.add_argument("entry", help="zoo entry whose run wrote the checkpoint, e.g. cartpole/dqn")
    collect.add_argument("--ckpt", help="checkpoint file, e.g. runs/cartpole_dqn/ckpt/eval_best.pth.tar (required "
                                        "without --d4rl)")
    collect.add_argument("--episodes", type=int, help="number of episodes to record (required without --d4rl)")
    collect.add_argument("--noise", type=float, default=0.0, metavar="EPS",
                         help="discrete actions: probability of a random action; continuous: Gaussian std as a "
                              "fraction of the action range (default 0: the greedy policy)")
    collect.add_argument("--seed", type=int, default=None,
                         help="seed of the envs and the noise (default: the run's; --d4rl: of the run, default 0)")
    collect.add_argument("--dataset-id", help="Minari id (namespace/)name-v<version>, e.g. cartpole/expert-v0 "
                                              "(required without --d4rl)")
    collect.add_argument("--dataset-dir", default=None,
                         help="local dataset folder (default: $MINARI_DATASETS_PATH, else ~/.minari/datasets)")
    collect.add_argument("--overwrite", action="store_true", help="replace a dataset of the same id")
    collect.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    d4rl = collect.add_argument_group("D4RL-style datasets from a training run (instead of --ckpt, --episodes and "
                                      "--dataset-id; docs/offline.md)")
    d4rl.add_argument("--d4rl", choices=("medium", "medium-replay"),
                      help="train the entry until its greedy return reaches the target, then write both datasets "
                           "of that run (cached) and print this one's folder")
    d4rl.add_argument("--env", help="env id of the run, e.g. HalfCheetah-v5 (default: the entry's)")
    d4rl.add_argument("--target-return", type=float, default=None,
                      help="the medium policy's greedy return (default: 1/3 of D4RL's expert normalised score)")
    d4rl.add_argument("--max-env-step", type=int, default=None,
                      help="env steps of the run at most, if the target is not reached earlier (default 1000000)")
    d4rl.add_argument("--transitions", type=int, default=None,
                      help="transitions in the medium dataset, whole episodes (default 100000; D4RL: 1000000)")
    d4rl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override one value of the run's config (repeatable)")
    collect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Record the dataset; returns the exit code."""
    from conveyor.data import DatasetError
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError

    if args.d4rl is not None:
        return _run_d4rl(args)
    missing = [flag for flag, value in (("--ckpt", args.ckpt), ("--episodes", args.episodes),
                                        ("--dataset-id", args.dataset_id)) if value is None]
    stray = [flag for flag, value in (("--env", args.env), ("--target-return", args.target_return),
                                      ("--max-env-step", args.max_env_step), ("--transitions", args.transitions),
                                      ("--set", args.overrides or None)) if value is not None]
    if missing or stray:
        return usage_error(f"collect: {'give ' + ', '.join(missing) if missing else ''}"
                           f"{'; ' if missing and stray else ''}"
                           f"{', '.join(stray) + ' go with --d4rl only' if stray else ''} (conveyor collect --help)")
    try:
        path, steps, returns = collect_dataset(
            args.entry, args.ckpt, args.episodes, noise=args.noise, seed=args.seed, dataset_id=args.dataset_id,
            dataset_dir=args.dataset_dir, overwrite=args.overwrite, progress=args.progress and sys.stdout.isatty())
    except (CollectError, DatasetError, UnknownEntryError, ConfigError, FileNotFoundError, FileExistsError,
            ImportError) as exc:  # ImportError: minari missing, the message says what to install
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    print(f"wrote {args.episodes} episodes ({steps} transitions, mean return {np.mean(returns):.1f}) to {path}")
    return 0


def _run_d4rl(args: argparse.Namespace) -> int:
    """``--d4rl KIND``: generate (or reuse) the run's two datasets; prints the folder of KIND's."""
    from conveyor.cli.d4rl import DEFAULT_TRANSITIONS, D4RLError, d4rl_dataset
    from conveyor.data import DatasetError, dataset_metadata
    from conveyor.schema import ConfigError
    from conveyor.zoo import UnknownEntryError, load_entry
    from conveyor.run import RunDirError

    given = [flag for flag, value in (("--ckpt", args.ckpt), ("--episodes", args.episodes),
                                      ("--dataset-id", args.dataset_id)) if value is not None]
    if given:
        return usage_error(f"collect --d4rl: {', '.join(given)} do not apply (the run's best policy is recorded, "
                           f"under the id --d4rl gives it)")
    try:
        env_id = args.env or load_entry(args.entry).main_config["env"]["env_id"]
        path, reused = d4rl_dataset(
            args.entry, args.d4rl, env_id, seed=0 if args.seed is None else args.seed, max_env_step=args.max_env_step,
            target_return=args.target_return,
            transitions=DEFAULT_TRANSITIONS if args.transitions is None else args.transitions, noise=args.noise,
            overrides=args.overrides, dataset_dir=args.dataset_dir, overwrite=args.overwrite,
            progress=args.progress and sys.stdout.isatty())
        generation = dataset_metadata(path)["conveyor_generation"]
    except KeyboardInterrupt as stop:  # TrainingInterrupted too: the run wrote its checkpoints, no dataset stays
        print("conveyor: interrupted; no dataset written, the run directory stays: start again with --overwrite",
              file=sys.stderr)
        return 128 + getattr(stop, "signum", 2)
    except (D4RLError, CollectError, DatasetError, UnknownEntryError, ConfigError, RunDirError, FileNotFoundError,
            FileExistsError, ImportError) as exc:
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    reached = "reached" if generation["target_reached"] else "NOT reached (--max-env-step ended the run)"
    print(f"{'reused' if reused else 'wrote'} {path}: {args.d4rl} of {generation['env_steps']} env steps of "
          f"{generation['run']}, medium policy's greedy return {generation['medium_eval_return']:.1f}, target "
          f"{generation['target_return']:.1f} {reached}")
    return 0
