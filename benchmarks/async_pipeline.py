"""Async pipeline speed-up: a collector-like and a learner-like middleware that each hold no GIL.

Runs N iterations in sync mode and in async mode in the same process and reports wall times and their
ratio; the ideal ratio for two stages is (C + L) / max(C, L).

    python benchmarks/async_pipeline.py [--quick] [--collect-ms 20] [--learn-ms 20] [--steps 50]
"""
from __future__ import annotations

import argparse
import json
import time

from conveyor import OnlineRLContext, task


def stage(seconds: float, counter: str):
    """A middleware that spends ``seconds`` in code that releases the GIL (a sleep stands for env/GPU work)."""
    def work(ctx: OnlineRLContext) -> None:
        time.sleep(seconds)
        setattr(ctx, counter, getattr(ctx, counter) + 1)
    work.__name__ = counter
    return work


def timed_run(async_mode: bool, collect_s: float, learn_s: float, steps: int) -> float:
    with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
        task.use(stage(collect_s, "env_step"))
        task.use(stage(learn_s, "train_iter"))
        start = time.perf_counter()
        task.run(max_step=steps)
        elapsed = time.perf_counter() - start
        assert task.ctx.env_step == steps and task.ctx.train_iter == steps
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter iterations")
    parser.add_argument("--collect-ms", type=float, default=20.0)
    parser.add_argument("--learn-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    steps = 30 if args.quick else args.steps
    collect_s, learn_s = args.collect_ms / 1000, args.learn_ms / 1000

    sync_s = timed_run(False, collect_s, learn_s, steps)
    async_s = timed_run(True, collect_s, learn_s, steps)
    ideal = (collect_s + learn_s) / max(collect_s, learn_s)
    speedup = sync_s / async_s

    print(f"{'mode':<8}{'iterations':>12}{'wall s':>10}{'per iter ms':>14}")
    for mode, wall in (("sync", sync_s), ("async", async_s)):
        print(f"{mode:<8}{steps:>12}{wall:>10.3f}{wall / steps * 1000:>14.2f}")
    print(f"collector {args.collect_ms} ms, learner {args.learn_ms} ms: speedup {speedup:.2f}x (ideal {ideal:.2f}x)")
    print(json.dumps({"sync_s": round(sync_s, 4), "async_s": round(async_s, 4), "speedup": round(speedup, 3),
                      "ideal_speedup": round(ideal, 3)}))


if __name__ == "__main__":
    main()
