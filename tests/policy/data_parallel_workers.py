"""Learner processes for the data-parallel tests: each builds the same policy, joins a two-learner group and learns
on its share of a fixed sequence of batches (module level, so ``spawn`` can start them)."""
from __future__ import annotations

import os
import threading
from typing import Any

import torch
import treetensor.torch as ttorch

from conveyor.policy import DataParallel, DataParallelError, DQNPolicy, PPOPolicy, SACPolicy

SECRET = b"s" * 32
BATCH, STEPS = 16, 5
BUCKET_BYTES = 256  # these models' gradients then travel in several buckets, launched as the backward pass runs


def make_policy(algo: str, **learn: Any):
    """The policy every learner (and the single-learner reference) builds, seeded alike."""
    if algo == "ppo-target-kl":  # stops early on steps 0, 1 and 4 of batches("ppo") in one learner
        return make_policy("ppo", target_kl=2.5e-5, **learn)
    torch.manual_seed(0)
    if algo == "ppo-norm":  # statistics of the observations and returns gathered from the batches
        return PPOPolicy({"model": {"obs_shape": 4, "action_shape": 2, "hidden_sizes": [16], "obs_norm": True,
                                    "reward_norm": True}, "learn": {"grad_clip": 0.5, **learn}}, seed=0)
    if algo == "dqn":
        return DQNPolicy({"model": {"obs_shape": 4, "action_shape": 2, "hidden_sizes": [16]},
                          "learn": {"grad_clip": 1.0, "target_update_freq": 2, **learn}}, seed=0)
    if algo == "sac":  # the temperature steps apart from _apply_gradients
        return SACPolicy({"model": {"obs_shape": 4, "action_shape": 1, "hidden_sizes": [16]}, "learn": learn}, seed=0)
    return PPOPolicy({"model": {"obs_shape": 4, "action_shape": 2, "hidden_sizes": [16]},
                      "learn": {"grad_clip": 0.5, **learn}}, seed=0)  # adv_norm: over the whole batch


def batches(algo: str) -> list[ttorch.Tensor]:
    """``STEPS`` batches of ``BATCH`` random transitions, the same in every process."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        fields = {"obs": torch.randn(BATCH, 4, generator=g), "action": torch.randint(0, 2, (BATCH,), generator=g),
                  "reward": torch.randn(BATCH, generator=g)}
        if algo == "sac":
            fields.update(action=torch.rand(BATCH, 1, generator=g) * 2 - 1)
        if algo in ("dqn", "sac"):
            fields.update(next_obs=torch.randn(BATCH, 4, generator=g), terminated=torch.rand(BATCH, generator=g) < 0.2)
        else:
            fields.update(logp=torch.full((BATCH,), -0.7), adv=torch.randn(BATCH, generator=g),
                          value=torch.randn(BATCH, generator=g), **{"return": torch.randn(BATCH, generator=g)})
        if algo == "ppo-norm":  # collected by a replica: the learner gathers them; rank 1's share has no new obs
            fields.update(obs_gathered=torch.arange(BATCH) >= BATCH * 3 // 4,
                          discounted_return=torch.randn(BATCH, generator=g) * 5 + 1)
        out.append(ttorch.Tensor(fields))
    return out


def flat_weights(policy) -> torch.Tensor:
    """Every learned parameter: the model's, and SAC's temperature; then the statistics of PPO's normalisers (float64
    then), those in use and those gathered for the next commit."""
    modules = [policy.model, *([policy.temperature] if hasattr(policy, "temperature") else [])]
    flat = torch.cat([p.detach().reshape(-1).clone() for m in modules for p in m.parameters()])
    norms = [n for n in (getattr(policy, "obs_normaliser", None), getattr(policy, "reward_normaliser", None)) if n]
    if not norms:
        return flat
    stats = [torch.from_numpy(s.pack()) for n in norms for s in (n.stats, n.pending)]
    return torch.cat([flat.double(), *stats])


def learn(policy, batch: ttorch.Tensor) -> None:
    """One round on ``batch`` as a trainer runs it: its statistics gathered (where the view has ``gather``), one step,
    the weights published (which folds in what was gathered)."""
    gather = getattr(policy.learn_mode, "gather", None)  # PPO's view has it
    if gather is not None:
        gather(batch)
    policy.learn_mode.forward(batch)
    policy.learn_mode.publish()


def learner(rank: int, algos: list[str], port_queue: Any, results: Any, fault: str | None = None,
            timeout: float = 20.0) -> None:
    """For each algorithm of ``algos`` in turn, in a two-learner group of its own, learn ``STEPS`` steps as rank
    ``rank``; put ``(rank, {algo: [weights after each step]})`` or ``(rank, error message)`` on ``results``. One
    process learns them all: a fresh process pays seconds of imports (torch's compiler, which building an optimizer
    loads, among them). ``fault``: after 2 steps of the first algorithm rank 1 dies without a word (``"die"``) or
    stops answering for good (``"hang"``)."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the learners talk over loopback only
    try:
        weights: dict[str, list[Any]] = {}
        for algo in algos:
            weights[algo] = [w.numpy() for w in learn_in_group(rank, algo, port_queue, fault, timeout)]
        results.put((rank, weights))  # plain arrays: shared tensors die with the process
    except DataParallelError as exc:
        results.put((rank, str(exc)))
    except Exception as exc:  # any other failure is reported too, so the test fails at once instead of waiting
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def learn_in_group(rank: int, algo: str, port_queue: Any, fault: str | None, timeout: float) -> list[torch.Tensor]:
    """Rank ``rank``'s weights after each step of ``algo`` in a new two-learner group (rank 0 hands its port to rank
    1 through ``port_queue``)."""
    policy = make_policy(algo)
    if rank == 1:  # another seed: joining must copy rank 0's weights
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(1.0)
    port = 0 if rank == 0 else port_queue.get(timeout=60)
    group = DataParallel(rank, 2, host="127.0.0.1", port=port, secret=SECRET, session=algo.encode(), timeout=timeout,
                         bucket_bytes=BUCKET_BYTES)
    if rank == 0:
        port_queue.put(group.port)
    group.connect()
    policy.learn_mode.join_data_parallel(group)
    weights = []
    for step, batch in enumerate(batches(algo)):
        if fault is not None and rank == 1 and step == 2:
            if fault == "die":
                os._exit(3)
            threading.Event().wait()  # hangs until the test kills it
        learn(policy, group.shard(batch))
        weights.append(flat_weights(policy))
    group.close()
    return weights
