"""Updates per second of one and of two data-parallel learners on the Atari Nature CNN, and all-reduce time per step.

Each learner is a process on one intra-op thread running ``PPOPolicy.learn_mode.forward`` on uint8 ``[4, 84, 84]``
observations with the Nature CNN shared by actor and critic (4 actions). One update is one gradient step on the
whole batch: one learner takes all ``--batch`` transitions, two learners (gloo, :class:`DataParallel`) take half
each and all-reduce their gradients. The two layouts run alternately, ``--rounds`` times, in fresh processes
(forked from the script's with ``--quick``); the figures are medians and their ratio (these machines are shared:
absolute rates drift, the ratio holds better).
A third layout, two independent learners (each on half the batch, no all-reduce, started together), is the ceiling
the machine itself gives two processes: ``independent_ratio`` far below 2 says the cores are not two (SMT siblings
of one core, a throttled share), whatever Conveyor does; ``ratio / independent_ratio`` is what the all-reduce
keeps of it. The machine's CPU model, logical CPUs and physical cores are printed and in the JSON line, so that
figures from two machines can be told apart (2026-11-28: 1.46-1.74 on a 2-core Intel Xeon here, 0.95-1.03 on a
2-core AMD EPYC of this project, whose topology was not recorded then).
The gradients are all-reduced in buckets while the backward pass runs (:meth:`DataParallel.backward`);
``allreduce_ms`` is the mean time per step rank 0 still waits for them after its backward pass (communication the
overlap did not hide, waiting for the other learner included).

    python -m benchmarks.learner_scaling            # batch 256, 20 timed steps, 3 rounds
    python -m benchmarks.learner_scaling --quick    # batch 64, 4 timed steps, 1 round, learners forked
"""
from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import treetensor.torch as ttorch

from benchmarks._harness import print_json_line
from conveyor.policy import DataParallel, PPOPolicy

OBS, ACTIONS, WARMUP = (4, 84, 84), 4, 2


def make_batch(size: int) -> ttorch.Tensor:
    g = torch.Generator().manual_seed(0)
    return ttorch.Tensor({
        "obs": torch.randint(0, 256, (size, *OBS), generator=g, dtype=torch.uint8),
        "action": torch.randint(0, ACTIONS, (size,), generator=g), "logp": torch.full((size,), -1.386),
        "adv": torch.randn(size, generator=g), "value": torch.randn(size, generator=g),
        "return": torch.randn(size, generator=g), "reward": torch.randn(size, generator=g)})


