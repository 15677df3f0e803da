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
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from conveyor.cli._common import message, os_message, usage_error

__all__ = ["register", "run", "collect_dataset", "CollectError"]


class CollectError(ValueError):
    """The checkpoint or the arguments do not make a policy that can collect for this entry."""


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
    from conveyor.zoo.run import RunDirError

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


class _NoisyActor:
    """The greedy (eval) view of a policy, with epsilon-random or Gaussian action noise; what a collector drives."""

    def __init__(self, eval_mode: Any, action_space: Any, noise: float, seed: Optional[int]) -> None:
        self._eval = eval_mode
        self._space = action_space
        self._noise = noise
        self._rng = np.random.default_rng(seed)

    def forward(self, obs: Any, **kwargs: Any) -> Dict[str, Any]:
        action = np.asarray(self._eval.forward(obs)["action"])
        if self._noise == 0.0:
            return {"action": action}
        if hasattr(self._space, "n"):
            explore = self._rng.random(action.shape) < self._noise
            random = self._space.start + self._rng.integers(0, self._space.n, action.shape)
            return {"action": np.where(explore, random, action).astype(action.dtype)}
        low, high = self._space.low, self._space.high
        noisy = action + self._rng.normal(size=action.shape) * self._noise * (high - low)
        return {"action": np.clip(noisy, low, high).astype(action.dtype)}

    def reset(self, env_ids: Optional[List[int]] = None) -> None:
        self._eval.reset(env_ids)


