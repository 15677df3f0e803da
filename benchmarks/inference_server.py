"""Env steps/s of a distributed run with N collectors acting through one inference server, against each acting on
its own replica (issue 35 part 2: ``--inference server`` vs ``--inference local``).

Each side trains the same entry (default ``atari/impala``) distributed as ``conveyor train ENTRY --collectors N
--inference SIDE`` runs it, on the same envs, seed and agent steps, in a fresh interpreter (``--quick``: from this
one), with evaluation reduced to the learner's opening episode on one env. Figures, per side:

- env steps/s collected: the collectors' steps from the first collected step to the run's end (``steps_per_s``);
- learner samples/s: env steps reaching the learner per second between its second and last TensorBoard points;
- CPU ms per env step: the CPU time of the whole run (this interpreter and every process it started and reaped,
  ``getrusage``) over the env steps collected. On a shared machine a side with more processes gets more of the
  cores, so env steps/s can favour it; this figure does not.

The sides alternate over rounds (the machine is shared); the median of each counts. The server takes the GPU where
there is one (``cuda`` in the table), else it acts on the CPU beside the collectors. ``ratio``: server / local.

    python -m benchmarks.inference_server                                   # atari/impala, 2 collectors, 1 round
    python -m benchmarks.inference_server --collectors 14 --env-steps 200000 --rounds 2     # a GPU machine
    python -m benchmarks.inference_server --entry cartpole/impala --env-steps 20000 --rounds 3
    python -m benchmarks.inference_server --quick      # cartpole/impala, 2 collectors, 2,048 agent steps, in-process
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from benchmarks._harness import (add_worker_option, alternate, print_json_line, run_worker, scratch_dir,
                                 tensorboard_scalars, worker_done)

SIDES = ("local", "server")
QUICK = {"entry": "cartpole/impala", "env_steps": 2048, "collectors": 2}


def config(entry: str) -> Any:
    """The entry's config with evaluation reduced to the learner's opening episode on one env."""
    from conveyor.zoo import load_entry

    cfg = copy.deepcopy(load_entry(entry).main_config)
    cfg.exp_name = "inference_server"
    cfg.env.update(evaluator_env_num=1, n_evaluator_episode=1)
    cfg.policy.eval.evaluator.eval_freq = 10**9  # the learner evaluates (no evaluator nodes): once, at the start
    cfg.policy.eval.evaluator.pop("eval_env_step_freq", None)
    return cfg


def measure(side: str, entry: str, collectors: int, env_steps: int, seed: int) -> Dict[str, Any]:
    """Train ``entry`` with ``collectors`` collectors acting ``side`` for ``env_steps`` agent steps; the figures."""
    import torch

    from conveyor.run import train_distributed
    from conveyor.zoo import load_entry

    cfg = config(entry)
    cpu = _cpu_s()
    with scratch_dir():
        start = time.time()
        run = train_distributed(load_entry(entry), collectors=collectors, cfg=cfg, seed=seed, max_env_step=env_steps,
                                progress=False, no_stop=True, inference=side)
        end = time.time()
        cpu = _cpu_s() - cpu
        points = tensorboard_scalars(Path("runs") / cfg.exp_name / "tb").get("charts/env_steps_per_s", [])
    nodes = [n for n in run.nodes if n["role"] == "collector"]
    first = min(n["first_step_at"] for n in nodes if n["first_step_at"] is not None)
    learner = None
    if len(points) >= 3:
        (s0, _, t0), (s1, _, t1) = points[1], points[-1]
        learner = (s1 - s0) / (t1 - t0)
    server = [n["device"] for n in run.nodes if n["role"] == "inference"]
    collected = sum(n["collected"] for n in nodes)
    return {"side": side, "steps_per_s": collected / (end - first), "cpu_ms_per_step": 1000 * cpu / collected,
            "learner_steps_per_s": learner, "env_step": run.env_step, "train_iter": run.train_iter,
            "wall_s": end - start, "acts_on": server[0] if server else "cpu (each collector)",
            "cuda": torch.cuda.is_available()}


def _cpu_s() -> float:
    """CPU seconds (user and system) of this process and of its reaped children so far."""
    import resource

    return sum(usage.ru_utime + usage.ru_stime for usage in (resource.getrusage(resource.RUSAGE_SELF),
                                                             resource.getrusage(resource.RUSAGE_CHILDREN)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['entry']}, {QUICK['collectors']} collectors, "
                                                             f"{QUICK['env_steps']} agent steps, in this process")
    parser.add_argument("--entry", default="atari/impala", help="the zoo entry (default atari/impala)")
    parser.add_argument("--collectors", type=int, default=2, help="collector processes (default 2)")
    parser.add_argument("--env-steps", type=int, default=20_000, help="agent steps per run (default 20,000)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per side, alternating")
    parser.add_argument("--seed", type=int, default=0)
    add_worker_option(parser, SIDES)
    args = parser.parse_args()
    if args.quick:
        args.entry, args.env_steps, args.collectors = QUICK["entry"], QUICK["env_steps"], QUICK["collectors"]
    run = (args.entry, args.collectors, args.env_steps, args.seed)
    if worker_done(args, lambda side: measure(side, *run)):
        return
    flags = ["--entry", args.entry, "--collectors", str(args.collectors), "--env-steps", str(args.env_steps),
             "--seed", str(args.seed)]
    results = alternate(SIDES, args.rounds, lambda side: measure(side, *run) if args.quick
                        else run_worker(side, flags, timeout=3600))
    report(args, results)


def report(args: argparse.Namespace, results: Dict[str, List[Dict[str, Any]]]) -> None:
    def median(side: str, key: str) -> Any:
        values = [r[key] for r in results[side] if r[key] is not None]
        return statistics.median(values) if values else None

    print(f"{args.entry}, {args.collectors} collectors, {args.env_steps} agent steps a run, {args.rounds} round(s), "
          f"seed {args.seed}{' (quick)' if args.quick else ''}: medians")
    print(f"{'inference':>9}  {'acts on':>20}  {'env steps/s':>11}  {'CPU ms/step':>11}  {'learner samples/s':>17}  "
          f"rounds (env steps/s)")
    for side in SIDES:
        learner = median(side, "learner_steps_per_s")
        print(f"{side:>9}  {results[side][0]['acts_on']:>20}  {median(side, 'steps_per_s'):>11.1f}  "
              f"{median(side, 'cpu_ms_per_step'):>11.2f}  {'-' if learner is None else f'{learner:.1f}':>17}  "
              + ", ".join(f"{r['steps_per_s']:.1f}" for r in results[side]))
    local, server = median("local", "steps_per_s"), median("server", "steps_per_s")
    cpu_local, cpu_server = median("local", "cpu_ms_per_step"), median("server", "cpu_ms_per_step")
    print(f"ratio (server / local): {server / local:.2f} env steps/s, {cpu_server / cpu_local:.2f} CPU per step")
    print_json_line({"server_steps_per_s": server, "local_steps_per_s": local, "ratio": server / local,
                     "server_cpu_ms_per_step": cpu_server, "local_cpu_ms_per_step": cpu_local,
                     "cpu_ratio": cpu_server / cpu_local,
                     "server_learner_steps_per_s": median("server", "learner_steps_per_s"),
                     "local_learner_steps_per_s": median("local", "learner_steps_per_s"),
                     "server_acts_on": results["server"][0]["acts_on"], "entry": args.entry,
                     "collectors": args.collectors, "env_steps": args.env_steps, "rounds": args.rounds,
                     "seed": args.seed})


if __name__ == "__main__":
    sys.exit(main())
