"""Env steps/s of SAC training on HalfCheetah-v5, Conveyor against Stable-Baselines3, same settings, same run.

Ours is the ``mujoco/sac`` zoo entry (256-256 networks, batch 256, one gradient step per env step in rounds of 8)
as ``conveyor train`` runs it, in one process, with evaluation off; SB3's ``SAC("MlpPolicy")`` gets the same
network (actor and critics ``hidden_sizes``), batch, learning rate, discount, Polyak rate, replay size,
random warm-up (``learning_starts``) and replay ratio (``train_freq`` = our ``n_sample`` env steps,
``gradient_steps`` = our ``update_per_collect``), on one env, on CPU (or both on the GPU with ``--device cuda``). The figure is env steps/s while training:
from the first 100 gradient steps after the warm-up to the end (ours from the wall times of the run's
TensorBoard points, SB3's from a callback). Each measurement runs in a fresh interpreter (torch threads as each
framework sets them: ours one intra-op thread, SB3 torch's default; SB3 on one thread too), alternating ours and
SB3's; the median of each side counts. Then one gradient step of each (sample and update) is timed in one process,
one thread, in alternating blocks: the share of the update in an env step. SB3 is pip-installed into this
interpreter when missing.

    python -m benchmarks.mujoco_throughput                    # 1000 random + 3000 training steps, 2 rounds
    python -m benchmarks.mujoco_throughput --quick            # a short smoke run of ours only (no SB3)
    python -m benchmarks.mujoco_throughput --device cuda      # both sides' networks on the GPU
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
import statistics
from typing import Any, Dict, Tuple

from benchmarks._harness import (add_worker_option, alternate, device_name, ensure_package, print_json_line,
                                 print_sides, run_worker, scratch_dir, tensorboard_events, worker_done)

ENV_ID = "HalfCheetah-v5"
MEASURE_FROM = 100  # gradient steps after the warm-up before the clock starts (first logger point)


def our_config(warmup: int, steps: int, device: str = "cpu") -> Tuple[str, Any, Any]:
    """The entry's config for this benchmark: HalfCheetah, one collector env, evaluation off, warm-up ``warmup``,
    the policy on ``device``."""
    from conveyor.zoo import load_entry

    name = "mujoco/sac"
    entry = load_entry(name)
    cfg = copy.deepcopy(entry.main_config)
    cfg.exp_name = "mujoco_throughput"
    cfg.env.update(env_id=ENV_ID, collector_env_num=1, evaluator_env_num=1, n_evaluator_episode=1, stop_value=None)
    policy = cfg.policy
    policy.cuda = device == "cuda"
    policy.learn.learning_starts = warmup
    policy.collect.random_collect_size = warmup
    policy.other.replay_buffer.size = warmup + steps
    policy.setdefault("eval", {}).setdefault("evaluator", {})
    policy.eval.evaluator.eval_freq = 10**9  # no evaluation: SB3 runs none either
    policy.eval.evaluator.pop("eval_env_step_freq", None)
    return name, entry, cfg


def ours(warmup: int, steps: int, seed: int, device: str = "cpu") -> Dict[str, Any]:
    """Train the entry for ``warmup + steps`` env steps; env steps/s between the logger's first point after
    ``MEASURE_FROM`` gradient steps and its last."""
    name, entry, cfg = our_config(warmup, steps, device)
    cfg.seed = seed
    with scratch_dir():
        start = time.perf_counter()
        ctx = entry.main(cfg, max_env_step=warmup + steps, progress=False)
        wall = time.perf_counter() - start
        points = tensorboard_events(Path("runs") / cfg.exp_name / "tb", "charts/env_steps_per_s")
    timed = [(step, t) for step, _, t in points if step > warmup]  # every MEASURE_FROM gradient steps
    if len(timed) >= 2:
        (s0, t0), (s1, t1) = timed[0], timed[-1]
        rate, window = (s1 - s0) / (t1 - t0), [s0, s1]
    else:  # too short for two logger points: the whole run, warm-up and start-up included
        rate, window = ctx.env_step / wall, [0, ctx.env_step]
    return {"side": "ours", "entry": name, "steps_per_s": rate, "window": window, "train_iter": ctx.train_iter,
            "wall_s": wall}


def sb3(warmup: int, steps: int, seed: int, threads: int = 0, device: str = "cpu") -> Dict[str, Any]:
    """SB3's SAC with our config's settings; env steps/s from ``MEASURE_FROM`` gradient steps after the warm-up
    to the end. ``threads``: torch intra-op threads (0: torch's default, what SB3 runs with)."""
    import gymnasium as gym
    import torch
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    if threads:
        torch.set_num_threads(threads)
    _, _, cfg = our_config(warmup, steps)
    learn, collect = cfg.policy.learn, cfg.policy.collect
    begin = warmup + MEASURE_FROM * collect.n_sample // learn.update_per_collect
    marks: Dict[str, float] = {}

    class Clock(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps == begin:
                marks["begin"] = time.perf_counter()
            return True

    model = SAC("MlpPolicy", gym.make(ENV_ID), learning_rate=learn.learning_rate, buffer_size=warmup + steps,
                learning_starts=warmup, batch_size=learn.batch_size, tau=learn.target_theta,
                gamma=cfg.policy.discount_factor, train_freq=collect.n_sample,
                gradient_steps=learn.update_per_collect,
                policy_kwargs=dict(net_arch=list(cfg.policy.model.hidden_sizes)), seed=seed, device=device)
    start = time.perf_counter()
    model.learn(total_timesteps=warmup + steps, callback=Clock())
    end = time.perf_counter()
    return {"side": "sb3", "steps_per_s": (warmup + steps - begin) / (end - marks["begin"]),
            "window": [begin, warmup + steps], "torch_threads": torch.get_num_threads(), "wall_s": end - start}


def learn_steps(rounds: int = 6, block: int = 20) -> Dict[str, Any]:
    """Where the time goes: one gradient step of ours (buffer sample + ``learn_mode.forward``) and of SB3
    (``SAC.train(gradient_steps=1)``, its sample included) on the same settings, both on one torch thread in
    this process, in alternating blocks of ``block`` steps; the medians of ``rounds`` blocks, in ms."""
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import SAC
    from stable_baselines3.common.logger import configure

    from conveyor.config import compile_config
    from conveyor.data import DequeBuffer
    from conveyor.data.batch import to_tensor
    from conveyor.policy import SACPolicy

    torch.set_num_threads(1)
    _, _, cfg = our_config(1000, 1000)
    cfg = compile_config(cfg, policy=SACPolicy)
    learn = cfg.policy.learn
    policy = SACPolicy(cfg.policy, seed=0)
    env = gym.make(ENV_ID)
    model = SAC("MlpPolicy", env, learning_rate=learn.learning_rate, buffer_size=2000, batch_size=learn.batch_size,
                policy_kwargs=dict(net_arch=list(cfg.policy.model.hidden_sizes)), seed=0, device="cpu")
    model.set_logger(configure(None, [""]))
    rng = np.random.default_rng(0)
    n, obs_dim, act_dim = 1000, env.observation_space.shape[0], env.action_space.shape[0]
    rows = {"obs": rng.standard_normal((n, obs_dim), np.float32), "next_obs": rng.standard_normal((n, obs_dim),
                                                                                                  np.float32),
            "action": rng.uniform(-1, 1, (n, act_dim)).astype(np.float32),
            "reward": rng.standard_normal(n).astype(np.float32), "terminated": np.zeros(n, bool),
            "truncated": np.zeros(n, bool)}
    buffer = DequeBuffer(n, seed=0)
    buffer.extend(to_tensor(rows))
    for i in range(n):
        model.replay_buffer.add(rows["obs"][i:i + 1], rows["next_obs"][i:i + 1], rows["action"][i:i + 1],
                                rows["reward"][i:i + 1], np.zeros(1), [{}])
    steps = {"ours": lambda: policy.learn_mode.forward(buffer.sample(learn.batch_size)),
             "sb3": lambda: model.train(gradient_steps=1, batch_size=learn.batch_size)}
    times: Dict[str, list] = {side: [] for side in steps}
    for _ in range(rounds):
        for side, step in steps.items():
            step()
            start = time.perf_counter()
            for _ in range(block):
                step()
            times[side].append(1000 * (time.perf_counter() - start) / block)
    return {"side": "learn_step", **{f"{side}_ms": round(statistics.median(t), 2) for side, t in times.items()}}


SIDES = {"ours": "Conveyor {entry}", "sb3_1t": "SB3 SAC, 1 thread (as ours)",
         "sb3": "SB3 SAC, torch's default threads"}


def measure(side: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One measurement of ``side`` in this process."""
    if side == "learn_step":
        return learn_steps()
    if side == "ours":
        return ours(args.warmup, args.steps, args.seed, args.device)
    return sb3(args.warmup, args.steps, args.seed, threads=1 if side == "sb3_1t" else 0, device=args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run of ours in this process, no SB3 (a smoke "
                                                             "test)")
    parser.add_argument("--warmup", type=int, default=1000, help="random env steps before training")
    parser.add_argument("--steps", type=int, default=3000, help="training env steps after the warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per side, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sb3", action="store_true", help="measure ours only")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides' networks train "
                        "(the one-gradient-step comparison stays on CPU)")
    add_worker_option(parser, [*SIDES, "learn_step"])
    args = parser.parse_args()
    if worker_done(args, lambda side: measure(side, args)):
        return
    if args.quick:
        args.warmup, args.steps, args.rounds, args.no_sb3 = 300, 300, 1, True
    sides = ["ours"] if args.no_sb3 else list(SIDES)
    if not args.no_sb3:
        ensure_package("stable-baselines3", "stable_baselines3")
    worker_args = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed),
                   "--device", args.device]
    results = alternate(sides, args.rounds, lambda side: measure(side, args) if args.quick
                        else run_worker(side, worker_args))
    entry = results["ours"][0]["entry"]
    print(f"SAC on {ENV_ID}, 1 env, {device_name(args.device)}: {args.warmup} random env steps, then {args.steps} training env steps; "
          f"env steps/s while training, {args.rounds} rounds alternating")
    median = print_sides(results, {side: label.format(entry=entry) for side, label in SIDES.items()})
    ratio = median["ours"] / median["sb3"] if "sb3" in median else None
    ratio_1t = median["ours"] / median["sb3_1t"] if "sb3_1t" in median else None
    learn = None
    if ratio is not None:
        print(f"sac_vs_sb3 {ratio:.2f} (bar: >= 1.5); against SB3 on one thread {ratio_1t:.2f}")
        learn = run_worker("learn_step")
        where = (f"where the time goes: one gradient step on CPU (sample + update, 1 thread, alternating blocks in one "
                 f"process) ours {learn['ours_ms']:.1f} ms, SB3 {learn['sb3_ms']:.1f} ms "
                 f"({learn['sb3_ms'] / learn['ours_ms']:.2f}x)")
        if args.device == "cpu":  # the rest of an env step, against the CPU step timed above
            per_step = 1000 / median["ours"]  # ms per env step while training, one gradient step each
            where += (f"; ours takes {per_step:.1f} ms per training env step, so the rest (env, acting, pipeline) is "
                      f"about {max(0.0, per_step - learn['ours_ms']):.1f} ms")
        print(where)
    summary = {"sac_vs_sb3": None if ratio is None else round(ratio, 3),
               "sac_vs_sb3_one_thread": None if ratio_1t is None else round(ratio_1t, 3),
               "entry": entry, "env_id": ENV_ID, "device": device_name(args.device), "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
               **{f"{side}_steps_per_s": [round(r["steps_per_s"], 1) for r in runs] for side, runs in results.items()},
               "sb3_torch_threads": results["sb3"][0]["torch_threads"] if "sb3" in results else None,
               "learn_step_ms": None if learn is None else {k: learn[k] for k in ("ours_ms", "sb3_ms")}}
    print_json_line(summary)


if __name__ == "__main__":
    sys.exit(main())
