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
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from benchmarks._harness import (add_worker_option, alternate, print_json_line, run_worker, scratch_dir,
                                 tensorboard_scalars, worker_done)

ENTRY = "atari/impala"
SIDES = ("1", "2")  # collector processes
QUICK_ENV_STEPS = 100
"""The smoke run's agent steps a run: the quick learner logs at its first gradient step and every 10 after, and the
figure needs 3 points. With the quick config the learner took 0.4 gradient steps an agent step in every run
measured (1 and 2 collectors, 100 to 1,200 steps, load 2-15: 8 per 20-step unroll); 100 agent steps ran 6 unrolls,
48 gradient steps, 5 points (gradient steps 1, 11, 21, 31, 41), two to spare. 150 took 111 s a run at load 15, and
the 2-collector run did not end within the test's 240 s."""
QUICK_LOG_FREQ = 10


def config(quick: bool) -> Any:
    """The entry's config with evaluation reduced to the learner's opening game on one env; ``quick``: 2 envs,
    unrolls of 10 steps and a gradient step per unroll, logged every 10 gradient steps, so that the learner logs
    its points within a hundred agent steps."""
    from conveyor.zoo import load_entry

    cfg = copy.deepcopy(load_entry(ENTRY).main_config)
    cfg.exp_name = "impala_throughput"
    cfg.env.update(evaluator_env_num=1, n_evaluator_episode=1)
    cfg.policy.eval.evaluator.eval_freq = 10**9  # the learner evaluates (no evaluator nodes): once, at the start
    cfg.policy.eval.evaluator.pop("eval_env_step_freq", None)
    if quick:
        cfg.env.collector_env_num = 2
        cfg.policy.collect.n_sample = 2 * 10
        cfg.policy.learn.batch_size = 1
        cfg.policy.learn.log_freq = QUICK_LOG_FREQ
    return cfg


def measure(collectors: int, env_steps: int, quick: bool, seed: int) -> Dict[str, Any]:
    """Train the entry with ``collectors`` collector processes for ``env_steps`` agent steps; the figures above."""
    from conveyor.run import train_distributed
    from conveyor.zoo import load_entry

    cfg = config(quick)
    with scratch_dir():
        start = time.time()
        run = train_distributed(load_entry(ENTRY), collectors=collectors, cfg=cfg, seed=seed, max_env_step=env_steps,
                                progress=False, no_stop=True)
        end = time.time()
        scalars = tensorboard_scalars(Path("runs") / cfg.exp_name / "tb")
    points = scalars.get("charts/env_steps_per_s", [])
    if len(points) < 3:
        raise RuntimeError(f"the learner logged {len(points)} env_steps_per_s points in {env_steps} agent steps, "
                           f"3 are needed: give more --env-steps (it logs every {cfg.policy.learn.log_freq} gradient "
                           f"steps)")
    (s0, _, t0), (s1, _, t1) = points[1], points[-1]
    nodes = [n for n in run.nodes if n["role"] == "collector"]
    first = min(n["first_step_at"] for n in nodes if n["first_step_at"] is not None)
    lags = [value for _, value, _ in scalars.get("charts/policy_lag", [])]
    lag_max = [value for _, value, _ in scalars.get("charts/policy_lag_max", [])]
    return {"collectors": collectors, "steps_per_s": (s1 - s0) / (t1 - t0), "window": [s0, s1],
            "collected_steps_per_s": sum(n["collected"] for n in nodes) / (end - first),
            "policy_lag": statistics.fmean(lags) if lags else None, "policy_lag_max": max(lag_max, default=None),
            "env_step": run.env_step, "train_iter": run.train_iter, "wall_s": end - start}


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