def _policy_class(state: Dict[str, Any], ckpt: Path) -> type:
    import conveyor.policy
    from conveyor.policy import Policy
    name = state.get("meta", {}).get("policy")
    cls = getattr(conveyor.policy, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise CollectError(f"{ckpt} names no known policy class (meta.policy={name!r}): pass a checkpoint a "
                           f"`conveyor train` run wrote (runs/<exp>/ckpt/eval_best.pth.tar)")
    return cls


def _run_config(entry: Any, name: str, cls: type, ckpt: Path, env_id: Optional[str] = None) -> Any:
    """The config the checkpoint's run saved (its policy must be ``cls``), else the entry's; checked to fit both
    (the env: ``env_id``, else the entry's)."""
    import json

    from conveyor.config import compile_config
    from conveyor.schema import ConfigError
    try:
        compile_config(entry.main_config, policy=cls, infer_shapes=False)
    except ConfigError as exc:
        raise CollectError(f"{ckpt} holds a {cls.__name__}, which entry {name} does not train ({message(exc)}); "
                           f"pass the entry whose run wrote the checkpoint") from None
    raw = entry.main_config
    saved = ckpt.parent.parent / "config.json"
    if saved.is_file():
        try:
            run_cfg = json.loads(saved.read_text())
        except (OSError, ValueError):
            run_cfg = {}
        if run_cfg.get("policy") == cls.__name__ and isinstance(run_cfg.get("config"), dict):
            raw = run_cfg["config"]
    expected = env_id or entry.main_config["env"]["env_id"]
    if raw["env"]["env_id"] != expected:
        raise CollectError(f"{ckpt} comes from a run in {raw['env']['env_id']}, entry {name} acts in "
                           f"{expected}: pass the entry whose run wrote the checkpoint")
    return compile_config(raw, policy=cls)


def collect_dataset(entry_name: str, ckpt: Any, episodes: Optional[int], *, dataset_id: str, noise: float = 0.0,
                    seed: Optional[int] = None, dataset_dir: Any = None, overwrite: bool = False,
                    progress: bool = False, transitions: Optional[int] = None, env_id: Optional[str] = None,
                    metadata: Optional[Dict[str, Any]] = None) -> tuple:
    """Record ``episodes`` episodes of the checkpoint's policy as Minari dataset ``dataset_id`` (see the module
    docstring); returns ``(dataset folder, transitions, episode returns)``. A failed run leaves no dataset.

    ``transitions`` instead of ``episodes``: whole episodes until at least that many transitions are recorded.
    ``env_id``: the env the entry's run was told to train in (``--set env.env_id=...``), when not the entry's
    default. ``metadata``: more keys for the dataset's metadata (:class:`~conveyor.data.DatasetWriter`)."""
    from easydict import EasyDict

    from conveyor.data import DatasetWriter
    from conveyor.envs import make_env_manager
    from conveyor.middleware import EpisodeCollector, episode_recorder, load_checkpoint, restore
    from conveyor.zoo import load_entry
    from conveyor.zoo.run import seed_everything

    if (episodes is None) == (transitions is None):
        raise CollectError("give the number of episodes (--episodes) or of transitions, not both or neither")
    if episodes is not None and (not isinstance(episodes, int) or episodes <= 0):
        raise CollectError(f"--episodes must be an int > 0, got {episodes!r}")
    if transitions is not None and (not isinstance(transitions, int) or transitions <= 0):
        raise CollectError(f"the number of transitions must be an int > 0, got {transitions!r}")
    if not np.isfinite(noise) or noise < 0:
        raise CollectError(f"--noise must be a number >= 0, got {noise!r}")
    entry = load_entry(entry_name)
    ckpt = Path(ckpt)
    cls = _policy_class(load_checkpoint(ckpt), ckpt)
    cfg = _run_config(entry, entry_name, cls, ckpt, env_id)
    seed = cfg.seed if seed is None else seed
    seed_everything(seed)  # and one torch thread: a second one only slows small networks down
    policy = cls(cfg.policy, seed=seed)
    try:
        restore(ckpt, policy)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CollectError(f"{ckpt}: its {cls.__name__} weights do not fit entry {entry_name}'s network "
                           f"({' '.join(str(exc).split())[:200]})") from None
    with make_env_manager(cfg.env, "collector", seed=seed) as env:
        if hasattr(env.action_space, "n") and noise > 1:
            raise CollectError(f"--noise is a probability for discrete actions: give a number in [0, 1], got {noise}")
        actor = _NoisyActor(policy.eval_mode, env.action_space, noise, seed)
        amount = f"{episodes} episodes" if episodes is not None else f"{transitions} transitions (whole episodes)"
        writer = DatasetWriter(dataset_id, env.observation_space, env.action_space, root=dataset_dir, overwrite=overwrite,
                               env_id=cfg.env.env_id, algorithm_name=f"{cls.__name__} ({entry_name}), noise {noise}",
                               description=f"{amount} of {ckpt} on {cfg.env.env_id}, noise {noise}, seed {seed}",
                               metadata=metadata)
        try:
            _record(EpisodeCollector(EasyDict(seed=seed, policy=dict(collect=dict(n_episode=1))), actor, env),
                    episode_recorder(writer), episodes, transitions, progress)
        except BaseException:
            shutil.rmtree(writer.path, ignore_errors=True)
            raise
        writer.close()
    return writer.path, writer.steps_written, np.asarray(writer.episode_returns)


def _record(collector: Any, recorder: Any, episodes: Optional[int], transitions: Optional[int],
            progress: bool) -> None:
    """Run collector and recorder for ``episodes`` iterations (one episode each), or until the recorder's writer
    holds ``transitions`` transitions, with a progress bar if asked."""
    from tqdm import tqdm

    from conveyor.engine import OnlineRLContext, task
    writer = recorder.writer
    total, unit = (episodes, "episode") if episodes is not None else (transitions, "transition")

    def count(ctx: Any) -> None:
        done = len(writer.episode_returns) if episodes is not None else writer.steps_added
        bar.update(done - bar.n)
        if done >= total:
            task.finish = True

    with tqdm(total=total, unit=unit, disable=not progress, file=sys.stdout) as bar:
        with task.start(ctx=OnlineRLContext()):
            task.use(collector)
            task.use(recorder)
            task.use(count)
            task.run()
