"""Async pipeline speed-up: sync against async wall time, measured in the same run.

Two modes:

- ``--synthetic``: a collector-like and a learner-like middleware that each hold no GIL (sleeps stand for
  env and GPU work); the ideal ratio for two stages is (C + L) / max(C, L).
- zoo (the default): the zoo's own pipelines (cartpole/dqn, cartpole/ppo, pendulum/sac) at fixed env-step
  budgets, evaluated once at the start and never stopped early, as ``--pairs`` sync/async pairs per entry
  whose median ratio is reported (the machine's speed drifts between runs). The ideal speed-up comes from
  the sync runs' per-middleware times: L is the learner's (``OffPolicyLearner`` / ``multistep_trainer``), C all the
  others'. Bar (issue 7): async is never slower (ratio >= 0.97 on every entry), and where the ideal is
  >= 1.3 it reaches >= 0.8 of it.

    python -m benchmarks.async_pipeline [--quick] [--pairs N] [--async-collector auto|process|thread]
                                        [--entries cartpole/dqn,cartpole/ppo,pendulum/sac]
    python -m benchmarks.async_pipeline --synthetic [--collect-ms 20] [--learn-ms 20] [--steps 100]

``--quick`` (a smoke run) runs a sixteenth of each budget, one pair unless ``--pairs`` says otherwise. The last
line is JSON: ``entries`` maps each entry to its ``sync_s``, ``async_s``, ``speedup``, ``ideal_speedup``,
``of_ideal`` and CPU seconds ``sync_cpu_s`` / ``async_cpu_s`` (medians over the pairs; CPU is what a busy
machine disturbs least); ``min_speedup`` and ``min_of_ideal`` (over entries whose ideal is >= 1.3)
summarise them.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import tempfile
import time
from typing import Dict, Tuple

from benchmarks._harness import print_json_line
from conveyor import OnlineRLContext, task
from conveyor.engine import FINISH_EVENT

BUDGETS = {"cartpole/dqn": 6016, "cartpole/ppo": 16384, "pendulum/sac": 8000}
"""Env steps per run (the issue's figures for cartpole/dqn and pendulum/sac)."""
QUICK_SHARE = 16
"""``--quick`` runs each budget divided by this: every mode and table column, in a few seconds a run."""

_RUN_IDS = itertools.count()  # every run gets a fresh directory

LEARNERS = ("OffPolicyLearner", "MultistepTrainer", "Trainer")


def stage(seconds: float, counter: str):
    """A middleware that spends ``seconds`` in code that releases the GIL (a sleep stands for env/GPU work)."""
    def work(ctx: OnlineRLContext) -> None:
        time.sleep(seconds)
        setattr(ctx, counter, getattr(ctx, counter) + 1)
    work.__name__ = counter
    return work


def synthetic_run(async_mode: bool, collect_s: float, learn_s: float, steps: int) -> float:
    with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
        task.use(stage(collect_s, "env_step"))
        task.use(stage(learn_s, "train_iter"))
        start = time.perf_counter()
        task.run(max_step=steps)
        elapsed = time.perf_counter() - start
        assert task.ctx.env_step == steps and task.ctx.train_iter == steps
    return elapsed


def synthetic(args: argparse.Namespace) -> None:
    steps = 30 if args.quick else args.steps
    collect_s, learn_s = args.collect_ms / 1000, args.learn_ms / 1000
    sync_s = synthetic_run(False, collect_s, learn_s, steps)
    async_s = synthetic_run(True, collect_s, learn_s, steps)
    ideal = (collect_s + learn_s) / max(collect_s, learn_s)
    speedup = sync_s / async_s
    print(f"{'mode':<8}{'iterations':>12}{'wall s':>10}{'per iter ms':>14}")
    for mode, wall in (("sync", sync_s), ("async", async_s)):
        print(f"{mode:<8}{steps:>12}{wall:>10.3f}{wall / steps * 1000:>14.2f}")
    print(f"collector {args.collect_ms} ms, learner {args.learn_ms} ms: speedup {speedup:.2f}x (ideal {ideal:.2f}x)")
    print_json_line({"sync_s": round(sync_s, 4), "async_s": round(async_s, 4), "speedup": round(speedup, 3),
                     "ideal_speedup": round(ideal, 3)})


def zoo_run(name: str, async_mode: bool, budget: int,
            collector: str = "auto") -> Tuple[float, float, Dict[str, float]]:
    """Wall seconds of one fixed-budget run of a zoo entry, its CPU seconds (this process's and its collector
    process's: a measure that a busy machine disturbs far less), and its per-middleware total seconds."""
    from conveyor.zoo import load_entry
    entry = load_entry(name)
    cfg = copy.deepcopy(entry.main_config)
    cfg.exp_name = f"async_bench_{name.replace('/', '_')}_{'async' if async_mode else 'sync'}_{next(_RUN_IDS)}"
    cfg.env.stop_value = float("inf")  # a fixed budget: never stop early
    cfg.env.async_collector = collector
    cfg.policy.setdefault("eval", {}).setdefault("evaluator", {})
    cfg.policy.eval.evaluator.eval_freq = 10**9  # one evaluation, at the start
    times: Dict[str, float] = {}
    task.on(FINISH_EVENT, lambda *_: times.update({k: v["total_s"] for k, v in task.stats().items()}))
    cpu_start, start = _cpu_s(), time.perf_counter()
    ctx = entry.main(cfg, max_env_step=budget, progress=False, async_mode=async_mode)
    wall, cpu = time.perf_counter() - start, _cpu_s() - cpu_start
    assert ctx.env_step >= budget, f"{name} stopped at {ctx.env_step} env steps, before its budget of {budget}"
    return wall, cpu, times


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (a collector process, once closed)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def zoo(args: argparse.Namespace) -> None:
    import torch._dynamo  # noqa: F401  (a one-off lazy import on the first optimizer step; not training time)
    entries = args.entries.split(",")
    rows = {}
    with tempfile.TemporaryDirectory() as workdir:
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            for name in entries:
                budget = BUDGETS.get(name, 8000) // (QUICK_SHARE if args.quick else 1)
                pairs = []
                for k in range(args.pairs):  # sync first, then async first, ...: warm-up and drift hit both
                    runs = {mode: zoo_run(name, mode, budget, args.async_collector)
                            for mode in ((False, True) if k % 2 == 0 else (True, False))}
                    (sync_s, sync_cpu, times), (async_s, async_cpu, _) = runs[False], runs[True]
                    learn = sum(t for mw, t in times.items() if mw.split("#")[0] in LEARNERS)
                    other = sum(times.values()) - learn
                    pairs.append((sync_s, async_s, learn, other, sync_cpu, async_cpu))
                sync_s, async_s, learn, other, sync_cpu, async_cpu = (statistics.median(c) for c in zip(*pairs))
                ideal = (learn + other) / max(learn, other) if max(learn, other) > 0 else 1.0
                speedup = statistics.median(p[0] / p[1] for p in pairs)  # ratios pair by pair: the machine drifts
                rows[name] = {"budget": budget, "pairs": len(pairs), "sync_s": round(sync_s, 3),
                              "async_s": round(async_s, 3), "collect_side_s": round(other, 3),
                              "learn_s": round(learn, 3), "speedup": round(speedup, 3),
                              "pair_speedups": [round(p[0] / p[1], 3) for p in pairs],
                              "sync_cpu_s": round(sync_cpu, 3), "async_cpu_s": round(async_cpu, 3),
                              "ideal_speedup": round(ideal, 3), "of_ideal": round(speedup / ideal, 3)}
        finally:
            os.chdir(cwd)
    print(f"{'entry':<16}{'env steps':>10}{'sync s':>9}{'async s':>9}{'C s':>8}{'L s':>8}{'speedup':>9}{'ideal':>7}"
          f"{'of ideal':>10}{'sync cpu':>10}{'async cpu':>10}")
    for name, r in rows.items():
        print(f"{name:<16}{r['budget']:>10}{r['sync_s']:>9.2f}{r['async_s']:>9.2f}{r['collect_side_s']:>8.2f}"
              f"{r['learn_s']:>8.2f}{r['speedup']:>9.2f}{r['ideal_speedup']:>7.2f}{r['of_ideal']:>10.2f}"
              f"{r['sync_cpu_s']:>10.2f}{r['async_cpu_s']:>10.2f}")
    paying = [r["of_ideal"] for r in rows.values() if r["ideal_speedup"] >= 1.3]
    print_json_line({"entries": rows, "min_speedup": min(r["speedup"] for r in rows.values()),
                     "min_of_ideal": min(paying) if paying else None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"1/{QUICK_SHARE} of each budget (synthetic: 30 iterations)")
    parser.add_argument("--synthetic", action="store_true", help="GIL-free sleeping stages instead of the zoo")
    parser.add_argument("--entries", default=",".join(BUDGETS), help="zoo entries, comma separated")
    parser.add_argument("--pairs", type=int, default=None,
                        help="sync/async pairs per entry, the median ratio reported (default 3; 1 with --quick)")
    parser.add_argument("--async-collector", default="auto", choices=("auto", "process", "thread"),
                        help="env.async_collector of the async runs")
    parser.add_argument("--collect-ms", type=float, default=20.0)
    parser.add_argument("--learn-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if args.pairs is None:
        args.pairs = 1 if args.quick else 3
    elif args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")
    synthetic(args) if args.synthetic else zoo(args)


if __name__ == "__main__":
    main()
