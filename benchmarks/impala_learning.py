"""IMPALA against PPO on Breakout over the same agent-step budget: what each has learned, and in what wall time.

Per seed, one after the other on this machine, each in a fresh interpreter (``--quick``: this one), no early stop,
one evaluation at the end of the budget:

- IMPALA: the ``atari/impala`` entry as it ships, distributed with ``--collectors`` collector processes (2 by
  default) and no evaluator node; its learner records every full-game training episode the collectors report
  (``benchmarks/_impala_episodes_entry.py``);
- PPO: the ``atari/ppo`` entry as it ships, in one process (``benchmarks.atari_learning``'s "ours" side).

The figures are the mean return of the last 20 full-game training episodes (unclipped) and the wall time of the
run, start-up included. The issue's bar: IMPALA at or above PPO on the same seeds, in less wall time. Ends with one
JSON line: ``impala_final_train_returns``, ``ppo_final_train_returns``, ``impala_wall_s``, ``ppo_wall_s``,
``seeds_at_or_above``, ``seeds_faster``. ``--no-ppo`` runs IMPALA alone (to compare with PPO runs taken before).

    python -m benchmarks.impala_learning --seeds 3 --first-seed 1      # 250k agent steps a run: hours on CPU
    python -m benchmarks.impala_learning --quick            # IMPALA only, 1 seed, 2 envs a collector, 400 agent steps
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from benchmarks._harness import TRAIN_EPISODES, final_train_return, print_json_line, scratch_dir, worker_done
from benchmarks._training import add_seed_options, atari_ppo, per_seed, print_pairs, seeds_run

HERE = Path(__file__).resolve().parent
QUICK_SETS = ["env.collector_env_num=2", "policy.collect.n_sample=40", "env.evaluator_env_num=1",
              "env.n_evaluator_episode=1"]
"""The smoke run's config: 2 envs a collector process (unrolls of 2 x 20 steps) and one game evaluated on one env:
the same distributed pipeline with 5 ALE envs to start instead of 24 and 1 evaluation game instead of 8."""
QUICK_BUDGET = 400
"""The smoke run's agent steps: a few gradient steps and about two full games."""


def impala(seed: int, budget: int, collectors: int, overrides: List[str]) -> Dict[str, Any]:
    """atari/impala, distributed, for ``budget`` agent steps; the mean of its last full-game training episodes."""
    from conveyor.config import apply_overrides
    from conveyor.zoo import load_entry
    from conveyor.run import train_distributed

    entry_file = str(HERE / "_impala_episodes_entry.py")
    cfg = apply_overrides(load_entry(entry_file).main_config, overrides)
    cfg.seed = seed
    cfg.env.stop_value = None  # spend the whole budget
    cfg.policy.eval.evaluator.eval_freq = 10**9  # one evaluation, at the end of the budget (as the PPO side)
    cfg.policy.eval.evaluator.eval_env_step_freq = budget
    with scratch_dir() as workdir:
        os.environ["IMPALA_LEARNING_EPISODES"] = str(workdir / "episodes.txt")
        start = time.perf_counter()
        run = train_distributed(load_entry(entry_file), collectors=collectors, cfg=cfg, exp_name=f"impala_seed{seed}",
                                max_env_step=budget + 1, progress=False)
        wall = time.perf_counter() - start
        path = workdir / "episodes.txt"
        returns = [float(line) for line in path.read_text().split()] if path.exists() else []
    return {"side": "impala", "seed": seed, "final_train_return": final_train_return(returns),
            "train_episodes": len(returns), "wall_s": round(wall, 1), "env_step": run.env_step,
            "train_iter": run.train_iter}


def ppo(seed: int, budget: int, collectors: int, overrides: List[str]) -> Dict[str, Any]:
    """atari/ppo in one process, as ``benchmarks.atari_learning`` trains it."""
    return {**atari_ppo(seed, budget, overrides), "side": "ppo"}


SIDES = {"impala": impala, "ppo": ppo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_options(parser, SIDES, changes="change atari/impala's config, as `conveyor train --set`",
                     quick=f"IMPALA only, 1 seed, {QUICK_BUDGET} agent steps, with --set {' '.join(QUICK_SETS)}")
    parser.add_argument("--collectors", type=int, default=2, help="IMPALA's collector processes")
    parser.add_argument("--no-ppo", action="store_true", help="IMPALA only (ppo_* keys are null)")
    args = parser.parse_args()
    budget = QUICK_BUDGET if args.quick else args.max_env_step
    if worker_done(args, lambda side: SIDES[side](args.seed, budget, args.collectors,
                                                  args.overrides if side == "impala" else [])):
        return
    overrides = [*QUICK_SETS, *args.overrides] if args.quick else args.overrides
    sides = ["impala"] if args.quick or args.no_ppo else list(SIDES)
    seeds = seeds_run(args)
    extra = ["--max-env-step", str(budget), "--collectors", str(args.collectors),
             *(word for pair in overrides for word in ("--set", pair))]
    here = (lambda side, seed: SIDES[side](seed, budget, args.collectors, overrides if side == "impala" else [])) \
        if args.quick else None  # in this process
    rows = per_seed(list(SIDES), sides, seeds, extra, here)
    print(f"Breakout, {budget} agent steps: mean return of the last {TRAIN_EPISODES} full-game training episodes, "
          f"atari/impala with {args.collectors} collectors against atari/ppo in one process")
    print_pairs(rows, "impala", "ppo", ("IMPALA", "PPO"))
    finals = {side: [r["final_train_return"] for r in rows[side]] for side in SIDES}
    walls = {side: [r["wall_s"] for r in rows[side]] for side in SIDES}
    pairs = list(zip(rows["impala"], rows["ppo"]))
    summary = {"max_env_step": budget, "seeds": seeds, "collectors": args.collectors, "overrides": overrides,
               "impala_final_train_returns": finals["impala"], "ppo_final_train_returns": finals["ppo"],
               "impala_wall_s": walls["impala"], "ppo_wall_s": walls["ppo"],
               "impala_train_episodes": [r.get("train_episodes") for r in rows["impala"]],
               "seeds_at_or_above": sum(a["final_train_return"] is not None and b["final_train_return"] is not None
                                        and a["final_train_return"] >= b["final_train_return"] for a, b in pairs),
               "seeds_faster": sum(a["wall_s"] is not None and b["wall_s"] is not None and a["wall_s"] < b["wall_s"]
                                   for a, b in pairs)}
    print_json_line(summary)


if __name__ == "__main__":
    sys.exit(main())
