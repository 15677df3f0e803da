"""Collected batches from collector processes to the learner on one host: shared memory against nng (issue 35).

``atari/impala`` on Breakout, 1 learner and 2 collector processes, as ``conveyor train atari/impala --collectors 2``
runs it, once with the config's ``transport: auto`` (on one host each batch's frames go through shared memory, the
nng message carrying only where they are: conveyor/middleware/shared_batches.py) and once with ``transport: nng``
(every batch in its message, as across hosts), alternating, each in a fresh interpreter. The figures are
benchmarks/impala_throughput.py's (benchmarks/_impala_runs.py): the learner's samples/s (env steps of the batches it learns
from, over the window of its TensorBoard points) and the collectors' env steps/s; ``shared_batches`` counts the
batches the learner took through shared memory (each collector's first goes in its message, before any offer).

    python -m benchmarks.trajectory_transport                 # 40,000 agent steps a run, 2 rounds
    python -m benchmarks.trajectory_transport --env-steps 20000 --rounds 3
    python -m benchmarks.trajectory_transport --quick         # impala_throughput's quick config, in this process

Prints a table, then one JSON line: ``learner_steps_ratio`` and ``collected_steps_ratio`` (shm / nng, medians),
each side's medians, and ``shared_batches_shm`` (the smallest count of a shm round: above 0 where it was used).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Dict, List

from benchmarks._harness import add_worker_option, alternate, print_json_line, run_worker, worker_done
from benchmarks._impala_runs import QUICK_ENV_STEPS, measure

SIDES = ("shm", "nng")
TRANSPORT = {"shm": "auto", "nng": "nng"}
COLLECTORS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"impala_throughput's quick config, {QUICK_ENV_STEPS} "
                                                             f"agent steps, one round, in this process")
    parser.add_argument("--env-steps", type=int, default=40_000, help="agent steps per run (default 40,000)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    add_worker_option(parser, SIDES)
    args = parser.parse_args()
    env_steps = QUICK_ENV_STEPS if args.quick else args.env_steps
    rounds = 1 if args.quick else args.rounds
    if worker_done(args, lambda side: measure(COLLECTORS, env_steps, False, args.seed, TRANSPORT[side])):
        return
    flags = ["--env-steps", str(env_steps), "--seed", str(args.seed)]
    results = alternate(SIDES, rounds, lambda side: measure(COLLECTORS, env_steps, True, args.seed, TRANSPORT[side])
                        if args.quick else run_worker(side, flags))
    report(env_steps, rounds, args, results)


def report(env_steps: int, rounds: int, args: argparse.Namespace, results: Dict[str, List[Dict[str, Any]]]) -> None:
    median = {side: {key: statistics.median(r[key] for r in runs) for key in ("steps_per_s", "collected_steps_per_s")}
              for side, runs in results.items()}
    print(f"atari/impala on Breakout, {COLLECTORS} collectors, {env_steps} agent steps a run, {rounds} round(s), seed "
          f"{args.seed}{' (quick)' if args.quick else ''}: medians")
    print(f"{'transport':>9}  {'learner samples/s':>17}  {'env steps/s collected':>21}  {'shared batches':>14}  rounds "
          f"(learner samples/s)")
    for side, figures in median.items():
        print(f"{side:>9}  {figures['steps_per_s']:>17.1f}  {figures['collected_steps_per_s']:>21.1f}  "
              f"{min(r['shared_batches'] for r in results[side]):>14}  "
              + ", ".join(f"{r['steps_per_s']:.1f}" for r in results[side]))
    shm, nng = median["shm"], median["nng"]
    print_json_line({"learner_steps_ratio": shm["steps_per_s"] / nng["steps_per_s"],
                     "collected_steps_ratio": shm["collected_steps_per_s"] / nng["collected_steps_per_s"],
                     "learner_steps_per_s_shm": shm["steps_per_s"], "learner_steps_per_s_nng": nng["steps_per_s"],
                     "collected_steps_per_s_shm": shm["collected_steps_per_s"],
                     "collected_steps_per_s_nng": nng["collected_steps_per_s"],
                     "shared_batches_shm": min(r["shared_batches"] for r in results["shm"]),
                     "shared_batches_nng": max(r["shared_batches"] for r in results["nng"]),
                     "env_steps": env_steps, "rounds": rounds, "seed": args.seed})


if __name__ == "__main__":
    sys.exit(main())
