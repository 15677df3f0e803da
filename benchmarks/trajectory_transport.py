"""Collected batches from collector processes to the learner on one host: shared memory against nng (issue 35).

``atari/impala`` on Breakout, 1 learner and 2 collector processes, as ``conveyor train atari/impala --collectors 2``
runs it, once with the config's ``transport: auto`` (on one host each batch's frames go through shared memory, the
nng message carrying only where they are: conveyor/middleware/shared_batches.py) and once with ``transport: nng``
(every batch in its message, as across hosts), alternating, each in a fresh interpreter. The figures are
benchmarks/impala_throughput.py's (benchmarks/_impala_runs.py): the learner's samples/s (env steps of the batches it
learns from, over the window of its TensorBoard points) and the collectors' env steps/s; ``shared_batches`` counts the
batches the learner took through shared memory (each collector's first goes in its message, before any offer).

A second leg times the transport alone (``--batches N``, 0 skips it): 2 collector processes send the same Atari-sized
batch (80 rows of 4x84x84 frames, ``obs`` and ``next_obs``: 4.5 MB) as fast as the zoo's ``LearnerClock`` and
``ContextExchanger`` let them (a collector leads the learner by at most 2 iterations), and a learner
that only merges what it receives counts batches/s over its batches after the first 5 per collector, through shared
memory and through nng in alternation (``batches_per_s_ratio``).

    python -m benchmarks.trajectory_transport                 # 40,000 agent steps a run, 2 rounds
    python -m benchmarks.trajectory_transport --env-steps 20000 --rounds 3
    python -m benchmarks.trajectory_transport --quick         # the transport leg alone, 10 batches a collector
    python -m benchmarks.trajectory_transport --env-steps 0 --batches 200   # the transport leg alone

Prints a table, then one JSON line: ``learner_steps_ratio`` and ``collected_steps_ratio`` (shm / nng, medians),
each side's medians, and ``shared_batches_shm`` (the smallest count of a shm round: above 0 where it was used);
``batches_per_s_ratio`` (shm / nng) and ``cpu_per_batch_ratio`` (the three processes' CPU time per batch, shm / nng:
on a loaded machine the steadier figure) from the transport leg, with each side's (None where a leg was skipped).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from benchmarks._harness import add_worker_option, alternate, print_json_line, run_worker, worker_done
from benchmarks._impala_runs import measure
from conveyor.engine import OnlineRLContext, Parallel, Role, task

SIDES = ("shm", "nng")
TRANSPORT = {"shm": "auto", "nng": "nng"}
COLLECTORS = 2
ROWS, FRAME = 80, (4, 84, 84)  # atari/impala's batch from one of 2 collectors: 4 envs x 20 steps
SKIPPED = 5  # batches per collector before the timed window: start-up, and the first one sent before any offer
WAIT = 120.0


def node(batches: int, shared_memory: bool) -> Dict[str, Any]:
    """The transport leg's worker: node 0 merges and counts what arrives; the others send ``batches`` batches. Each
    returns the CPU time its process took (all threads) from its batch ``SKIPPED`` (the learner's: the ``SKIPPED``-th
    of each collector) to the end."""
    import numpy as np
    import torch
    import treetensor.torch as ttorch

    from conveyor.middleware import ContextExchanger
    from conveyor.middleware.distributed import LearnerClock

    torch.set_num_threads(1)
    learner = task.router.node_id == 0
    frames = np.random.default_rng(task.router.node_id).integers(0, 256, (ROWS, *FRAME), dtype=np.uint8)
    sent = ttorch.Tensor({"obs": torch.from_numpy(frames), "next_obs": torch.from_numpy(frames.copy()),
                          "action": torch.zeros(ROWS, dtype=torch.int64), "reward": torch.zeros(ROWS)})
    arrivals: List[float] = []
    cpu: List[float] = []
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.LEARNER if learner else Role.COLLECTOR)
        exchanger = ContextExchanger(timeout_s=WAIT, grace_s=1.0, shared_memory=shared_memory)

        def collect(ctx: OnlineRLContext) -> None:
            arrivals.append(time.perf_counter())  # a collector's: its sends
            if len(arrivals) == SKIPPED + 1:
                cpu.append(time.process_time())
            ctx.trajectories, ctx.env_step = sent, ctx.env_step + ROWS

        def count(ctx: OnlineRLContext) -> None:
            arrivals.extend([time.perf_counter()] * (len(ctx.trajectories.obs) // ROWS))
            if not cpu and len(arrivals) >= SKIPPED * COLLECTORS:
                cpu.append(time.process_time())
            if len(arrivals) >= batches * COLLECTORS:
                task.finish = True

        task.use(LearnerClock(timeout_s=WAIT)).use(exchanger)  # a collector's lead over the learner, as in the zoo
        task.use(collect, role=Role.COLLECTOR).use(count, role=Role.LEARNER)
        task.run(max_step=sys.maxsize if learner else batches)
        cpu_s = time.process_time() - cpu[0]
        if not learner:
            return {"cpu_s": cpu_s}
        first = SKIPPED * COLLECTORS
        return {"batches_per_s": (len(arrivals) - first) / (arrivals[-1] - arrivals[first - 1]), "cpu_s": cpu_s,
                "shared_batches": exchanger.shared.taken}


def transport(side: str, batches: int) -> Dict[str, Any]:
    """One run of the transport leg: the learner's figures, and ``cpu_ms_per_batch``, the CPU time of the three
    processes over the batches after the first ``SKIPPED`` of each collector, per batch."""
    learner, *collectors = Parallel.runner(1 + COLLECTORS, protocol="ipc", ready_timeout_s=WAIT)(
        node, batches, side == "shm")
    cpu_s = learner["cpu_s"] + sum(c["cpu_s"] for c in collectors)
    return {**learner, "cpu_ms_per_batch": 1e3 * cpu_s / ((batches - SKIPPED) * COLLECTORS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the transport leg alone, {2 * SKIPPED} batches a "
                                                             f"collector, one round (the atari/impala leg's smoke "
                                                             f"run is tests/zoo/test_atari_mujoco_entries.py's)")
    parser.add_argument("--env-steps", type=int, default=40_000, help="agent steps per run (default 40,000)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating (default 2)")
    parser.add_argument("--batches", type=int, default=100, help="batches per collector in the transport leg "
                                                                  "(default 100; 0: no transport leg)")
    parser.add_argument("--seed", type=int, default=0)
    add_worker_option(parser, SIDES)
    args = parser.parse_args()
    env_steps, rounds, batches = (0, 1, 2 * SKIPPED) if args.quick else (args.env_steps, args.rounds, args.batches)
    if worker_done(args, lambda side: measure(COLLECTORS, env_steps, False, args.seed, TRANSPORT[side])):
        return
    moved = alternate(SIDES, rounds, lambda side: transport(side, batches)) if batches else None
    flags = ["--env-steps", str(env_steps), "--seed", str(args.seed)]
    results = alternate(SIDES, rounds, lambda side: run_worker(side, flags)) if env_steps else None
    report(env_steps, rounds, batches, args, results, moved)


Runs = Optional[Dict[str, List[Dict[str, Any]]]]


def report(env_steps: int, rounds: int, batches: int, args: argparse.Namespace, results: Runs, moved: Runs) -> None:
    figures: Dict[str, Any] = {"batches_per_s_ratio": None, "learner_steps_ratio": None, "collected_steps_ratio": None}
    if moved:
        rate = {side: statistics.median(r["batches_per_s"] for r in runs) for side, runs in moved.items()}
        cpu = {side: statistics.median(r["cpu_ms_per_batch"] for r in runs) for side, runs in moved.items()}
        print(f"transport alone: {COLLECTORS} collectors, {batches} batches each of {ROWS} rows of {FRAME} frames "
              f"(obs, next_obs), {rounds} round(s): median batches/s at the learner")
        for side, runs in moved.items():
            print(f"{side:>9}  {rate[side]:>8.1f} batches/s  {cpu[side]:>6.2f} ms CPU a batch  shared batches "
                  f"{min(r['shared_batches'] for r in runs)}  rounds (batches/s) "
                  + ", ".join(f"{r['batches_per_s']:.1f}" for r in runs))
        figures.update(batches_per_s_ratio=rate["shm"] / rate["nng"], batches_per_s_shm=rate["shm"],
                       batches_per_s_nng=rate["nng"], cpu_per_batch_ratio=cpu["shm"] / cpu["nng"],
                       cpu_ms_per_batch_shm=cpu["shm"], cpu_ms_per_batch_nng=cpu["nng"], batches=batches)
    if results:
        figures.update(impala(env_steps, rounds, args, results))
    print_json_line({**figures, "rounds": rounds, "seed": args.seed})


def impala(env_steps: int, rounds: int, args: argparse.Namespace, results: Dict[str, List[Dict[str, Any]]]) -> Dict:
    """The atari/impala leg's table; its figures for the JSON line."""
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
    return {"learner_steps_ratio": shm["steps_per_s"] / nng["steps_per_s"],
            "collected_steps_ratio": shm["collected_steps_per_s"] / nng["collected_steps_per_s"],
            "learner_steps_per_s_shm": shm["steps_per_s"], "learner_steps_per_s_nng": nng["steps_per_s"],
            "collected_steps_per_s_shm": shm["collected_steps_per_s"],
            "collected_steps_per_s_nng": nng["collected_steps_per_s"],
            "shared_batches_shm": min(r["shared_batches"] for r in results["shm"]),
            "shared_batches_nng": max(r["shared_batches"] for r in results["nng"]), "env_steps": env_steps}


if __name__ == "__main__":
    sys.exit(main())
