"""What the learning benchmarks share: a zoo entry trained from scratch over a fixed env-step budget (its
evaluations and the mean of its last training episodes), atari/ppo trained that way, and two sides compared seed
by seed, each run in a fresh interpreter but in a smoke run (``learning_curve``, ``atari_learning``,
``impala_learning``)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks._harness import add_worker_option, final_train_return, run_worker, scratch_dir, tensorboard_events

ATARI_PPO = "atari/ppo"
"""The entry both Atari learning comparisons train as PPO, as it ships."""


def read_scalars(logdir: Path, tag: str) -> List[Tuple[int, float]]:
    """``(step, value)`` of every ``tag`` scalar in the TensorBoard event files under ``logdir``, by step."""
    return [(step, value) for step, value, _ in tensorboard_events(logdir, tag)]


def run_seed(entry: Any, seed: int, max_env_step: int, eval_every: int, n_episode: int,
             overrides: Sequence[str] = ()) -> Dict:
    """Train ``entry`` (a loaded zoo entry) for ``max_env_step`` env steps with no early stop, evaluating every
    ``eval_every`` env steps and at the end; its evaluation returns and the mean of its last training episodes."""
    from conveyor.config import apply_overrides
    from conveyor.engine import task
    from conveyor.middleware import EPISODE_EVENT

    cfg = apply_overrides(entry.main_config, overrides)  # typed like `conveyor train --set`; main() validates
    cfg.seed = seed
    cfg.exp_name = f"curve_seed{seed}"
    cfg.env.stop_value = None  # spend the whole budget
    cfg.env.n_evaluator_episode = n_episode
    cfg.policy.setdefault("eval", {}).setdefault("evaluator", {})
    cfg.policy.eval.evaluator.eval_freq = 10**9  # evaluate by env steps only
    cfg.policy.eval.evaluator.eval_env_step_freq = eval_every
    train_returns: List[float] = []  # every finished training episode (a full game on Atari), in order
    # A team's episode also carries each agent's return; ``ret`` is the team's. Dropped when the run ends.
    task.on(EPISODE_EVENT, lambda env_index, ret, length, *agent_returns: train_returns.append(ret))
    start = time.perf_counter()
    # One env step past the budget: the iteration that starts at the budget evaluates before it stops.
    ctx = entry.main(cfg, max_env_step=max_env_step + 1, progress=False)
    wall = time.perf_counter() - start
    points = read_scalars(Path("runs") / cfg.exp_name / "tb", "eval/return")
    return {"seed": seed, "env_steps": [s for s, _ in points], "returns": [r for _, r in points],
            "final_return": points[-1][1], "final_train_return": final_train_return(train_returns),
            "train_episodes": len(train_returns), "wall_s": round(wall, 1), "train_iter": ctx.train_iter,
            "env_step": ctx.env_step}


def atari_ppo(seed: int, budget: int, overrides: List[str]) -> Dict[str, Any]:
    """:data:`ATARI_PPO` for ``budget`` agent steps on one torch thread; the mean of its last full-game training
    episodes."""
    import torch

    from conveyor.config import apply_overrides
    from conveyor.zoo import load_entry

    torch.set_num_threads(1)
    entry = load_entry(ATARI_PPO)
    n_episode = apply_overrides(entry.main_config, overrides).env.evaluator_env_num  # a game per eval env
    with scratch_dir():
        run = run_seed(entry, seed, budget, eval_every=budget, n_episode=n_episode, overrides=overrides)
    return {"side": "ours", "seed": seed, "final_train_return": run["final_train_return"],
            "train_episodes": run["train_episodes"], "wall_s": run["wall_s"]}


def add_seed_options(parser: argparse.ArgumentParser, sides: Sequence[str], *, changes: str, quick: str) -> None:
    """The options of a comparison over seeds: how many, the first, the agent-step budget, ``--set`` (``changes``:
    its help), ``--quick`` (``quick``: its help), and (hidden) the side and seed a worker trains."""
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=1, help="seeds run are first-seed, first-seed + 1, ...")
    parser.add_argument("--max-env-step", type=int, default=250_000, help="agent steps per run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=changes)
    parser.add_argument("--quick", action="store_true", help=quick)
    add_worker_option(parser, sides)
    parser.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)


def seeds_run(args: argparse.Namespace) -> List[int]:
    """The seeds a comparison trains: ``--seeds`` of them from ``--first-seed`` on, one with ``--quick``."""
    return list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds)))


def per_seed(sides: List[str], selected: List[str], seeds: List[int], extra: List[str],
             here: Optional[Callable[[str, int], Dict[str, Any]]] = None) -> Dict[str, List[Dict[str, Any]]]:
    """The rows of every side by seed: each ``selected`` side trained in a fresh interpreter (this script's
    ``--worker SIDE --seed N EXTRA``), or by ``here(side, seed)`` in this process where given (a smoke run), one
    run after another; a side left out gets rows with no figures."""
    def train(side: str, seed: int) -> Dict[str, Any]:
        return here(side, seed) if here is not None else run_worker(side, ["--seed", str(seed), *extra],
                                                                    timeout=6 * 3600)

    return {side: [train(side, seed) if side in selected
                   else {"seed": seed, "final_train_return": None, "wall_s": None}
                   for seed in seeds] for side in sides}


def print_pairs(rows: Dict[str, List[Dict[str, Any]]], first: str, second: str, labels: tuple) -> None:
    """A table of two sides' final training returns and walls, a line per seed; ``labels``: their names."""
    def cell(value: Any, width: int) -> str:
        return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"

    walls = [f"{label} wall s" for label in labels]
    print(f"{'seed':>5} {labels[0]:>9} {labels[1]:>9} {walls[0]:>{len(walls[0]) + 1}} {walls[1]:>{len(walls[1]) + 1}}")
    for a, b in zip(rows[first], rows[second]):
        print(f"{a['seed']:>5} {cell(a['final_train_return'], 9)} {cell(b['final_train_return'], 9)} "
              f"{cell(a['wall_s'], len(walls[0]) + 1)} {cell(b['wall_s'], len(walls[1]) + 1)}")
