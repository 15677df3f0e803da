"""``conveyor eval``: evaluate a checkpoint, and optionally record a video of one episode.

    conveyor eval runs/cartpole_dqn [--episodes 10] [--seed 0] [--record episode.gif]
    conveyor eval runs/cartpole_dqn/ckpt/final.pth.tar --record episode.mp4

A run directory is evaluated from its best checkpoint (``ckpt/eval_best.pth.tar``, else ``final``, else
``latest``) with the policy and config it saved in ``config.json``; a checkpoint file uses the
``config.json`` of the run it lies in. Episodes run as the evaluator runs them during training
(:func:`conveyor.middleware.evaluate`), spread over ``env.evaluator_env_num`` envs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List

from conveyor.cli._checkpoint import CHECKPOINTS, load_policy, locate
from conveyor.cli._common import message, number, os_message, usage_error

__all__ = ["register", "run", "CHECKPOINTS", "VIDEO_SUFFIXES"]

VIDEO_SUFFIXES = (".gif", ".mp4")
"""What ``--record`` writes: an animated GIF, or an MP4 (needs imageio-ffmpeg)."""


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``eval`` subcommand."""
    parser = commands.add_parser("eval", help="evaluate a checkpoint (mean, std, min, max return); record a video",
                                 description="Evaluate a run's best checkpoint, or a checkpoint file, on fresh "
                                             "episodes and print the return's mean, std, min and max.")
    parser.add_argument("target", metavar="RUN_DIR|CKPT", help="a run directory (runs/<exp-name>) or a .pth.tar file")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to evaluate (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the evaluation envs (default 0)")
    parser.add_argument("--record", default=None, metavar="OUT.gif|OUT.mp4",
                        help="also play one episode with rendering and write it to this file")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate (and record); returns the exit code."""
    if args.episodes <= 0:
        return usage_error(f"--episodes must be > 0, got {args.episodes}")
    if not 0 <= args.seed < 2**32:
        return usage_error(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.record is not None and Path(args.record).suffix.lower() not in VIDEO_SUFFIXES:
        return usage_error(f"--record {args.record}: the file must end in {' or '.join(VIDEO_SUFFIXES)}")
    from conveyor.envs import EnvCrashedError
    from conveyor.middleware import EvaluationError
    from conveyor.schema import ConfigError
    from conveyor.run import RunDirError

    if args.record is not None:
        from conveyor.cli import _video
        _video.offscreen_gl()  # before mujoco is imported (by the config's env check)
    try:
        ckpt, run_dir = locate(Path(args.target))
        cfg, policy = load_policy(ckpt, run_dir)
        if args.record is not None:
            _video.check_renderer(cfg.env.env_id)
        result = _evaluate(cfg, policy, args.episodes, args.seed, args.progress)
        episodes = f"{args.episodes} episode{'s' * (args.episodes != 1)}"
        print(f"{ckpt} on {cfg.env.env_id}, {episodes} (seed {args.seed}): return mean "
              f"{number(result['mean'])}, std {number(result['std'])}, min {number(min(result['returns']))}, "
              f"max {number(max(result['returns']))}")
        if args.record is not None:
            ret, length = _video.record_episode(cfg, policy, Path(args.record), args.seed)
            print(f"recorded one episode (return {number(ret)}, {length} steps) to {args.record}")
    except (ConfigError, RunDirError, FileNotFoundError, ImportError) as exc:
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    except (EnvCrashedError, EvaluationError) as exc:
        print(f"conveyor: error: {message(exc)}", file=sys.stderr)
        return 1
    return 0


def _evaluate(cfg: Any, policy: Any, episodes: int, seed: int, progress: bool) -> Dict[str, Any]:
    """``episodes`` episodes in rounds of at most ``env.evaluator_env_num`` (one seed per round), with a bar on a
    terminal, else a line every few seconds (:func:`~conveyor.middleware.logger.progress_display`)."""
    import numpy as np

    from conveyor.envs import make_env_manager
    from conveyor.middleware import evaluate
    from conveyor.middleware.logger import progress_display

    env_num = min(episodes, cfg.env.evaluator_env_num)
    returns: List[float] = []
    bar = progress_display(episodes, "eval", "episode") if progress else None
    with make_env_manager(dict(cfg.env, evaluator_env_num=env_num), "evaluator") as env:
        for start in range(0, episodes, env_num):
            count = min(env_num, episodes - start)
            on_step = None if bar is None else (lambda done, start=start: bar.update(start + done - bar.n))
            returns += evaluate(policy.eval_mode, env, count, seed=seed + start * 1000, on_step=on_step)["returns"]
            if bar is not None:
                bar.set_postfix(refresh=False, mean_return=number(float(np.mean(returns))))
    if bar is not None:
        bar.refresh()
        bar.close()
    return {"returns": returns, "mean": float(np.mean(returns)), "std": float(np.std(returns))}