def learner(rank: int, world: int, batch_size: int, steps: int, port_queue: Any, results: Any, secret: bytes,
            start: Any) -> None:
    """Time ``steps`` updates (after ``WARMUP``) as rank ``rank`` of ``world``; put ``(seconds, allreduce s)``.
    ``start``: None for data-parallel learners, else the barrier of independent ones (each on its share)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = PPOPolicy.default_config()
    cfg.model.update(obs_shape=list(OBS), action_shape=ACTIONS, encoder="nature", share_encoder=True)
    cfg.learn.update(learning_rate=2.5e-4, grad_clip=0.5)
    policy = PPOPolicy(cfg, seed=0)
    batch = make_batch(batch_size)
    group = None
    if start is not None:
        batch = batch[rank * batch_size // world:(rank + 1) * batch_size // world]
    elif world > 1:
        port = 0 if rank == 0 else port_queue.get(timeout=120)
        group = DataParallel(rank, world, host="127.0.0.1", port=port, secret=secret, session=b"bench", timeout=120)
        if rank == 0:
            port_queue.put(group.port)
        group.connect()
        policy.learn_mode.join_data_parallel(group)
        batch = group.shard(batch)
    for _ in range(WARMUP):
        policy.learn_mode.forward(batch)
    if group is not None:
        group.barrier()
        group.wait_s = 0.0
    if start is not None:
        start.wait(timeout=120)
    began = time.perf_counter()
    for _ in range(steps):
        policy.learn_mode.forward(batch)
    elapsed = time.perf_counter() - began
    if rank == 0:
        results.put((elapsed, group.wait_s if group is not None else 0.0))
    if group is not None:
        group.close()


def run(world: int, batch_size: int, steps: int, independent: bool = False,
        start_method: str = "spawn") -> tuple[float, float]:
    """Updates/s and all-reduce ms per step of ``world`` learners (rank 0's clock); ``independent``: learners that
    share nothing (no all-reduce), each on its share of the batch. ``start_method``: multiprocessing's, ``spawn``
    (fresh processes) but for the smoke run."""
    ctx = mp.get_context(start_method)
    port_queue, results = ctx.Queue(), ctx.Queue()
    secret = secrets.token_bytes(32)
    start = ctx.Barrier(world) if independent else None
    procs = [ctx.Process(target=learner, args=(r, world, batch_size, steps, port_queue, results, secret, start))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        elapsed, allreduce_s = results.get(timeout=600)
        for p in procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"a learner of {world} ended with exit code {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return steps / elapsed, 1000.0 * allreduce_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="transitions per update (over all learners)")
    parser.add_argument("--steps", type=int, default=20, help="timed updates per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout, alternately")
    parser.add_argument("--quick", action="store_true",
                        help="batch 64, 4 timed steps, 1 round, learners forked from this process")
    args = parser.parse_args()
    start_method = "spawn"
    if args.quick:
        args.batch, args.steps, args.rounds = 64, 4, 1
        # The smoke run's learners are forked from this process, which has imported torch but run no op and
        # started no Python thread (as Conveyor's zygote forks its workers), with torch._dynamo (imported by an
        # optimizer's first use) already in: 5 processes importing neither.
        import torch._dynamo  # noqa: F401

        start_method = "fork"
    layouts = {"1 learner": (1, False), "2 learners": (2, False), "2 independent": (2, True)}
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    allreduce: list[float] = []
    for _ in range(args.rounds):
        for name, (world, independent) in layouts.items():
            rate, ms = run(world, args.batch, args.steps, independent, start_method)
            rates[name].append(rate)
            if name == "2 learners":
                allreduce.append(ms)
    med = {name: statistics.median(r) for name, r in rates.items()}
    cpu = cpu_topology()
    print(f"PPO on the Nature CNN, uint8 {OBS} obs, batch {args.batch} per update, {args.steps} timed updates, "
          f"median of {args.rounds} rounds, one thread per learner; {cpu['cpu']}, {cpu['logical_cpus']} logical "
          f"CPUs on {cpu['physical_cores']} physical cores")
    for name, r in rates.items():
        print(f"  {name:<14}: {med[name]:7.2f} updates/s   ({', '.join(f'{x:.2f}' for x in r)})")
    print(f"  all-reduce wait per step after backward (2 learners, rank 0): {statistics.median(allreduce):.1f} ms")
    print_json_line({"updates_per_s_1": round(med["1 learner"], 3), "updates_per_s_2": round(med["2 learners"], 3),
                     "ratio": round(med["2 learners"] / med["1 learner"], 3),
                     "independent_ratio": round(med["2 independent"] / med["1 learner"], 3),
                     "allreduce_ms": round(statistics.median(allreduce), 2), **cpu,
                     "batch": args.batch, "steps": args.steps, "rounds": args.rounds})


def cpu_topology() -> dict[str, Any]:
    """The CPU model, the logical CPUs this process may run on and the physical cores under them (Linux's sysfs;
    None where it is not readable)."""
    usable = sorted(os.sched_getaffinity(0))
    cores = set()
    for index in usable:
        topology = Path(f"/sys/devices/system/cpu/cpu{index}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores = None
            break
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor() or None)
    except OSError:
        model = platform.processor() or None
    return {"cpu": model, "logical_cpus": len(usable), "physical_cores": len(cores) if cores is not None else None}


if __name__ == "__main__":
    main()
