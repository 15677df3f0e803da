"""Offline data loading: minibatches/s of ``offline_data_fetcher`` against indexing the same arrays directly.

Both sides hand out the same thing, in the same run: shuffled minibatches of ``batch_size`` rows over the
whole dataset, one permutation per epoch, as the ttorch batch learners take (``obs``, ``action``,
``reward``, ``next_obs``, ``terminated``, ``truncated``, ``index``). The baseline is the loop one writes by
hand with no middleware: ``perm = rng.permutation(N)``, then per batch ``np.take(arr, perm[i:i + B], axis=0)``
on each numpy array (the fastest CPU gather), ``torch.from_numpy`` and one tree build. Bar (issue 9): ``fetch_ratio`` = fetcher / baseline
minibatches per second >= 0.8. ``raw_ratio`` compares against indexing alone, returning a plain dict (no
tree: not a batch a learner takes), for information. Each figure is the best of many short rounds, the sides
taking turns round by round (the machines are shared).

    python benchmarks/offline_fetch.py [--quick] [--dataset ID_OR_PATH] [--batch-size 256]

``measure_fetch(dataset, batch_size=...)`` returns the figures as a dict (benchmarks/offline.py calls it).
The last line is JSON with ``fetch_ratio``, ``fetch_batches_per_s``, ``direct_batches_per_s``, ``raw_ratio``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional

warnings.filterwarnings("ignore", category=FutureWarning)  # treevalue's torch pytree registration

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from easydict import EasyDict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from conveyor import OfflineRLContext  # noqa: E402
from conveyor.data import OfflineDataset, load_dataset, tree_of_tensors  # noqa: E402
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


def main(argv: Optional[list] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and repeats (well under a minute)")
    parser.add_argument("--dataset", default=None, help="a dataset id or file (default: 50k synthetic CartPole rows)")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dataset = load_dataset(args.dataset) if args.dataset else None
    figures = measure_fetch(dataset, batch_size=args.batch_size, repeats=10 if args.quick else 50)
    print(f"{'loader':<34}{'minibatches/s':>14}")
    print(f"{'offline_data_fetcher':<34}{figures['fetch_batches_per_s']:>14.0f}")
    print(f"{'direct indexing + tree (baseline)':<34}{figures['direct_batches_per_s']:>14.0f}")
    print(f"{'direct indexing, plain dict':<34}{figures['raw_batches_per_s']:>14.0f}")
    print(f"{figures['transitions']} transitions, batch {figures['batch_size']}: fetch_ratio {figures['fetch_ratio']} "
          f"(bar >= 0.8), raw_ratio {figures['raw_ratio']}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
