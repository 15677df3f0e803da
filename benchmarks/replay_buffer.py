"""Replay buffer throughput: ``DequeBuffer`` against a naive list-of-dicts buffer, in the same run.

The baseline is what one writes first: a Python list of transition dicts used as a ring,
``random.choices`` to sample, then per-sample stacking into a batch; for prioritized replay, a numpy
priority array sampled with ``np.random.choice(p=...)`` (O(N) a call) and min-normalised weights.
Both sides return the same thing: a ttorch batch with ``index`` (and ``weight``).

Measures push, extend(256), sample(64) and update_priority(64), uniform and prioritized, on a full
buffer of CartPole-sized transitions. Times are the best of several repeats, ours and the baseline's
timed in alternation (the machines are shared). Prints a table, then one JSON line with the figures
(us per call) and speedups (baseline time / ours).

    python benchmarks/replay_buffer.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", category=FutureWarning)  # treevalue's torch pytree registration

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from conveyor.data import DequeBuffer, as_tree, stack_nested  # noqa: E402

EXTEND_ROWS = 256
SAMPLE_ROWS = 64


def make_batch(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """``n`` CartPole-sized transitions with the keys of the design's batch layout."""
    return {
        "obs": rng.standard_normal((n, 4)).astype(np.float32),
        "action": rng.integers(0, 2, n),
        "reward": np.ones(n, np.float32),
        "next_obs": rng.standard_normal((n, 4)).astype(np.float32),
        "terminated": rng.random(n) < 0.05,
        "truncated": np.zeros(n, bool),
    }


class NaiveBuffer:
    """The baseline: a list of transition dicts used as a ring, stacked per sample."""

    def __init__(self, size: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 eps: float = 1e-6) -> None:
        self.size, self.prioritized, self.alpha, self.beta, self.eps = size, prioritized, alpha, beta, eps
        self.items: list[dict] = []
        self.ptr = 0
        self.priorities = np.zeros(size)
        self.max_priority = 1.0

    def push(self, transition: dict) -> None:
        if len(self.items) < self.size:
            self.items.append(transition)
        else:
            self.items[self.ptr] = transition
        if self.prioritized:
            self.priorities[self.ptr] = self.max_priority ** self.alpha
        self.ptr = (self.ptr + 1) % self.size

    def extend(self, batch: dict[str, np.ndarray]) -> None:
        keys = list(batch)
        for i in range(len(batch[keys[0]])):
            self.push({k: batch[k][i] for k in keys})

    def sample(self, n: int) -> Any:
        extra = {}
        if self.prioritized:
            p = self.priorities[:len(self.items)]
            probs = p / p.sum()
            index = np.random.choice(len(self.items), n, p=probs)
            extra["weight"] = ((probs.min() / probs[index]) ** self.beta).astype(np.float32)
        else:
            index = np.array(random.choices(range(len(self.items)), k=n))
        batch = stack_nested([self.items[i] for i in index])
        return as_tree({**batch, "index": index, **extra})

    def update_priority(self, index: np.ndarray, priority: np.ndarray) -> None:
        p = np.abs(priority) + self.eps
        self.max_priority = max(self.max_priority, float(p.max()))
        self.priorities[index] = p ** self.alpha


def best_pair(ours: Callable[[], Any], baseline: Callable[[], Any], number: int, baseline_number: int,
              repeat: int) -> tuple[float, float]:
    """Best microseconds per call of each, timed in alternation so a busy spell hits both alike."""
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, (fn, n) in enumerate(((ours, number), (baseline, baseline_number))):
            best[i] = min(best[i], timeit.timeit(fn, number=n) / n * 1e6)
    return best[0], best[1]


def measure(prioritized: bool, capacity: int, repeat: int, scale: float) -> dict[str, tuple[str, float, float]]:
    """(label, ours, baseline) microseconds per call for each operation, on full buffers."""
    rng = np.random.default_rng(0)
    ours = DequeBuffer(capacity, prioritized=prioritized, seed=0)
    naive = NaiveBuffer(capacity, prioritized=prioritized)
    fill = make_batch(rng, capacity)
    ours.extend(fill)
    naive.extend(fill)
    batch = make_batch(rng, EXTEND_ROWS)
    one = {k: v[0] for k, v in batch.items()}
    index = ours.sample(SAMPLE_ROWS).index.numpy()
    priority = rng.random(SAMPLE_ROWS)
    n = max(1, int(200 * scale))

    def step(buffer: Any) -> None:
        sample = buffer.sample(SAMPLE_ROWS)
        buffer.update_priority(sample.index.numpy(), priority)

    results = {
        "push": ("push", *best_pair(lambda: ours.push(one), lambda: naive.push(one), 20 * n, 20 * n, repeat)),
        f"extend{EXTEND_ROWS}": (f"extend({EXTEND_ROWS})", *best_pair(
            lambda: ours.extend(batch), lambda: naive.extend(batch), n, max(1, n // 10), repeat)),
        f"sample{SAMPLE_ROWS}": (f"sample({SAMPLE_ROWS})", *best_pair(
            lambda: ours.sample(SAMPLE_ROWS), lambda: naive.sample(SAMPLE_ROWS), n, max(1, n // 4), repeat)),
    }
    if prioritized:
        results[f"update{SAMPLE_ROWS}"] = (f"update_priority({SAMPLE_ROWS})", *best_pair(
            lambda: ours.update_priority(index, priority), lambda: naive.update_priority(index, priority),
            n, n, repeat))
        results[f"sample_update{SAMPLE_ROWS}"] = (f"sample+update({SAMPLE_ROWS})", *best_pair(
            lambda: step(ours), lambda: step(naive), n, max(1, n // 4), repeat))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller buffer and fewer repeats (a few seconds)")
    args = parser.parse_args()
    capacity, repeat, scale = (10_000, 5, 0.25) if args.quick else (100_000, 9, 1.0)
    random.seed(0)
    np.random.seed(0)

    figures: dict[str, float] = {"capacity": capacity}
    print(f"replay buffer: {capacity} CartPole-sized transitions, best of {repeat}; "
          f"baseline = list of dicts + per-sample stacking")
    print(f"{'operation':32s} {'conveyor us':>12s} {'baseline us':>12s} {'speedup':>9s}")
    for prioritized in (False, True):
        mode = "prioritized" if prioritized else "uniform"
        for op, (label, ours, baseline) in measure(prioritized, capacity, repeat, scale).items():
            print(f"{mode + ' ' + label:32s} {ours:12.1f} {baseline:12.1f} {baseline / ours:8.1f}x")
            figures[f"{mode}_{op}_us"] = round(ours, 2)
            figures[f"{mode}_{op}_baseline_us"] = round(baseline, 2)
            figures[f"{mode}_{op}_speedup"] = round(baseline / ours, 2)
    print("push and update_priority: the baseline only stores a reference / one array write and pays at sample "
          "time; sample+update is the prioritized learner's step")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
