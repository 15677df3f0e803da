"""Env steps and wall seconds a zoo entry takes to solve its env, over several seeds.

Each seed trains the entry from scratch, evaluating every ``--eval-every`` env steps on 10 episodes
(evaluation time counts), until the mean return reaches ``--stop-value`` or ``--max-env-step`` runs out.

    python -m benchmarks.solve cartpole/dqn --seeds 5
    python -m benchmarks.solve cartpole/dqn --quick        # 2 seeds, smaller budget
    python -m benchmarks.solve cartpole/dqn --seeds 10 --first-seed 10 --set policy.learn.learning_rate=2e-3
    python -m benchmarks.solve cartpole/dqn --distributed 1,2,1 --seeds 3

``--distributed 1,C,E`` trains each seed twice, in one process and as 1 learner, C collector and E evaluator
processes (their start-up counts); the figures are the distributed runs', plus ``single_median_wall_s`` and
``wall_ratio`` (distributed median wall / single-process median wall), ``startup_s`` (median over the seeds
of the start-up: from the call that starts the processes to the first collected step of the last collector
to take one; ``startup_s_per_seed`` lists them) and ``wall_ratio_after_startup`` (the median of distributed
wall minus start-up / single-process median wall; the single-process runs, whose imports are done before
the timer, are counted whole).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from typing import Optional, Tuple

from benchmarks._harness import print_json_line
from conveyor.config import ConfigError, apply_overrides
from conveyor.zoo import load_entry
from conveyor.run import train_distributed


def solve_once(entry, seed: int, stop_value: float, max_env_step: int, eval_every: int, n_episode: int,
               async_mode: bool = False, overrides: tuple = (), distributed: Optional[Tuple[int, int]] = None) -> dict:
    cfg = apply_overrides(entry.main_config, overrides)  # typed like `conveyor train --set`; main() validates
    cfg.seed = seed
    cfg.exp_name = f"solve_seed{seed}"
    cfg.env.stop_value = stop_value
    cfg.env.n_evaluator_episode = n_episode
    cfg.policy.setdefault("eval", {}).setdefault("evaluator", {})
    cfg.policy.eval.evaluator.eval_freq = 10**9  # evaluate by env steps only
    cfg.policy.eval.evaluator.eval_env_step_freq = eval_every
    start, started_at = time.perf_counter(), time.time()
    startup = None
    if distributed is None:
        ctx = entry.main(cfg, max_env_step=max_env_step, progress=False, async_mode=async_mode)
    else:
        cfg.exp_name += "_distributed"
        name = entry.__name__.removeprefix("conveyor.zoo.").replace(".", "/")
        ctx = train_distributed(load_entry(name), collectors=distributed[0], evaluators=distributed[1], cfg=cfg,
                                max_env_step=max_env_step, progress=False)
        firsts = [n["first_step_at"] for n in ctx.nodes if n["role"] == "collector"]
        startup = None if None in firsts else max(firsts) - started_at
    wall = time.perf_counter() - start
    solved = ctx.last_eval_value is not None and ctx.last_eval_value >= stop_value
    return {"seed": seed, "solved": solved, "env_steps": ctx.env_step, "wall_s": wall,
            "last_eval": ctx.last_eval_value, "startup_s": startup}


def parse_layout(text: str) -> Tuple[int, int]:
    """``(collectors, evaluators)`` of ``--distributed 1,C,E``."""
    try:
        learners, collectors, evaluators = (int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--distributed expects 1,C,E (learners, collectors, evaluators), got {text!r}") from None
    if learners != 1 or collectors < 1 or evaluators < 0:
        raise SystemExit(f"--distributed {text}: one learner, at least one collector, any number of evaluators "
                         f"(with none the learner evaluates)")
    return collectors, evaluators


def warm_up_imports() -> None:
    """Do one-off imports before any timer starts: torch loads torch._dynamo lazily on a process's first
    optimizer step (about 1.5 s here), which is process start-up, not training time."""
    import torch._dynamo  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entry", help="zoo entry, e.g. cartpole/dqn")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from this one up")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. policy.learn.learning_rate=2e-3 (repeatable)")
    parser.add_argument("--stop-value", type=float, default=None, help="default: the entry's env.stop_value")
    parser.add_argument("--max-env-step", type=int, default=100_000)
    parser.add_argument("--eval-every", type=int, default=2000, help="env steps between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 seeds and a quarter of the budget")
    parser.add_argument("--async", dest="async_mode", action="store_true",
                        help="run the pipeline in async mode (collection and evaluation overlap training)")
    parser.add_argument("--distributed", default=None, metavar="1,C,E",
                        help="also train each seed as 1 learner, C collectors and E >= 1 evaluators (processes)")
    args = parser.parse_args()
    distributed = parse_layout(args.distributed) if args.distributed else None
    entry = load_entry(args.entry)
    stop_value = args.stop_value if args.stop_value is not None else entry.main_config.env.stop_value
    seeds = 2 if args.quick else args.seeds
    budget = args.max_env_step // 4 if args.quick else args.max_env_step

    warm_up_imports()
    results, singles = [], []
    with tempfile.TemporaryDirectory() as workdir:
        cwd = os.getcwd()
        os.chdir(workdir)  # runs/ of each seed lands in a scratch folder
        try:
            for seed in range(args.first_seed, args.first_seed + seeds):
                run = (entry, seed, stop_value, budget, args.eval_every, args.eval_episodes, args.async_mode,
                       tuple(args.overrides))
                if distributed is not None:
                    singles.append(solve_once(*run))
                results.append(solve_once(*run, distributed=distributed))
        except ConfigError as exc:  # a bad --set: the entry's validation names the key and the fix
            parser.error(str(exc))
        finally:
            os.chdir(cwd)

    mode = f"distributed {args.distributed}" if distributed else "async" if args.async_mode else "sync"
    changed = f"; with {', '.join(args.overrides)}" if args.overrides else ""
    print(f"{args.entry} ({mode}{changed}): mean of {args.eval_episodes} eval episodes >= {stop_value} "
          f"within {budget} env steps")
    print(f"{'seed':>5}{'solved':>8}{'env steps':>11}{'wall s':>9}{'last eval':>11}"
          + (f"{'start-up s':>12}" if distributed else ""))
    for r in results:
        print(f"{r['seed']:>5}{str(r['solved']):>8}{r['env_steps']:>11}{r['wall_s']:>9.1f}{r['last_eval']:>11.1f}"
              + (f"{r['startup_s'] if r['startup_s'] is None else round(r['startup_s'], 2):>12}" if distributed else ""))
    env_steps = [r["env_steps"] for r in results]
    walls = [round(r["wall_s"], 2) for r in results]
    summary = {"entry": args.entry, "seeds": seeds, "first_seed": args.first_seed, "overrides": args.overrides, "solved_seeds": sum(r["solved"] for r in results),
               "env_steps": env_steps, "wall_s": walls, "median_env_steps": statistics.median(env_steps),
               "median_wall_s": round(statistics.median(walls), 2)}
    if distributed is not None:
        single_walls = [round(r["wall_s"], 2) for r in singles]
        single = round(statistics.median(single_walls), 2)
        startups = [r["startup_s"] for r in results]
        known = [s for s in startups if s is not None]  # None: a collector that collected nothing
        startup = round(statistics.median(known), 2) if known else None
        after = [r["wall_s"] - r["startup_s"] for r in results if r["startup_s"] is not None]
        summary.update(single_solved_seeds=sum(r["solved"] for r in singles), single_wall_s=single_walls,
                       single_env_steps=[r["env_steps"] for r in singles],
                       single_median_wall_s=single, wall_ratio=round(summary["median_wall_s"] / single, 3),
                       startup_s=startup, startup_s_per_seed=[None if s is None else round(s, 2) for s in startups],
                       wall_ratio_after_startup=round(statistics.median(after) / single, 3) if after else None)
        print(f"one process: solved {summary['single_solved_seeds']}/{seeds}, median {single} s; distributed / "
              f"single median wall: {summary['wall_ratio']} (bar <= 1.25)")
        print(f"distributed start-up (call to every collector's first collected step): median {startup} s (bar <= 3); "
              f"after it, distributed / single median wall: {summary['wall_ratio_after_startup']} (bar <= 1.25)")
    print(f"solved {summary['solved_seeds']}/{seeds}; median {summary['median_env_steps']} env steps, "
          f"{summary['median_wall_s']} s")
    print_json_line(summary)


if __name__ == "__main__":
    main()
