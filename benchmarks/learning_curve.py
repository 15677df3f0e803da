"""Learning curve of a zoo entry over a fixed env-step budget: evaluation return against env steps, per seed.

Each seed trains the entry from scratch for ``--max-env-step`` env steps (no early stop), evaluating the
deterministic policy on ``--eval-episodes`` episodes every ``--eval-every`` env steps and once more at
the end of the budget. The returns are read back from the run's TensorBoard log (``eval/return``), drawn
into a PNG (mean over seeds, each seed faint) and written as JSON beside it. Beside the evaluations,
``final_train_returns`` gives per seed the mean return of the last 20 training episodes (full games on Atari:
the collectors' ``EPISODE_EVENT``). ``--set KEY=VALUE`` changes the entry's config as ``conveyor train --set``.

    python benchmarks/learning_curve.py lunarlander_continuous/sac --seeds 3 --max-env-step 100000
    python benchmarks/learning_curve.py pendulum/sac --quick        # 1 seed, 4000 env steps, no figure
    python benchmarks/learning_curve.py pendulum/sac --set env.env_id=HalfCheetah-v5 --max-env-step 100000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from _peers import TRAIN_EPISODES, final_train_return, tensorboard_events
from conveyor.config import apply_overrides
from conveyor.engine import task
from conveyor.middleware import EPISODE_EVENT
from conveyor.zoo import load_entry

ROOT = Path(__file__).resolve().parent.parent


def read_scalars(logdir: Path, tag: str) -> List[Tuple[int, float]]:
    """``(step, value)`` of every ``tag`` scalar in the TensorBoard event files under ``logdir``, by step."""
    return [(step, value) for step, value, _ in tensorboard_events(logdir, tag)]


def run_seed(entry, seed: int, max_env_step: int, eval_every: int, n_episode: int,
             overrides: Sequence[str] = ()) -> Dict:
    cfg = apply_overrides(entry.main_config, overrides)  # typed like `conveyor train --set`; main() validates
    cfg.seed = seed
    cfg.exp_name = f"curve_seed{seed}"
    cfg.env.stop_value = None  # spend the whole budget
    cfg.env.n_evaluator_episode = n_episode
    cfg.policy.setdefault("eval", {}).setdefault("evaluator", {})
    cfg.policy.eval.evaluator.eval_freq = 10**9  # evaluate by env steps only
    cfg.policy.eval.evaluator.eval_env_step_freq = eval_every
    train_returns: List[float] = []  # every finished training episode (a full game on Atari), in order
    task.on(EPISODE_EVENT, lambda env_index, ret, length: train_returns.append(ret))  # dropped when the run ends
    start = time.perf_counter()
    # One env step past the budget: the iteration that starts at the budget evaluates before it stops.
    ctx = entry.main(cfg, max_env_step=max_env_step + 1, progress=False)
    wall = time.perf_counter() - start
    points = read_scalars(Path("runs") / cfg.exp_name / "tb", "eval/return")
    return {"seed": seed, "env_steps": [s for s, _ in points], "returns": [r for _, r in points],
            "final_return": points[-1][1], "final_train_return": final_train_return(train_returns),
            "train_episodes": len(train_returns), "wall_s": round(wall, 1), "train_iter": ctx.train_iter}


def plot(entry_name: str, runs: List[Dict], max_env_step: int, n_episode: int, out: Path,
         stop_value: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for run in runs:
        ax.plot(run["env_steps"], run["returns"], color="tab:blue", alpha=0.3, linewidth=1,
                label="one seed" if run is runs[0] else None)
    length = min(len(run["returns"]) for run in runs)
    steps = runs[0]["env_steps"][:length]
    mean = [statistics.fmean(run["returns"][i] for run in runs) for i in range(length)]
    ax.plot(steps, mean, color="tab:blue", linewidth=2.2, label=f"mean of {len(runs)} seeds")
    if stop_value is not None:
        ax.axhline(stop_value, color="gray", linestyle="--", linewidth=1, label=f"solved ({stop_value:g})")
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"eval return (mean of {n_episode} episodes)")
    ax.set_title(f"{entry_name}: {max_env_step:,} env steps")
    ax.set_xlim(0, max_env_step * 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entry", nargs="?", default="lunarlander_continuous/sac", help="zoo entry")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run are first-seed, first-seed + 1, ...")
    parser.add_argument("--max-env-step", type=int, default=100_000)
    parser.add_argument("--eval-every", type=int, default=5000, help="env steps between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG path (default docs/<env>_<algo>_curve.png; the JSON goes beside it)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value as `conveyor train --set` does (repeatable)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 4000 env steps, no figure written")
    args = parser.parse_args()
    entry = load_entry(args.entry)
    seeds = 1 if args.quick else args.seeds
    budget = 4000 if args.quick else args.max_env_step
    eval_every = 2000 if args.quick else args.eval_every
    out = args.out or ROOT / "docs" / f"{args.entry.replace('/', '_')}_curve.png"

    runs = []
    with tempfile.TemporaryDirectory() as workdir:
        cwd = os.getcwd()
        os.chdir(workdir)  # runs/ of each seed lands in a scratch folder
        try:
            for seed in range(args.first_seed, args.first_seed + seeds):
                runs.append(run_seed(entry, seed, budget, eval_every, args.eval_episodes, args.overrides))
        finally:
            os.chdir(cwd)

    print(f"{args.entry}: eval return (mean of {args.eval_episodes} episodes) over {budget} env steps")
    steps = runs[0]["env_steps"]
    print(f"{'env step':>9}" + "".join(f"{'seed ' + str(r['seed']):>10}" for r in runs))
    for i, step in enumerate(steps):
        print(f"{step:>9}" + "".join(f"{r['returns'][i]:>10.1f}" if i < len(r["returns"]) else f"{'':>10}"
                                     for r in runs))
    finals = [r["final_return"] for r in runs]
    train_finals = [None if r["final_train_return"] is None else round(r["final_train_return"], 1) for r in runs]
    summary = {"entry": args.entry, "overrides": args.overrides, "seeds": seeds, "max_env_step": budget,
               "eval_every": eval_every, "eval_episodes": args.eval_episodes,
               "final_returns": [round(f, 1) for f in finals], "mean_final_return": round(statistics.fmean(finals), 1),
               "final_train_returns": train_finals, "train_episodes": [r["train_episodes"] for r in runs],
               "wall_s": [r["wall_s"] for r in runs], "figure": None}
    if not args.quick:
        plot(args.entry, runs, budget, args.eval_episodes, out, entry.main_config.env.get("stop_value"))
        out.with_suffix(".json").write_text(json.dumps({**summary, "runs": runs}, indent=1) + "\n")
        summary["figure"] = str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out)
    print(f"final returns {summary['final_returns']}, mean {summary['mean_final_return']}; mean of the last "
          f"{TRAIN_EPISODES} training episodes {train_finals}; wall {summary['wall_s']} s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
