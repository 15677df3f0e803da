"""Env steps/s of Conveyor's env managers against Gymnasium's vector envs and a bare loop.

Three workloads, 8 envs each, random actions drawn in advance:
- CartPole-v1 (a step takes microseconds: process round trips dominate);
- CartPole-v1 behind a wrapper that burns ~1 ms of CPU per step (processes win when cores are free);
- CartPole-v1 behind a wrapper that waits ~1 ms per step, like an env waiting on a simulator or a
  server (processes win even on a busy machine).

Candidates: a bare ``for env in envs: env.step(a)`` loop (no batching), SyncEnvManager,
gymnasium.vector.SyncVectorEnv (same-step autoreset), SubprocessEnvManager (default workers, and one
per env), gymnasium.vector.AsyncVectorEnv (one process per env, shared memory, same-step autoreset).
Each candidate runs several timed rounds, interleaved with the others; the best round counts (the
machine is shared). Ratios are against SyncEnvManager in the same run. Prints a table, then one JSON
object as the last line.

    python -m benchmarks.env_managers [--quick]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from benchmarks._harness import print_json_line
from conveyor.envs import SubprocessEnvManager, SyncEnvManager, default_num_workers

ENV_NUM = 8


class BurnCPU(gym.Wrapper):
    """Busy-waits ``ms`` milliseconds per step, like an env whose physics are expensive."""

    def __init__(self, env: gym.Env, ms: float) -> None:
        super().__init__(env)
        self.seconds = ms / 1000.0

    def step(self, action: Any) -> Any:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


class Wait(gym.Wrapper):
    """Sleeps ``ms`` milliseconds per step, like an env waiting on an external simulator."""

    def __init__(self, env: gym.Env, ms: float) -> None:
        super().__init__(env)
        self.seconds = ms / 1000.0

    def step(self, action: Any) -> Any:
        time.sleep(self.seconds)
        return self.env.step(action)


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def expensive_cartpole() -> gym.Env:
    return BurnCPU(gym.make("CartPole-v1"), ms=1.0)


def waiting_cartpole() -> gym.Env:
    return Wait(gym.make("CartPole-v1"), ms=1.0)


class BareLoop:
    """The floor: step each env in turn, reset on episode end, batch nothing."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]]) -> None:
        self.envs = [fn() for fn in env_fns]

    def reset(self, seed: int) -> None:
        for i, env in enumerate(self.envs):
            env.reset(seed=seed + i)

    def run(self, actions: np.ndarray) -> None:
        envs = self.envs
        for row in actions:
            for env, a in zip(envs, row):
                _, _, terminated, truncated, _ = env.step(a)
                if terminated or truncated:
                    env.reset()

    def close(self) -> None:
        for env in self.envs:
            env.close()


class Manager:
    """A Conveyor manager driven through its public protocol."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def reset(self, seed: int) -> None:
        self.manager.reset(seed=seed)

    def run(self, actions: np.ndarray) -> None:
        step = self.manager.step
        for row in actions:
            step(row)

    def close(self) -> None:
        self.manager.close()


class GymVector:
    """A Gymnasium vector env in same-step autoreset mode (the semantics Conveyor's managers have)."""

    def __init__(self, vector: gym.vector.VectorEnv) -> None:
        self.vector = vector

    def reset(self, seed: int) -> None:
        self.vector.reset(seed=seed)

    def run(self, actions: np.ndarray) -> None:
        step = self.vector.step
        for row in actions:
            step(row)

    def close(self) -> None:
        self.vector.close()


CANDIDATES: dict[str, Callable[[list], Any]] = {
    "bare loop": BareLoop,
    "SyncEnvManager": lambda fns: Manager(SyncEnvManager(fns)),
    "gym SyncVectorEnv": lambda fns: GymVector(SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)),
    "SubprocessEnvManager": lambda fns: Manager(SubprocessEnvManager(fns)),
    "SubprocessEnvManager 1 env/worker": lambda fns: Manager(SubprocessEnvManager(fns, num_workers=len(fns))),
    "gym AsyncVectorEnv": lambda fns: GymVector(AsyncVectorEnv(fns, shared_memory=True,
                                                               autoreset_mode=AutoresetMode.SAME_STEP)),
}


def measure(env_fn: Callable[[], gym.Env], steps: int, rounds: int) -> dict[str, float]:
    """Best env steps/s of each candidate over ``rounds`` interleaved rounds of ``steps`` lock-steps."""
    actions = np.random.default_rng(0).integers(0, 2, size=(steps, ENV_NUM))
    runners = {name: make([env_fn] * ENV_NUM) for name, make in CANDIDATES.items()}
    best = dict.fromkeys(runners, 0.0)
    try:
        for runner in runners.values():
            runner.reset(seed=0)
            runner.run(actions[: max(1, steps // 10)])  # warm up
        for _ in range(rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.run(actions)
                best[name] = max(best[name], steps * ENV_NUM / (time.perf_counter() - start))
    finally:
        for runner in runners.values():
            runner.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (well under a minute)")
    args = parser.parse_args()
    workloads = {  # name: (env factory, lock-steps per round, rounds)
        "cartpole": (cartpole, 500, 3) if args.quick else (cartpole, 1000, 25),
        "cartpole_1ms": (expensive_cartpole, 30, 2) if args.quick else (expensive_cartpole, 100, 8),
        "cartpole_wait_1ms": (waiting_cartpole, 30, 2) if args.quick else (waiting_cartpole, 100, 5),
    }
    results = {name: measure(fn, steps, rounds) for name, (fn, steps, rounds) in workloads.items()}

    print(f"env steps/s, {ENV_NUM} envs, best round of each; SubprocessEnvManager uses "
          f"{default_num_workers(ENV_NUM)} workers by default; ratio = candidate / SyncEnvManager")
    print(f"{'candidate':36s}" + "".join(f"{w:>18s}{'ratio':>8s}" for w in workloads))
    for candidate in CANDIDATES:
        row = f"{candidate:36s}"
        for workload in workloads:
            value = results[workload][candidate]
            row += f"{value:18,.0f}{value / results[workload]['SyncEnvManager']:8.2f}"
        print(row)
    figures: dict[str, Any] = {"benchmark": "env_managers", "quick": args.quick, "env_num": ENV_NUM,
                               "subprocess_workers": default_num_workers(ENV_NUM)}
    for workload in workloads:
        sync = results[workload]["SyncEnvManager"]
        figures[workload] = {
            "steps_per_s": {k: round(v) for k, v in results[workload].items()},
            "ratio_vs_SyncEnvManager": {k: round(v / sync, 3) for k, v in results[workload].items()},
        }
    figures["sync_overhead_vs_bare_loop"] = round(1 - results["cartpole"]["SyncEnvManager"] /
                                                  results["cartpole"]["bare loop"], 3)
    print_json_line(figures)


if __name__ == "__main__":
    main()
