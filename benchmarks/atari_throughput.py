"""Atari throughput on Breakout: PPO training against Stable-Baselines3, and the collector against bare env loops.

Three measurements, each side by side in one run, alternating (this machine is shared), each in a fresh
interpreter where torch or envs could differ:

- ``ppo_vs_sb3``: agent steps/s while training PPO, CleanRL's Atari settings (Nature CNN shared by actor and
  critic, 8 envs x 128 steps, 4 epochs of 256-transition minibatches, clip 0.1, entropy 0.01), on CPU or with
  ``--device cuda`` both models on the GPU (ours with its image encoder under bf16 autocast). Ours is
  the ``atari/ppo`` zoo entry as ``conveyor train`` runs it, sync and ``--async``, with ``env.manager``
  envpool (2 threads; ``--manager`` for another); evaluation is off after its opening
  round, which the clock excludes (its timed window runs from the end of the first rollout's update to the end
  of the last, from the wall times of the run's TensorBoard points). SB3's ``PPO("CnnPolicy")`` gets the same
  hyperparameters on ``make_atari_env`` + ``VecFrameStack(4)`` (ALE v5, frame skip 4 by its wrapper, sticky
  actions 0.25, life loss ends training episodes, clipped rewards), timed over the same rollouts by a
  callback, at torch's default threads (as SB3 runs) and at one thread (as ours). The median counts.
- ``collector_vs_envpool``: our ``StepCollector`` over ``make_env_manager`` with manager envpool, taking
  random actions (its warm-up path: the actions are drawn per env, the transitions stacked into ``[T, N]``
  batches as in training), against envpool's own ``step`` loop with random actions keeping nothing; 8 envs,
  2 threads, the same envpool preprocessing. Best round counts.
- ``collector_vs_gym_vector``: our collector over the Gymnasium ALE managers (sync, subprocess) against
  Gymnasium's ``SyncVectorEnv`` / ``AsyncVectorEnv`` of the same envs (same wrappers, the factory our
  managers use) stepped bare with random actions; best of ours against best of theirs.

Where the time goes (env / inference / update / handover) is printed from our run's per-middleware times
(``time/..._ms`` in its TensorBoard log) and the bare env loops, and from SB3's rollout and update phases.

    python -m benchmarks.atari_throughput                   # 15 rollouts per PPO run, 2 rounds
    python -m benchmarks.atari_throughput --rollouts 8 --rounds 1   # what docs/benchmarks.md reports
    python -m benchmarks.atari_throughput --quick           # a smoke run: tiny PPO, short loops, no SB3
    python -m benchmarks.atari_throughput --device cuda --manager subprocess --parts ppo   # the GPU table
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from benchmarks._harness import (add_worker_option, alternate, device_name, ensure_package, print_json_line,
                                 print_sides, run_worker, scratch_dir, tensorboard_events, tensorboard_scalars,
                                 worker_done)

ENV_ID = "ALE/Breakout-v5"
ENVS = 8
THREADS = 2  # envpool threads, as the bare-envpool figure


# --- PPO training --------------------------------------------------------------------------------------
def ppo_config(quick: bool, manager: str = "envpool", device: str = "cpu") -> Tuple[str, Any, Any]:
    """``(entry name, entry module, config)``: atari/ppo on 8 envs of ``manager`` (envpool: 2 threads), evaluation
    reduced to one short opening round, the policy on ``device``; ``quick``: a tiny rollout."""
    from conveyor.zoo import load_entry

    name = "atari/ppo"
    entry = load_entry(name)
    cfg = copy.deepcopy(entry.main_config)
    cfg.exp_name = "atari_throughput"
    # The untrained policy may never press FIRE, so the opening evaluation's game is capped (training
    # episodes, one life each, end far sooner); no evaluation after it.
    cfg.env.update(env_id=ENV_ID, collector_env_num=ENVS, evaluator_env_num=1, n_evaluator_episode=1,
                   stop_value=None, manager=manager, num_workers=THREADS if manager == "envpool" else None,
                   max_episode_steps=100 if quick else 500)  # subprocess: a worker process per env, up to the CPUs
    cfg.policy.cuda = device == "cuda"
    cfg.policy.setdefault("eval", {}).setdefault("evaluator", {})
    cfg.policy.eval.evaluator.eval_freq = 10**9
    if quick:
        cfg.env.collector_env_num = 2
        cfg.policy.collect.n_sample = 64
        cfg.policy.learn.update(epoch_per_collect=1, batch_size=64)
    return name, entry, cfg


def ours_ppo(rollouts: int, quick: bool, async_mode: bool, manager: str = "envpool",
             device: str = "cpu") -> Dict[str, Any]:
    """Train ``rollouts`` rollouts; agent steps/s between the logger's first point (end of rollout 1) and its
    last (end of the last rollout), with the mean time per iteration of each middleware."""
    name, entry, cfg = ppo_config(quick, manager, device)
    size = cfg.policy.collect.n_sample
    with scratch_dir():
        start = time.perf_counter()
        ctx = entry.main(cfg, max_env_step=rollouts * size, progress=False, async_mode=async_mode)
        wall = time.perf_counter() - start
        logdir = Path("runs") / cfg.exp_name / "tb"
        points = tensorboard_events(logdir, "charts/env_steps_per_s")
        stages = _stage_times(logdir)
    if len(points) >= 2 and points[-1][0] > points[0][0]:
        (s0, _, t0), (s1, _, t1) = points[0], points[-1]
        rate, window = (s1 - s0) / (t1 - t0), [s0, s1]
    else:  # too short for two logger points (--quick): the whole run, start-up included
        rate, window = ctx.env_step / wall, [0, ctx.env_step]
    return {"side": "ours_async" if async_mode else "ours", "entry": name, "steps_per_s": rate, "window": window,
            "stages_ms": stages, "wall_s": wall}


def _stage_times(logdir: Path) -> Dict[str, float]:
    """The last logged ``time/<middleware>_ms`` of a run (mean time per iteration of each middleware)."""
    return {tag[len("time/"):-len("_ms")]: round(points[-1][1], 1)
            for tag, points in tensorboard_scalars(logdir).items() if tag.startswith("time/")}


def sb3_ppo(rollouts: int, quick: bool, threads: int, device: str = "cpu") -> Dict[str, Any]:
    """SB3's PPO with the same settings, timed from the start of rollout 2 to the end of the last update; the
    rollout (collection) and update phases timed apart."""
    import ale_py
    import gymnasium as gym
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    if threads:
        torch.set_num_threads(threads)
    _, _, cfg = ppo_config(quick)
    learn, envs = cfg.policy.learn, cfg.env.collector_env_num
    n_steps = cfg.policy.collect.n_sample // envs
    marks: List[Tuple[str, float]] = []

    class Phases(BaseCallback):
        def _on_rollout_start(self) -> None:
            marks.append(("rollout", time.perf_counter()))

        def _on_rollout_end(self) -> None:
            marks.append(("update", time.perf_counter()))

        def _on_step(self) -> bool:
            return True

    venv = VecFrameStack(make_atari_env(ENV_ID, n_envs=envs, seed=0,
                                        env_kwargs=dict(frameskip=1, repeat_action_probability=0.25)), n_stack=4)
    model = PPO("CnnPolicy", venv, n_steps=n_steps, batch_size=learn.batch_size, n_epochs=learn.epoch_per_collect,
                learning_rate=learn.learning_rate, gamma=cfg.policy.discount_factor,
                gae_lambda=cfg.policy.gae_lambda, clip_range=learn.clip_ratio, ent_coef=learn.entropy_coef,
                vf_coef=learn.value_coef, max_grad_norm=learn.grad_clip, seed=0, device=device)
    model.learn(total_timesteps=rollouts * n_steps * envs, callback=Phases())
    end = time.perf_counter()
    marks.append(("end", end))
    rollout_s = [b - a for (k, a), (_, b) in zip(marks, marks[1:]) if k == "rollout"][1:]
    update_s = [b - a for (k, a), (_, b) in zip(marks, marks[1:]) if k == "update"][1:]
    begin = [t for k, t in marks if k == "rollout"][1]
    steps = (rollouts - 1) * n_steps * envs
    return {"side": "sb3_1t" if threads == 1 else "sb3", "steps_per_s": steps / (end - begin),
            "rollout_ms": round(1000 * statistics.fmean(rollout_s), 1),
            "update_ms": round(1000 * statistics.fmean(update_s), 1), "torch_threads": torch.get_num_threads()}


# --- collectors against bare loops -------------------------------------------------------------------
class _RandomOnly:
    """A collect policy that is never asked: the collector stays in its random warm-up."""

    def forward(self, obs: Any, **kwargs: Any) -> Dict[str, Any]:
        raise AssertionError("the benchmark's collector acts randomly")

    def reset(self, env_ids: Any = None) -> None:
        pass


def env_config(manager: str, quick: bool) -> Any:
    from easydict import EasyDict

    from conveyor.config import compile_config
    from conveyor.policy import PPOPolicy

    return compile_config(EasyDict(dict(
        env=dict(env_id=ENV_ID, collector_env_num=2 if quick else ENVS, manager=manager, num_workers=THREADS),
        policy=dict(model=dict(encoder="nature"), collect=dict(n_sample=(2 if quick else ENVS) * 128)),
    )), policy=PPOPolicy)


def collector_round(manager: str, steps: int, quick: bool) -> float:
    """Agent steps/s of StepCollector (random actions) in a task over the ``manager`` env manager."""
    from conveyor import OnlineRLContext, task
    from conveyor.envs import make_env_manager
    from conveyor.middleware import StepCollector

    cfg = env_config(manager, quick)
    with make_env_manager(cfg.env, "collector", seed=0) as env:
        with task.start(ctx=OnlineRLContext()):
            task.use(StepCollector(cfg, _RandomOnly(), env, random_collect_size=10**12))
            task.run(max_step=1)  # the first reset and pool start-up, untimed
            first = task.ctx.env_step
            start = time.perf_counter()
            task.run(max_step=max(1, steps // cfg.policy.collect.n_sample))
            return (task.ctx.env_step - first) / (time.perf_counter() - start)


def envpool_round(steps: int, quick: bool) -> float:
    """Agent steps/s of envpool's own loop: ``step`` with random actions, nothing kept."""
    import envpool
    import numpy as np

    from conveyor.envs._envpool import envpool_atari_kwargs, envpool_task_id

    cfg = env_config("envpool", quick)
    n = cfg.env.collector_env_num
    pool = envpool.make(envpool_task_id(ENV_ID), env_type="gymnasium", num_envs=n, batch_size=n, seed=0,
                        num_threads=THREADS, **envpool_atari_kwargs(cfg.env.atari, collector=True))
    pool.reset()
    rng = np.random.default_rng(0)
    actions = rng.integers(0, pool.single_action_space.n, (steps // n + 1, n))
    start = time.perf_counter()
    for t in range(steps // n):
        pool.step(actions[t])
    rate = (steps // n) * n / (time.perf_counter() - start)
    pool.close()
    return rate


def gym_vector_round(kind: str, steps: int, quick: bool) -> float:
    """Agent steps/s of Gymnasium's ``SyncVectorEnv`` or ``AsyncVectorEnv`` of our env factory's envs, stepped
    bare with random actions."""
    from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

    from conveyor.envs import env_factory

    cfg = env_config("sync", quick)
    factory = env_factory(cfg.env, "collector")
    n = cfg.env.collector_env_num
    venv = (SyncVectorEnv if kind == "sync" else AsyncVectorEnv)([factory] * n)
    venv.reset(seed=0)
    venv.action_space.seed(0)
    actions = [venv.action_space.sample() for _ in range(steps // n)]
    start = time.perf_counter()
    for action in actions:
        venv.step(action)
    rate = len(actions) * n / (time.perf_counter() - start)
    venv.close()
    return rate


LOOPS: Dict[str, Callable[[int, bool], float]] = {
    "collector envpool": lambda steps, quick: collector_round("envpool", steps, quick),
    "envpool loop": envpool_round,
    "collector sync": lambda steps, quick: collector_round("sync", steps, quick),
    "collector subprocess": lambda steps, quick: collector_round("subprocess", steps, quick),
    "gym SyncVectorEnv": lambda steps, quick: gym_vector_round("sync", steps, quick),
    "gym AsyncVectorEnv": lambda steps, quick: gym_vector_round("async", steps, quick),
}


# --- the run ------------------------------------------------------------------------------------------
PPO_SIDES = {"ours": "Conveyor {entry}, sync", "ours_async": "Conveyor {entry}, --async",
             "sb3": "SB3 PPO, torch's default threads", "sb3_1t": "SB3 PPO, 1 thread (as ours)"}


def worker(side: str, args: argparse.Namespace) -> Dict[str, Any]:
    if side in ("ours", "ours_async"):
        return ours_ppo(args.rollouts, args.quick, async_mode=side == "ours_async", manager=args.manager,
                        device=args.device)
    if side in ("sb3", "sb3_1t"):
        return sb3_ppo(args.rollouts, args.quick, threads=1 if side == "sb3_1t" else 0, device=args.device)
    return {"side": side, "steps_per_s": LOOPS[side](args.loop_steps, args.quick)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny PPO runs and short loops, no SB3 (a smoke test)")
    parser.add_argument("--rollouts", type=int, default=15, help="PPO rollouts per run (8 x 128 agent steps)")
    parser.add_argument("--rounds", type=int, default=2, help="PPO measurements per side, alternating")
    parser.add_argument("--loop-steps", type=int, default=12_000, help="agent steps per collector/env loop round")
    parser.add_argument("--loop-rounds", type=int, default=3)
    parser.add_argument("--no-sb3", action="store_true", help="leave SB3 out (ppo_vs_sb3 is then null)")
    parser.add_argument("--parts", default="ppo,loops",
                        help="what to measure: 'ppo' (PPO training), 'loops' (collectors against bare env loops), "
                             "or both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides' PPO models train (the loops part is CPU only)")
    parser.add_argument("--manager", default="envpool",
                        help="our env manager in the PPO part (envpool, subprocess, sync): subprocess where envpool "
                             "is not installed")
    add_worker_option(parser)
    args = parser.parse_args()
    if worker_done(args, lambda side: worker(side, args)):
        return
    if args.quick:  # in this process, ours in sync mode only: a smoke test of each part
        args.rollouts, args.rounds, args.loop_steps, args.loop_rounds, args.no_sb3 = 2, 1, 256, 1, True
    sides = ["ours"] + ([] if args.no_sb3 else ["sb3_1t"]) + ([] if args.quick else ["ours_async"]) \
        + ([] if args.no_sb3 else ["sb3"])
    if not args.no_sb3:
        ensure_package("stable-baselines3", "stable_baselines3")
    common = ["--rollouts", str(args.rollouts), "--loop-steps", str(args.loop_steps), "--device", args.device,
              "--manager", args.manager]

    def measure(side: str) -> Dict[str, Any]:
        return worker(side, args) if args.quick else run_worker(side, common, timeout=3600)

    parts = set(args.parts.split(","))
    if not parts or parts - {"ppo", "loops"}:
        parser.error(f"--parts {args.parts!r}: give 'ppo', 'loops' or 'ppo,loops'")
    ppo = alternate(sides, args.rounds, measure) if "ppo" in parts else {}
    loops = alternate(list(LOOPS), args.loop_rounds, measure) if "loops" in parts else {}
    report(args, ppo, loops)


def report(args: argparse.Namespace, ppo: Dict[str, List[Dict]], loops: Dict[str, List[Dict]]) -> None:
    summary: Dict[str, Any] = {"ppo_vs_sb3": None, "ppo_vs_sb3_one_thread": None, "collector_vs_envpool": None,
                               "collector_vs_gym_vector": None, "rollouts": args.rollouts, "rounds": args.rounds,
                               "device": device_name(args.device), "manager": args.manager}
    if ppo:
        summary.update(report_ppo(args, ppo))
    if loops:
        summary.update(report_loops(args, loops))
    print_json_line(summary)


def report_ppo(args: argparse.Namespace, ppo: Dict[str, List[Dict]]) -> Dict[str, Any]:
    entry = ppo["ours"][0]["entry"]
    print(f"PPO on {ENV_ID}, Nature CNN, {device_name(args.device)}, our envs {args.manager}: {args.rollouts} rollouts "
          f"of 8 x 128 agent steps, 4 epochs, batch 256; agent steps/s while training, {args.rounds} rounds "
          f"alternating")
    median = print_sides(ppo, {side: label.format(entry=entry) for side, label in PPO_SIDES.items()})
    best_ours = max(median["ours"], median.get("ours_async", 0.0))
    ratio = best_ours / median["sb3"] if "sb3" in median else None
    ratio_1t = best_ours / median["sb3_1t"] if "sb3_1t" in median else None
    if ratio is not None:
        print(f"ppo_vs_sb3 {ratio:.2f} (bar: >= 1.3 on CPU, >= 2 on a GPU; best of ours sync/async against SB3 as it "
              f"runs); "
              f"against SB3 on one thread {ratio_1t:.2f}")
    print("\nwhere the time goes, mean ms per iteration (one rollout and its update):")
    for side, runs in ppo.items():
        last = runs[-1]
        if "stages_ms" in last:
            print(f"  {side:<12}" + ", ".join(f"{k} {v:.0f}" for k, v in last["stages_ms"].items()))
        else:
            print(f"  {side:<12}rollout (env + inference) {last['rollout_ms']:.0f}, update {last['update_ms']:.0f}")
    return {"ppo_vs_sb3": None if ratio is None else round(ratio, 3),
            "ppo_vs_sb3_one_thread": None if ratio_1t is None else round(ratio_1t, 3), "entry": entry,
            **{f"ppo_{side}_steps_per_s": [round(r["steps_per_s"], 1) for r in runs] for side, runs in ppo.items()},
            "ppo_stages_ms": {side: runs[-1].get("stages_ms") or {k: runs[-1][k] for k in ("rollout_ms", "update_ms")}
                              for side, runs in ppo.items()}}


def report_loops(args: argparse.Namespace, loops: Dict[str, List[Dict]]) -> Dict[str, Any]:
    best = {name: max(r["steps_per_s"] for r in runs) for name, runs in loops.items()}
    print(f"\ncollection, random actions, {2 if args.quick else ENVS} envs, best of {args.loop_rounds} rounds of "
          f"{args.loop_steps} agent steps")
    for name, runs in loops.items():
        each = ", ".join(f"{r['steps_per_s']:,.0f}" for r in runs)
        print(f"  {name:<24}{best[name]:>9,.0f} steps/s   ({each})")
    rollout = ppo_config(args.quick)[2].policy.collect.n_sample
    env_ms = 1000 * rollout / best["envpool loop"]
    print(f"of a PPO rollout of {rollout} agent steps, envpool stepping alone (its bare loop) takes {env_ms:.0f} ms: "
          f"the rest of StepCollector's time is acting (CNN inference) and batching")
    vs_envpool = best["collector envpool"] / best["envpool loop"]
    vs_gym = max(best["collector sync"], best["collector subprocess"]) / max(best["gym SyncVectorEnv"],
                                                                            best["gym AsyncVectorEnv"])
    print(f"collector_vs_envpool {vs_envpool:.2f} (bar >= 0.85); collector_vs_gym_vector {vs_gym:.2f} (bar >= 0.9; "
          f"sync/sync {best['collector sync'] / best['gym SyncVectorEnv']:.2f}, subprocess/async "
          f"{best['collector subprocess'] / best['gym AsyncVectorEnv']:.2f})")
    return {"collector_vs_envpool": round(vs_envpool, 3), "collector_vs_gym_vector": round(vs_gym, 3),
            "env_ms_per_rollout": round(env_ms),
            "loops_steps_per_s": {name: [round(r["steps_per_s"]) for r in runs] for name, runs in loops.items()}}


if __name__ == "__main__":
    sys.exit(main())
