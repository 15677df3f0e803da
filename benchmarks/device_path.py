"""The GPU path against the CPU on one machine, in one run: learner updates/s and env steps/s while training.

- Updates/s of three learners through ``learn_mode.forward`` on batches that start on the host, as a replay
  buffer or rollout hands them over (so each update pays its host-to-device copy, through pinned memory): PPO's
  Atari update (Nature CNN, 256 uint8 ``4x84x84`` frames), DQN's (Nature CNN, dueling, 32 frames, double,
  3-step) and SAC's MuJoCo update (256-256 networks, batch 256, HalfCheetah's 17/6 dims). On CUDA the image
  models run twice: in float32 and with bf16 autocast in the encoder (``policy.model.mixed_precision``, opt-in);
  SAC's update runs twice too: eagerly and replayed from a CUDA graph (``policy.learn.cuda_graph``, the default).
  CPU at torch's default threads (every core), as a learner on a GPU-less node would run.
- Env steps/s while training of ``atari/ppo`` (8 envs of ``--manager``) and ``mujoco/sac``, each on CPU and with
  ``--device cuda``, measured as ``benchmarks.atari_throughput`` and ``benchmarks.mujoco_throughput`` measure "ours", each in a
  fresh interpreter.

Ends with one JSON line: the device's name, every figure, and ``cuda_vs_cpu`` ratios.

    python -m benchmarks.device_path                      # needs a CUDA device
    python -m benchmarks.device_path --quick              # fewer steps and rollouts
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any, Callable, Dict

import numpy as np
import torch

from benchmarks._harness import device_name, print_json_line, run_worker


def host_batch(kind: str, size: int) -> Any:
    """A batch of ``size`` random transitions for ``kind`` ('ppo', 'dqn', 'sac'), on the host."""
    from conveyor.data import to_tensor

    rng = np.random.default_rng(0)
    if kind == "sac":
        obs_dim, act_dim = 17, 6
        return to_tensor({"obs": rng.standard_normal((size, obs_dim), np.float32),
                          "next_obs": rng.standard_normal((size, obs_dim), np.float32),
                          "action": rng.uniform(-1, 1, (size, act_dim)).astype(np.float32),
                          "reward": rng.standard_normal(size).astype(np.float32),
                          "terminated": rng.random(size) < 0.01, "truncated": np.zeros(size, bool)})
    frames = {"obs": rng.integers(0, 256, (size, 4, 84, 84), dtype=np.uint8), "action": rng.integers(0, 4, size),
              "reward": rng.standard_normal(size).astype(np.float32), "terminated": rng.random(size) < 0.01,
              "truncated": np.zeros(size, bool)}
    if kind == "dqn":
        frames.update(next_obs=rng.integers(0, 256, (size, 4, 84, 84), dtype=np.uint8),
                      discount=np.full(size, 0.99 ** 3, np.float32))
    else:
        frames.update(logp=np.full(size, -np.log(4), np.float32), adv=rng.standard_normal(size).astype(np.float32),
                      value=rng.standard_normal(size).astype(np.float32),
                      **{"return": rng.standard_normal(size).astype(np.float32)})
    return to_tensor(frames)


def make_learner(kind: str, device: str, mixed_precision: bool, graph: bool) -> Callable[[Any], Any]:
    """The ``learn_mode.forward`` of ``kind``'s zoo policy on ``device`` (SAC's from a CUDA graph if ``graph``)."""
    from conveyor.config import compile_config
    from conveyor.policy import DQNPolicy, PPOPolicy, SACPolicy
    from conveyor.zoo import load_entry

    entry, policy_cls = {"ppo": ("atari/ppo", PPOPolicy), "dqn": ("atari/dqn", DQNPolicy),
                         "sac": ("mujoco/sac", SACPolicy)}[kind]
    cfg = copy.deepcopy(load_entry(entry).main_config)
    if kind != "sac":
        cfg.env.manager = "sync"
    cfg.policy.model.mixed_precision = mixed_precision
    if kind == "sac":
        cfg.policy.learn.cuda_graph = graph
    cfg = compile_config(cfg, policy=policy_cls)
    return policy_cls(cfg.policy, device=device, seed=0).learn_mode.forward


BATCH = {"ppo": 256, "dqn": 32, "sac": 256}


def updates_per_s(kind: str, device: str, mixed_precision: bool, graph: bool, steps: int) -> float:
    """Gradient steps per second of ``kind``'s learner on ``device``, after a warm-up (in which a CUDA graph is
    captured)."""
    learn = make_learner(kind, device, mixed_precision, graph)
    batch = host_batch(kind, BATCH[kind])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        learn(batch)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        learn(batch)
    sync()
    return steps / (time.perf_counter() - start)


def env_steps_per_s(workload: str, device: str, args: argparse.Namespace) -> float:
    """Env steps/s while training ``workload`` ('atari_ppo' or 'mujoco_sac') in a fresh interpreter."""
    if workload == "atari_ppo":
        out = run_worker("ours", ["--device", device, "--manager", args.manager, "--rollouts", str(args.rollouts)],
                         module="benchmarks.atari_throughput")
    else:
        out = run_worker("ours", ["--device", device, "--warmup", "1000", "--steps", str(args.sac_steps)],
                         module="benchmarks.mujoco_throughput")
    return out["steps_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed updates per learner and device")
    parser.add_argument("--rollouts", type=int, default=8, help="atari/ppo rollouts (8 x 128 agent steps) per run")
    parser.add_argument("--sac-steps", type=int, default=2000, help="mujoco/sac training env steps after 1000 random")
    parser.add_argument("--manager", default="subprocess", help="atari/ppo's env manager (envpool where installed)")
    parser.add_argument("--parts", default="updates,env", help="'updates', 'env' or both")
    parser.add_argument("--quick", action="store_true", help="10 updates, 3 rollouts, 500 SAC steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("torch sees no CUDA device: run this where a GPU is (the CPU figures come from the same run)")
    if args.quick:
        args.steps, args.rollouts, args.sac_steps = 10, 3, 500
    parts = set(args.parts.split(","))
    gpu = device_name("cuda")
    print(f"{gpu} against {device_name('cpu')} at {torch.get_num_threads()} torch threads")
    summary: Dict[str, Any] = {"device": gpu, "cpu": device_name("cpu"), "cpu_threads": torch.get_num_threads()}
    ratios: Dict[str, float] = {}
    if "updates" in parts:
        rows = {}
        for kind in ("ppo", "dqn", "sac"):
            extra = ("cuda", False, True, " graph") if kind == "sac" else ("cuda", True, False, " bf16")
            for device, mixed, graph, suffix in [("cpu", False, False, ""), ("cuda", False, False, ""), extra]:
                label = f"{kind} {device}{suffix}"
                rows[label] = updates_per_s(kind, device, mixed, graph, args.steps)
                print(f"  {label:<14}{rows[label]:>10.1f} updates/s  (batch {BATCH[kind]})", flush=True)
            best_cuda = max(v for k, v in rows.items() if k.startswith(f"{kind} cuda"))
            ratios[f"{kind}_updates"] = round(best_cuda / rows[f"{kind} cpu"], 2)
        summary["updates_per_s"] = {k: round(v, 1) for k, v in rows.items()}
    if "env" in parts:
        rows = {}
        for workload in ("atari_ppo", "mujoco_sac"):
            for device in ("cpu", "cuda"):
                rows[f"{workload} {device}"] = env_steps_per_s(workload, device, args)
                print(f"  {workload} {device:<5}{rows[f'{workload} {device}']:>10.1f} env steps/s while training",
                      flush=True)
            ratios[f"{workload}_env_steps"] = round(rows[f"{workload} cuda"] / rows[f"{workload} cpu"], 2)
        summary["env_steps_per_s"] = {k: round(v, 1) for k, v in rows.items()}
    summary["cuda_vs_cpu"] = ratios
    print_json_line(summary)


if __name__ == "__main__":
    sys.exit(main())
