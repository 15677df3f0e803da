"""Env steps/s of StepCollector in a task against a bare loop doing the same env steps and forward passes.

8 CartPole envs, the DQN MLP policy, eps-greedy exploration. The bare loop steps plain Gymnasium envs
with the same network and keeps nothing; the collector also stores every transition as a batch.
Rounds alternate between the two so machine noise hits both alike.

    python -m benchmarks.collector_throughput [--quick] [--steps 20000]
"""
from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
import torch
from easydict import EasyDict

from benchmarks._harness import print_json_line
from conveyor import OnlineRLContext, task
from conveyor.config import compile_config
from conveyor.envs import make_env_manager
from conveyor.middleware import StepCollector, eps_greedy_handler
from conveyor.policy import DQNPolicy

ENVS = 8


def config(n_sample: int) -> EasyDict:
    return compile_config(EasyDict(dict(
        env=dict(env_id="CartPole-v1", collector_env_num=ENVS),
        policy=dict(model=dict(hidden_sizes=[128, 128]), collect=dict(n_sample=n_sample),
                    other=dict(eps=dict(kind="exp", start=0.5, end=0.1, decay=10000))),
    )), policy=DQNPolicy)


def collector_round(cfg: EasyDict, policy: DQNPolicy, steps: int) -> float:
    """Env steps per second of the collector in a task."""
    with make_env_manager(cfg.env, "collector", seed=0) as env:
        with task.start(ctx=OnlineRLContext()):
            task.use(eps_greedy_handler(cfg))
            task.use(StepCollector(cfg, policy.collect_mode, env))
            iterations = steps // cfg.policy.collect.n_sample
            start = time.perf_counter()
            task.run(max_step=iterations)
            elapsed = time.perf_counter() - start
            return task.ctx.env_step / elapsed


def bare_round(model: torch.nn.Module, steps: int, eps: float = 0.3) -> float:
    """The same work with nothing around it: stack obs, forward, eps-greedy, step each env, auto-reset."""
    envs = [gym.make("CartPole-v1") for _ in range(ENVS)]
    rng = np.random.default_rng(0)
    obs = np.stack([e.reset(seed=i)[0] for i, e in enumerate(envs)])
    start = time.perf_counter()
    for _ in range(steps // ENVS):
        with torch.no_grad():
            greedy = model(torch.from_numpy(obs)).argmax(-1).numpy()
        actions = np.where(rng.random(ENVS) < eps, rng.integers(0, 2, ENVS), greedy)
        for i, env in enumerate(envs):
            o, r, term, trunc, _ = env.step(actions[i])
            obs[i] = env.reset()[0] if term or trunc else o
    elapsed = time.perf_counter() - start
    for env in envs:
        env.close()
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--steps", type=int, default=40_000, help="env steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-sample", type=int, default=64, help="transitions per collector call")
    args = parser.parse_args()
    steps, rounds = (8_000, 3) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = config(args.n_sample)
    policy = DQNPolicy(cfg.policy)
    collector, bare = [], []
    for _ in range(rounds):
        collector.append(collector_round(cfg, policy, steps))
        bare.append(bare_round(policy.model, steps))
    best_c, best_b = max(collector), max(bare)
    print(f"{'loop':<24}{'best steps/s':>14}{'median steps/s':>16}")
    print(f"{'StepCollector in task':<24}{best_c:>14,.0f}{float(np.median(collector)):>16,.0f}")
    print(f"{'bare loop':<24}{best_b:>14,.0f}{float(np.median(bare)):>16,.0f}")
    print(f"ratio {best_c / best_b:.2f} (bar: >= 0.7); {ENVS} CartPole envs, {args.n_sample} transitions per call, "
          f"best of {rounds} rounds of {steps} env steps")
    print_json_line({"steps_per_s": round(best_c), "baseline_steps_per_s": round(best_b),
                     "ratio": round(best_c / best_b, 3)})


if __name__ == "__main__":
    main()
