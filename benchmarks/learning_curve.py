"""Learning curve of a zoo entry over a fixed env-step budget: evaluation return against env steps, per seed.

Each seed trains the entry from scratch for ``--max-env-step`` env steps (no early stop), evaluating the
deterministic policy on ``--eval-episodes`` episodes every ``--eval-every`` env steps and once more at
the end of the budget. The returns are read back from the run's TensorBoard log (``eval/return``), drawn
into a PNG (mean over seeds, each seed faint) and written as JSON beside it. Beside the evaluations,
``final_train_returns`` gives per seed the mean return of the last 20 training episodes (full games on Atari:
the collectors' ``EPISODE_EVENT``). ``--set KEY=VALUE`` changes the entry's config as ``conveyor train --set``.

    python -m benchmarks.learning_curve lunarlander_continuous/sac --seeds 3 --max-env-step 100000
    python -m benchmarks.learning_curve pendulum/sac --quick        # 1 seed, 4000 env steps, no figure
    python -m benchmarks.learning_curve pendulum/sac --set env.env_id=HalfCheetah-v5 --max-env-step 100000
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List

from benchmarks._harness import ROOT, TRAIN_EPISODES, print_json_line, scratch_dir
from benchmarks._training import run_seed
from conveyor.zoo import load_entry


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

    with scratch_dir():  # runs/ of each seed lands in a scratch folder
        runs = [run_seed(entry, seed, budget, eval_every, args.eval_episodes, args.overrides)
                for seed in range(args.first_seed, args.first_seed + seeds)]

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
    print_json_line(summary)


if __name__ == "__main__":
    main()
