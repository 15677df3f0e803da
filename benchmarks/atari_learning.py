"""PPO on Breakout against Stable-Baselines3 over the same agent-step budget: what each has learned at the end.

Per seed, each side trains from scratch in a fresh interpreter (``--quick``: this one), one after the other, on
one torch thread:

- ours: the ``atari/ppo`` zoo entry as it ships (trained as ``benchmarks.learning_curve`` trains an entry: no
  early stop, one evaluation at the end), with any ``--set KEY=VALUE`` on top;
- SB3: ``PPO("CnnPolicy")`` on ``make_atari_env`` + ``VecFrameStack(4)`` (ALE v5, frame skip 4, sticky actions
  0.25, life loss ends training episodes, clipped rewards) with the entry's hyperparameters: 8 envs x 128 steps,
  4 epochs of 256-transition minibatches, clip 0.1, entropy 0.01, value 0.5, gradient norm 0.5, gamma 0.99,
  GAE 0.95, and Adam 2.5e-4 annealed linearly over 10M agent steps as the entry does (so nearly constant over a
  250k budget).

The figure compared is the mean return of the last 20 full-game training episodes of each run (unclipped: SB3's
``Monitor`` sits inside its Atari wrappers, ours counts whole games), the issue's bar being ours at or above
SB3's on the same seeds. Prints a table and ends with one JSON line (``ours_final_train_returns``,
``sb3_final_train_returns``, their means, ``ratio`` = ours / SB3 of the means, ``seeds_at_or_above``, walls).
SB3 is pip-installed into this interpreter when missing.

    python -m benchmarks.atari_learning --seeds 3 --first-seed 1        # 250k agent steps a run: hours on CPU
    python -m benchmarks.atari_learning --quick        # ours only, 1 seed, 2 envs x 128 steps, 256 agent steps
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List

from benchmarks._harness import TRAIN_EPISODES, ensure_package, final_train_return, print_json_line, worker_done
from benchmarks._training import ATARI_PPO as ENTRY
from benchmarks._training import add_seed_options, atari_ppo, per_seed, print_pairs, seeds_run

QUICK_SETS = ["env.collector_env_num=2", "policy.collect.n_sample=256", "env.evaluator_env_num=1"]
"""The smoke run's config: rollouts of 2 envs x 128 steps (one 256-transition minibatch, 4 epochs) and one game
evaluated on one env: the same pipeline with 3 ALE envs to start instead of 16 and 1 evaluation game instead of 8."""
QUICK_BUDGET = 256
"""The smoke run's agent steps: two rollouts (the run ends on the first step past the budget), about two games."""


def sb3(seed: int, budget: int, overrides: List[str]) -> Dict[str, Any]:
    """SB3's PPO with the entry's hyperparameters (``overrides`` applied to them) for ``budget`` agent steps."""
    import ale_py
    import gymnasium as gym
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    from conveyor.config import apply_overrides
    from conveyor.zoo import load_entry

    gym.register_envs(ale_py)
    torch.set_num_threads(1)
    cfg = apply_overrides(load_entry(ENTRY).main_config, overrides)
    learn, envs = cfg.policy.learn, cfg.env.collector_env_num
    returns: List[float] = []

    class Games(BaseCallback):
        def _on_step(self) -> bool:
            returns.extend(info["episode"]["r"] for info in self.locals["infos"] if "episode" in info)
            return True

    def lr(progress_remaining: float) -> float:  # the entry's linear anneal over lr_anneal_steps agent steps
        done = (1.0 - progress_remaining) * budget
        return learn.learning_rate * max(0.0, 1.0 - done / learn.lr_anneal_steps)

    venv = VecFrameStack(make_atari_env(cfg.env.env_id, n_envs=envs, seed=seed,
                                        env_kwargs=dict(frameskip=1, repeat_action_probability=0.25)), n_stack=4)
    model = PPO("CnnPolicy", venv, n_steps=cfg.policy.collect.n_sample // envs, batch_size=learn.batch_size,
                n_epochs=learn.epoch_per_collect, learning_rate=lr, gamma=cfg.policy.discount_factor,
                gae_lambda=cfg.policy.gae_lambda, clip_range=learn.clip_ratio, ent_coef=learn.entropy_coef,
                vf_coef=learn.value_coef, max_grad_norm=learn.grad_clip, seed=seed, device="cpu")
    start = time.perf_counter()
    model.learn(total_timesteps=budget, callback=Games())
    wall = time.perf_counter() - start
    return {"side": "sb3", "seed": seed, "final_train_return": final_train_return(returns),
            "train_episodes": len(returns), "wall_s": round(wall, 1)}


SIDES = {"ours": atari_ppo, "sb3": sb3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_options(parser, SIDES,
                     changes="override one config value of both sides, as `conveyor train --set` (repeatable)",
                     quick=f"ours only, 1 seed, {QUICK_BUDGET} agent steps, with --set {' '.join(QUICK_SETS)}")
    args = parser.parse_args()
    budget = QUICK_BUDGET if args.quick else args.max_env_step
    if worker_done(args, lambda side: SIDES[side](args.seed, budget, args.overrides)):
        return
    overrides = [*QUICK_SETS, *args.overrides] if args.quick else args.overrides
    sides = ["ours"] if args.quick else list(SIDES)  # the smoke run installs and runs no peer
    if "sb3" in sides:
        ensure_package("stable-baselines3", "stable_baselines3")
    seeds = seeds_run(args)
    extra = ["--max-env-step", str(budget), *(word for pair in overrides for word in ("--set", pair))]
    here = (lambda side, seed: SIDES[side](seed, budget, overrides)) if args.quick else None  # in this process
    rows = per_seed(list(SIDES), sides, seeds, extra, here)

    print(f"{ENTRY} on Breakout, {budget} agent steps: mean return of the last {TRAIN_EPISODES} full-game "
          f"training episodes")
    print_pairs(rows, "ours", "sb3", ("ours", "SB3"))
    finals = {side: [r["final_train_return"] for r in rows[side]] for side in SIDES}
    means = {side: statistics.fmean(v) if None not in v else None for side, v in finals.items()}
    summary = {"entry": ENTRY, "max_env_step": budget, "seeds": seeds, "overrides": overrides,
               "ours_final_train_returns": finals["ours"], "sb3_final_train_returns": finals["sb3"],
               "ours_mean": means["ours"], "sb3_mean": means["sb3"],
               "ratio": round(means["ours"] / means["sb3"], 3) if means["ours"] and means["sb3"] else None,
               "seeds_at_or_above": sum(a is not None and b is not None and a >= b
                                        for a, b in zip(finals["ours"], finals["sb3"])),
               "ours_wall_s": [r["wall_s"] for r in rows["ours"]], "sb3_wall_s": [r["wall_s"] for r in rows["sb3"]]}
    print_json_line(summary)


if __name__ == "__main__":
    sys.exit(main())
