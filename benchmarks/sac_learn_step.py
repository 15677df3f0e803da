"""Wall time of one SAC learn step (critics, actor, temperature, targets) against a plain reference.

The reference is the textbook layout written the usual way: two separate critic MLPs (and two target
MLPs), ``torch.optim.Adam`` with its default per-tensor loop, the actor loss back-propagated into the
critics' weights, and a Python loop for the Polyak update. Both run in this process on the same
batch, interleaved, one intra-op thread; the figure is their ratio.

    python -m benchmarks.sac_learn_step            # hidden 128 and 256, batch 256
    python -m benchmarks.sac_learn_step --quick
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._harness import print_json_line
from conveyor.data.batch import to_tensor
from conveyor.policy.model import MLP
from conveyor.policy.sac import SACPolicy


class ReferenceSAC:
    """The same losses as SACPolicy, written the common straightforward way."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: int, lr: float = 3e-4, tau: float = 0.005) -> None:
        def critic() -> nn.Module:
            return MLP(obs_dim + action_dim, [hidden, hidden], out_dim=1)

        self.actor = MLP(obs_dim, [hidden, hidden], out_dim=2 * action_dim)
        self.q1, self.q2, self.q1_t, self.q2_t = critic(), critic(), critic(), critic()
        self.q1_t.load_state_dict(self.q1.state_dict())
        self.q2_t.load_state_dict(self.q2.state_dict())
        self.log_alpha = torch.zeros((), requires_grad=True)
        self.q_opt = torch.optim.Adam(list(self.q1.parameters()) + list(self.q2.parameters()), lr=lr)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr)
        self.tau, self.target_entropy, self.gamma = tau, -float(action_dim), 0.99

    def sample(self, obs):
        mean, log_std = self.actor(obs).chunk(2, -1)
        log_std = -5 + 3.5 * (torch.tanh(log_std) + 1)
        normal = torch.distributions.Normal(mean, log_std.exp())
        u = normal.rsample()
        a = torch.tanh(u)
        log_prob = (normal.log_prob(u) - torch.log(1 - a.pow(2) + 1e-6)).sum(-1)
        return a, log_prob

    def learn(self, b) -> None:
        alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            na, nlp = self.sample(b.next_obs)
            x = torch.cat([b.next_obs, na], -1)
            nq = torch.min(self.q1_t(x), self.q2_t(x)).squeeze(-1) - alpha * nlp
            y = b.reward + self.gamma * (1 - b.terminated.float()) * nq
        x = torch.cat([b.obs, b.action], -1)
        q_loss = F.mse_loss(self.q1(x).squeeze(-1), y) + F.mse_loss(self.q2(x).squeeze(-1), y)
        self.q_opt.zero_grad()
        q_loss.backward()
        self.q_opt.step()
        a, lp = self.sample(b.obs)
        x = torch.cat([b.obs, a], -1)
        actor_loss = (alpha * lp - torch.min(self.q1(x), self.q2(x)).squeeze(-1)).mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()
        alpha_loss = -(self.log_alpha * (lp.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad()
        alpha_loss.backward()
        self.alpha_opt.step()
        with torch.no_grad():
            for net, target in ((self.q1, self.q1_t), (self.q2, self.q2_t)):
                for p, tp in zip(net.parameters(), target.parameters()):
                    tp.data.copy_(self.tau * p.data + (1 - self.tau) * tp.data)


def batch(n: int, obs_dim: int, action_dim: int):
    g = torch.Generator().manual_seed(0)
    return to_tensor({"obs": torch.randn(n, obs_dim, generator=g), "next_obs": torch.randn(n, obs_dim, generator=g),
                      "action": torch.rand(n, action_dim, generator=g) * 2 - 1, "reward": torch.randn(n, generator=g),
                      "terminated": torch.rand(n, generator=g) < 0.05, "truncated": torch.zeros(n, dtype=torch.bool)})


def time_per_step(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def measure(hidden: int, batch_size: int, obs_dim: int, action_dim: int, steps: int, rounds: int,
            warmup: int = 10) -> dict:
    """One row: ours against the reference at ``hidden``, each warmed up by ``warmup`` steps, then ``rounds``
    interleaved timings of ``steps`` steps."""
    torch.manual_seed(0)
    policy = SACPolicy({"model": {"obs_shape": obs_dim, "action_shape": action_dim, "hidden_sizes": [hidden, hidden]},
                        "learn": {"batch_size": batch_size}}, seed=0)
    reference = ReferenceSAC(obs_dim, action_dim, hidden)
    data = batch(batch_size, obs_dim, action_dim)
    ours_fn, ref_fn = (lambda: policy.learn_mode.forward(data)), (lambda: reference.learn(data))
    for fn in (ours_fn, ref_fn):  # warm up
        time_per_step(fn, warmup)
    ours, ref = [], []
    for _ in range(rounds):  # interleaved, so drift on a shared machine hits both alike
        ours.append(time_per_step(ours_fn, steps))
        ref.append(time_per_step(ref_fn, steps))
    ours_ms, ref_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(ref)
    return {"hidden": hidden, "batch_size": batch_size, "learn_step_ms": round(ours_ms, 3),
            "reference_ms": round(ref_ms, 3), "speedup": round(ref_ms / ours_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--obs-dim", type=int, default=8)
    parser.add_argument("--action-dim", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="learn steps per timing round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="hidden 128 only, 2 rounds of 10 steps after 2 warm-up "
                                                             "steps (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hiddens = [128] if args.quick else args.hidden
    steps, rounds, warmup = (10, 2, 2) if args.quick else (args.steps, args.rounds, 10)
    rows = [measure(h, args.batch_size, args.obs_dim, args.action_dim, steps, rounds, warmup) for h in hiddens]
    print(f"SAC learn step, batch {args.batch_size}, obs {args.obs_dim}, action {args.action_dim}, 1 thread "
          f"(median of {rounds} rounds of {steps} steps)")
    print(f"{'hidden':>7}{'conveyor ms':>13}{'reference ms':>14}{'speedup':>9}")
    for r in rows:
        print(f"{r['hidden']:>7}{r['learn_step_ms']:>13.2f}{r['reference_ms']:>14.2f}{r['speedup']:>9.2f}")
    speedup = math.exp(statistics.fmean(math.log(r["speedup"]) for r in rows))
    print_json_line({"rows": rows, "geomean_speedup": round(speedup, 2)})


if __name__ == "__main__":
    main()
