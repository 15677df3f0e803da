"""Minibatches/s of ``offline_data_fetcher`` against indexing the same arrays by hand: what
``benchmarks.offline_fetch`` reports and ``benchmarks.offline`` gives as its ``fetch_ratio``."""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, Optional

warnings.filterwarnings("ignore", category=FutureWarning)  # treevalue's torch pytree registration

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from easydict import EasyDict  # noqa: E402

from conveyor import OfflineRLContext  # noqa: E402
from conveyor.data import OfflineDataset, tree_of_tensors  # noqa: E402
from conveyor.middleware import offline_data_fetcher  # noqa: E402


def synthetic_dataset(n: int = 50_000, seed: int = 0) -> OfflineDataset:
    """``n`` CartPole-shaped transitions (the size of the issue's expert dataset), episodes of 500 steps."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n + 1, 4)).astype(np.float32)
    ends = (np.arange(n) % 500) == 499
    return OfflineDataset(observations=obs[:-1], actions=rng.integers(0, 2, n), rewards=np.ones(n, np.float32),
                          next_observations=obs[1:], terminations=np.zeros(n, bool), truncations=ends,
                          observation_space=gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                          action_space=gym.spaces.Discrete(2))


def direct_batches(dataset: OfflineDataset, batch_size: int, seed: int, tree: bool = True) -> Callable[[], Any]:
    """The baseline: a hand-written epoch loop over the numpy arrays (flat observations)."""
    arrays = {"obs": dataset.observations, "action": dataset.actions, "reward": dataset.rewards,
              "next_obs": dataset.next_observations, "terminated": dataset.terminations,
              "truncated": dataset.truncations}
    rng = np.random.default_rng(seed)
    n = len(dataset)
    state = {"perm": rng.permutation(n), "pos": 0}

    def next_batch() -> Any:
        if state["pos"] >= n:
            state["perm"], state["pos"] = rng.permutation(n), 0
        index = state["perm"][state["pos"]:state["pos"] + batch_size]
        state["pos"] += len(index)
        batch = {key: torch.from_numpy(np.take(array, index, axis=0)) for key, array in arrays.items()}
        batch["index"] = torch.from_numpy(index)
        return tree_of_tensors(batch) if tree else batch

    return next_batch


def _best_rate(fn: Callable[[], Any], batches: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        fn()
    return batches / (time.perf_counter() - start)


def measure_fetch(dataset: Optional[OfflineDataset] = None, *, batch_size: int = 256, batches: int = 200,
                  repeats: int = 50, seed: int = 0) -> Dict[str, Any]:
    """Minibatches/s of the fetcher (called as middleware on a context) and of the direct baselines: the best of
    ``repeats`` rounds of ``batches`` minibatches, the sides taking turns round by round."""
    dataset = synthetic_dataset() if dataset is None else dataset
    cfg = EasyDict(seed=seed, policy=dict(learn=dict(batch_size=batch_size)))
    fetcher = offline_data_fetcher(cfg, dataset)
    ctx = OfflineRLContext()
    sides = {"fetcher": lambda: fetcher(ctx), "direct": direct_batches(dataset, batch_size, seed),
             "raw": direct_batches(dataset, batch_size, seed, tree=False)}
    best = {name: 0.0 for name in sides}
    for fn in sides.values():
        _best_rate(fn, batches)  # warm up
    for _ in range(repeats):
        for name, fn in sides.items():
            best[name] = max(best[name], _best_rate(fn, batches))
    return {"transitions": len(dataset), "batch_size": batch_size,
            "fetch_batches_per_s": round(best["fetcher"], 1), "direct_batches_per_s": round(best["direct"], 1),
            "raw_batches_per_s": round(best["raw"], 1), "fetch_ratio": round(best["fetcher"] / best["direct"], 3),
            "raw_ratio": round(best["fetcher"] / best["raw"], 3)}
