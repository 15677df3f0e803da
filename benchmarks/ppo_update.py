"""Wall time of one PPO update round on an Atari-sized rollout, against Stable-Baselines3's ``PPO.train()``.

Both learn from the same kind of rollout: 8 envs x 128 steps of random uint8 ``[4, 84, 84]`` observations,
4 discrete actions, the Nature CNN shared by actor and critic, 4 epochs of minibatches of 256 (16 gradient
steps), and CleanRL's Atari PPO hyperparameters (lr 2.5e-4, clip 0.1, entropy 0.01, value 0.5, grad clip
0.5, gamma 0.99, GAE 0.95). Ours is ``multistep_trainer`` over ``PPOPolicy.learn_mode``; SB3's is
``PPO.train()`` over its rollout buffer (flattened afresh each round, as after a real rollout). The two run
in this process, alternately; the figure is their ratio. Threads: by default each as it runs out of the box
(ours on one intra-op thread, as every zoo run sets; Stable-Baselines3 on torch's default, every core);
``--threads N`` gives both N. Stable-Baselines3 is pip-installed into this interpreter when missing.

    python -m benchmarks.ppo_update                # 5 rounds each
    python -m benchmarks.ppo_update --threads 1    # both on one thread
    python -m benchmarks.ppo_update --quick        # 2 rounds each of 1 epoch (4 gradient steps)
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
from easydict import EasyDict

from benchmarks._harness import ensure_package, print_json_line
from conveyor.engine import OnlineRLContext
from conveyor.middleware import multistep_trainer
from conveyor.policy import PPOPolicy

ENVS, STEPS, OBS, ACTIONS = 8, 128, (4, 84, 84), 4
HYPER = dict(learning_rate=2.5e-4, clip=0.1, ent=0.01, vf=0.5, grad_clip=0.5, gamma=0.99, gae=0.95, epochs=4,
             batch_size=256)


def rollout(seed: int = 0) -> dict[str, np.ndarray]:
    """Random time-major rollout arrays ``[STEPS, ENVS, ...]``."""
    rng = np.random.default_rng(seed)
    shape = (STEPS, ENVS)
    return {"obs": rng.integers(0, 256, (*shape, *OBS), dtype=np.uint8),
            "action": rng.integers(0, ACTIONS, shape), "logp": np.full(shape, -np.log(ACTIONS), np.float32),
            "value": rng.normal(size=shape).astype(np.float32), "adv": rng.normal(size=shape).astype(np.float32),
            "return": rng.normal(size=shape).astype(np.float32), "reward": rng.normal(size=shape).astype(np.float32),
            "done": rng.random(shape) < 0.01}


class Ours:
    """One round of ``multistep_trainer`` on the batch ``gae_estimator`` would leave in ``ctx.train_data``."""

    def __init__(self, data: dict[str, np.ndarray]) -> None:
        import treetensor.torch as ttorch
        cfg = PPOPolicy.default_config()
        cfg.model.update(obs_shape=list(OBS), action_shape=ACTIONS, encoder="nature", share_encoder=True)
        cfg.learn.update(learning_rate=HYPER["learning_rate"], clip_ratio=HYPER["clip"], entropy_coef=HYPER["ent"],
                         value_coef=HYPER["vf"], grad_clip=HYPER["grad_clip"], epoch_per_collect=HYPER["epochs"],
                         batch_size=HYPER["batch_size"])
        cfg.update(discount_factor=HYPER["gamma"], gae_lambda=HYPER["gae"])
        self.policy = PPOPolicy(cfg, seed=0)
        n = STEPS * ENVS
        flat = {k: torch.from_numpy(v.reshape(n, *v.shape[2:])) for k, v in data.items() if k != "done"}
        flat.update(terminated=torch.from_numpy(data["done"].reshape(n)), truncated=torch.zeros(n, dtype=torch.bool),
                    weight_version=torch.zeros(n, dtype=torch.int64))
        self.batch = ttorch.Tensor(flat)
        self.trainer = multistep_trainer(EasyDict(seed=0, policy=cfg), self.policy.learn_mode)

    def round(self) -> None:
        ctx = OnlineRLContext()
        ctx.train_data = self.batch
        self.trainer(ctx)


class SB3:
    """One ``PPO.train()`` of Stable-Baselines3 on a rollout buffer holding ``data``."""

    def __init__(self, data: dict[str, np.ndarray]) -> None:
        import gymnasium as gym
        from stable_baselines3 import PPO
        from stable_baselines3.common.logger import configure
        from stable_baselines3.common.vec_env import DummyVecEnv

        class Blank(gym.Env):
            observation_space = gym.spaces.Box(0, 255, OBS, np.uint8)
            action_space = gym.spaces.Discrete(ACTIONS)

        self.model = PPO("CnnPolicy", DummyVecEnv([Blank] * ENVS), n_steps=STEPS, batch_size=HYPER["batch_size"],
                         n_epochs=HYPER["epochs"], learning_rate=HYPER["learning_rate"], clip_range=HYPER["clip"],
                         ent_coef=HYPER["ent"], vf_coef=HYPER["vf"], max_grad_norm=HYPER["grad_clip"],
                         gamma=HYPER["gamma"], gae_lambda=HYPER["gae"], device="cpu", seed=0)
        self.model.set_logger(configure(None, []))
        self.model._current_progress_remaining = 1.0
        buf = self.model.rollout_buffer
        self.arrays = {"observations": data["obs"].astype(np.float32), "actions": data["action"][..., None]
                       .astype(np.float32), "rewards": data["reward"], "values": data["value"],
                       "log_probs": data["logp"], "advantages": data["adv"], "returns": data["return"],
                       "episode_starts": data["done"].astype(np.float32)}
        buf.full, buf.pos = True, buf.buffer_size

    def round(self) -> None:
        buf = self.model.rollout_buffer
        for name, array in self.arrays.items():  # as a fresh rollout: get() flattens it again
            setattr(buf, name, array)
        buf.generator_ready = False
        self.model.train()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each, alternately")
    parser.add_argument("--quick", action="store_true", help="2 rounds each of 1 epoch")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads of both (default: each its own)")
    parser.add_argument("--ours-only", action="store_true", help="time ours alone (for profiling)")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    if args.quick:
        HYPER["epochs"] = 1
    threads = {"conveyor": args.threads or 1, "sb3": args.threads or torch.get_num_threads()}
    data = rollout()
    torch.manual_seed(0)
    contenders = {"conveyor": Ours(data)}
    if not args.ours_only:
        ensure_package("stable-baselines3", "stable_baselines3")
        contenders["sb3"] = SB3(data)

    def run(name: str) -> float:
        torch.set_num_threads(threads[name])
        return timed(contenders[name].round)

    for name in contenders:  # warm up: optimizers made, allocator primed
        run(name)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name in contenders:
            times[name].append(run(name))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"PPO update round: {STEPS}x{ENVS} uint8 {OBS} obs, Nature CNN, {HYPER['epochs']} epochs, batch "
          f"{HYPER['batch_size']} (median of {rounds} rounds)")
    for name, t in times.items():
        print(f"{name:>10} ({threads[name]} threads): {med[name]:.3f} s/round   ({', '.join(f'{x:.3f}' for x in t)})")
    out: dict[str, Any] = {"conveyor_s": round(med["conveyor"], 4), "rounds": rounds,
                           "conveyor_threads": threads["conveyor"]}
    if "sb3" in med:
        out.update(sb3_s=round(med["sb3"], 4), sb3_threads=threads["sb3"],
                   update_vs_sb3=round(med["sb3"] / med["conveyor"], 3))
    print_json_line(out)


if __name__ == "__main__":
    main()
