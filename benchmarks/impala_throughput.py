"""IMPALA on Breakout across processes: learner samples/s and env steps/s with 1 and 2 collectors, and policy lag.

Each configuration trains the ``atari/impala`` zoo entry distributed as ``conveyor train atari/impala --collectors
C`` runs it (1 learner and C collector processes, no evaluator process), in a fresh interpreter (``--quick``: from
this one), with evaluation off after the learner's opening one (with no evaluator nodes the learner evaluates, so
``eval_freq`` is set past the run) and that one played on one env for one game. Figures, per configuration:

- learner samples/s: env steps reaching the learner per second over a window from its second TensorBoard point
  (the learner logs at its first gradient step, then every ``policy.learn.log_freq``, 100: process start-up, the
  opening evaluation and the first 100 steps are excluded) to its last. Every unroll is
  learned from fresh once (and ``learn.replay_ratio`` more times on average from the replay) and fewer than one
  batch waits between the learner's calls, so this is the rate of fresh samples learned from, to within one batch
  over the window; it is ``steps_per_s_C`` in the JSON line.
- env steps/s collected: the collectors' steps over the whole run, from the first collected step to the run's
  end (final checkpoint and shut-down included, so a little below the learner's figure).
- policy lag: the mean of the run's logged ``charts/policy_lag`` (each point the mean over 100 gradient steps of
  how many versions the learner's newest published weights are past those that acted a batch), and the largest
  point of ``charts/policy_lag_max`` (the same mean of each batch's largest lag). ``mean_policy_lag`` in the
  JSON line is the 2-collector run's, the issue's layout.

Configurations alternate over rounds (the machine is shared); the median of each counts. ``ratio`` is the
2-collector figure over the 1-collector one: with 1 learner and 2 collectors on a 2-core machine, three busy
processes share two cores, so expect little above 1 there.

    python -m benchmarks.impala_throughput                        # 40,000 agent steps a run, 1 round
    python -m benchmarks.impala_throughput --env-steps 64000 --rounds 2
    python -m benchmarks.impala_throughput --quick    # 2 envs, 10-step unrolls one a batch, logs every 10, 100 steps
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Dict, List

from benchmarks._harness import add_worker_option, alternate, print_json_line, run_worker, worker_done
from benchmarks._impala_runs import ENTRY, QUICK_ENV_STEPS, QUICK_LOG_FREQ, measure

SIDES = ("1", "2")  # collector processes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 envs, a gradient step per 10-step unroll, "
                                                             f"logged every {QUICK_LOG_FREQ}, {QUICK_ENV_STEPS} agent "
                                                             f"steps")
    parser.add_argument("--env-steps", type=int, default=40_000, help="agent steps per run (default 40,000)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per configuration, alternating")
    parser.add_argument("--seed", type=int, default=0)
    add_worker_option(parser, SIDES)
    args = parser.parse_args()
    env_steps = QUICK_ENV_STEPS if args.quick else args.env_steps
    if worker_done(args, lambda side: measure(int(side), env_steps, args.quick, args.seed)):
        return
    flags = ["--env-steps", str(env_steps), "--seed", str(args.seed), *(["--quick"] if args.quick else [])]
    results = alternate(SIDES, args.rounds, lambda side: measure(int(side), env_steps, True, args.seed)
                        if args.quick else run_worker(side, flags))  # quick: a smoke run, in this process
    report(args, env_steps, results)


def report(args: argparse.Namespace, env_steps: int, results: Dict[str, List[Dict[str, Any]]]) -> None:
    median = {side: {key: statistics.median(r[key] for r in runs if r[key] is not None)
                     if any(r[key] is not None for r in runs) else None
                     for key in ("steps_per_s", "collected_steps_per_s", "policy_lag", "policy_lag_max")}
              for side, runs in results.items()}
    print(f"{ENTRY} on Breakout, {env_steps} agent steps a run, {args.rounds} round(s), seed {args.seed}"
          f"{' (quick)' if args.quick else ''}: medians")
    print(f"{'collectors':>10}  {'learner samples/s':>17}  {'env steps/s collected':>21}  {'policy lag':>10}  "
          f"{'lag max':>7}  rounds (learner samples/s)")
    for side, figures in median.items():
        lag, lag_max = figures["policy_lag"], figures["policy_lag_max"]
        print(f"{side:>10}  {figures['steps_per_s']:>17.1f}  {figures['collected_steps_per_s']:>21.1f}  "
              f"{'-' if lag is None else f'{lag:.2f}':>10}  {'-' if lag_max is None else f'{lag_max:.1f}':>7}  "
              + ", ".join(f"{r['steps_per_s']:.1f}" for r in results[side]))
    one, two = median["1"]["steps_per_s"], median["2"]["steps_per_s"]
    print_json_line({"steps_per_s_1": one, "steps_per_s_2": two, "ratio": two / one,
                     "collected_steps_per_s_1": median["1"]["collected_steps_per_s"],
                     "collected_steps_per_s_2": median["2"]["collected_steps_per_s"],
                     "policy_lag_1": median["1"]["policy_lag"], "mean_policy_lag": median["2"]["policy_lag"],
                     "policy_lag_max_2": median["2"]["policy_lag_max"], "env_steps": env_steps,
                     "rounds": args.rounds, "seed": args.seed})


if __name__ == "__main__":
    sys.exit(main())
