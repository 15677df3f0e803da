"""Env steps per second reaching the learner with 1 and with 2 collector processes (issue 8).

Each collector process steps an env that burns about 1 ms of CPU per step (a busy loop on the thread's CPU
clock, like an env doing real work), 32 steps per batch, and sends each batch through the distributed
zoo's path: ``LearnerClock``, ``ContextExchanger`` over the router (ipc, HMAC, codec). The learner process
receives the batches, counts the env steps they carry and does nothing else, so the figure is what
collection and transport deliver. Each configuration is timed over a window that starts after the first
batch arrived (process start-up and imports excluded). Bar on a 2-core machine: ratio >= 1.6.

    python -m benchmarks.distributed_throughput [--quick] [--seconds S] [--step-ms MS]

Prints a table, then one JSON line with ``one_collector_steps_per_s``, ``two_collectors_steps_per_s`` and
``ratio`` (two / one).
"""
from __future__ import annotations

import argparse
import time

from benchmarks._harness import print_json_line
from conveyor.engine import OnlineRLContext, Parallel, Role, task

BATCH = 32  # env steps per collector iteration
OBS = 4
WAIT = 60.0  # the bound on every wait between processes


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (not wall time: a descheduled env costs nothing)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def node(step_s: float, window_s: float) -> dict:
    """Node 0 counts the env steps that reach it during ``window_s``; the others collect until it stops."""
    import torch
    import treetensor.torch as ttorch

    from conveyor.middleware import ContextExchanger
    from conveyor.middleware.distributed import LearnerClock

    torch.set_num_threads(1)
    learner = task.router.node_id == 0
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.LEARNER if learner else Role.COLLECTOR)
        clock = LearnerClock(timeout_s=WAIT)
        task.use(clock).use(ContextExchanger(timeout_s=WAIT))
        window = {}

        def collect(ctx: OnlineRLContext) -> None:
            obs = torch.zeros(BATCH, OBS)
            for t in range(BATCH):
                burn(step_s)
                obs[t] = float(t)
            ctx.trajectories = ttorch.Tensor({"obs": obs, "reward": torch.ones(BATCH)})
            ctx.env_step += BATCH

        def count(ctx: OnlineRLContext) -> None:
            now = time.perf_counter()
            if not window:  # the first batch opens the window: start-up is not timed
                window.update(start=now, steps=ctx.env_step)
            elif now - window["start"] >= window_s:
                window.update(end=now, steps=ctx.env_step - window["steps"])
                task.finish = True
            ctx.trajectories = None

        task.use(collect, role=Role.COLLECTOR).use(count, role=Role.LEARNER)
        task.run()
        if learner:
            return {"steps_per_s": window["steps"] / (window["end"] - window["start"])}
        return {"collected": clock.collected}


def measure(collectors: int, step_s: float, window_s: float) -> float:
    results = Parallel.runner(1 + collectors, protocol="ipc", ready_timeout_s=WAIT)(node, step_s, window_s)
    return results[0]["steps_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1 s window instead of 15 s")
    parser.add_argument("--seconds", type=float, default=None, help="length of each timed window")
    parser.add_argument("--step-ms", type=float, default=1.0, help="CPU milliseconds per env step (default 1)")
    args = parser.parse_args()
    window_s = args.seconds or (1.0 if args.quick else 15.0)
    step_s = args.step_ms / 1000
    one = measure(1, step_s, window_s)
    two = measure(2, step_s, window_s)
    ideal = 1 / step_s
    print(f"env of {args.step_ms} ms CPU per step, batches of {BATCH}, window {window_s:.0f} s, ipc")
    print(f"{'collectors':>10}{'env steps/s':>14}{'of 1 core':>11}")
    for n, rate in ((1, one), (2, two)):
        print(f"{n:>10}{rate:>14.0f}{rate / ideal:>11.2f}")
    print(f"ratio (2 / 1): {two / one:.2f}  (bar >= 1.6 on 2 cores)")
    print_json_line({"one_collector_steps_per_s": round(one, 1), "two_collectors_steps_per_s": round(two, 1),
                     "ratio": round(two / one, 3), "step_ms": args.step_ms, "window_s": window_s})


if __name__ == "__main__":
    main()
