"""Replay buffer throughput: ``DequeBuffer`` against a naive list-of-dicts buffer, in the same run.

The baseline is what one writes first: a Python list of transition dicts used as a ring,
``random.choices`` to sample, then per-sample stacking into a batch; for prioritized replay, a numpy
priority array sampled with ``np.random.choice(p=...)`` (O(N) a call) and min-normalised weights.
Both sides return the same thing: a ttorch batch with ``index`` (and ``weight``).

Measures push, extend(256), sample(64) and update_priority(64), uniform and prioritized, on a full
buffer of CartPole-sized transitions. Times are the best of several repeats, ours and the baseline's
timed in alternation (the machines are shared). Prints a table, then one JSON line with the figures
(us per call) and speedups (baseline time / ours).

    python -m benchmarks.replay_buffer [--quick]

With ``--atari`` it measures memory instead: it fills a frame-deduplicated buffer (``frame_stack="auto"``) of
``--size`` Atari-shaped transitions (default 1M; obs / next_obs uint8 4x84x84 stacks from 8 envs stepped in
lock-step, 4 steps per ``extend``, episodes of log-normal length, median 400 agent steps, each starting from a
repeated reset frame), then prints the process's resident memory (VmRSS / VmHWM) and, computed, what the naive
layout would need; the JSON line has ``atari_1m_rss_gb`` when ``--size`` is 1M (else a projection to 1M).

    python -m benchmarks.replay_buffer --atari [--size N]
"""
from __future__ import annotations

import argparse
import random
import time
import timeit
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", category=FutureWarning)  # treevalue's torch pytree registration

import numpy as np  # noqa: E402

from benchmarks._harness import print_json_line  # noqa: E402
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


FRAME_STACK, SCREEN = 4, 84
ATARI_ENVS, ATARI_STEPS = 8, 4


def memory_gb() -> dict[str, float]:
    """This process's resident memory now (VmRSS) and at its peak (VmHWM), in GB (1e9 bytes)."""
    status = Path("/proc/self/status").read_text().splitlines()
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_gb": fields["VmRSS"] / 1e9, "hwm_gb": fields["VmHWM"] / 1e9}


class AtariStream:
    """Atari-shaped transitions from ``n`` envs in lock-step: every frame unique (a random image from a palette with
    a frame counter stamped in), obs / next_obs the last 4 frames, a new episode's stack its reset frame 4 times."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.palette = self.rng.integers(0, 256, (256, SCREEN, SCREEN), dtype=np.uint8)
        self.counter = 0
        self.n = n
        self.stacks = np.repeat(self.frames(n)[:, None], FRAME_STACK, axis=1)
        self.left = self.lengths(n)

    def frames(self, m: int) -> np.ndarray:
        out = self.palette[self.rng.integers(0, len(self.palette), m)]
        out.reshape(m, -1)[:, :8].view(np.int64)[:, 0] = np.arange(self.counter, self.counter + m)
        self.counter += m
        return out

    def lengths(self, m: int) -> np.ndarray:
        return np.maximum(30, self.rng.lognormal(np.log(400), 0.8, m)).astype(np.int64)

    def collect(self, steps: int) -> dict[str, np.ndarray]:
        """``steps`` lock-steps of every env as one flat time-major batch of ``steps * n`` transitions."""
        rows: dict[str, list] = {k: [] for k in ("obs", "next_obs", "action", "reward", "terminated", "truncated")}
        for _ in range(steps):
            nxt = np.concatenate([self.stacks[:, 1:], self.frames(self.n)[:, None]], axis=1)
            self.left -= 1
            ended = self.left == 0
            for key, value in (("obs", self.stacks), ("next_obs", nxt), ("action", self.rng.integers(0, 4, self.n)),
                               ("reward", np.zeros(self.n, np.float32)), ("terminated", ended),
                               ("truncated", np.zeros(self.n, bool))):
                rows[key].append(value)
            self.stacks = nxt
            if ended.any():
                count = int(ended.sum())
                self.stacks = nxt.copy()  # nxt is the ended transitions' next_obs: keep it
                self.stacks[ended] = np.repeat(self.frames(count)[:, None], FRAME_STACK, axis=1)
                self.left[ended] = self.lengths(count)
        return {key: np.concatenate(value) for key, value in rows.items()}


def atari_memory(size: int) -> dict[str, float]:
    """Fill a frame-deduplicated buffer of ``size`` Atari transitions; its memory, against the naive layout's."""
    before = memory_gb()["rss_gb"]
    buffer = DequeBuffer(size, frame_stack="auto", seed=0)
    stream = AtariStream(ATARI_ENVS)
    start = time.perf_counter()
    while len(buffer) < size:
        buffer.extend(stream.collect(ATARI_STEPS))
    fill_s = time.perf_counter() - start
    after = memory_gb()
    sample_ms = min(timeit.repeat(lambda: buffer.sample(32), number=20, repeat=3)) / 20 * 1e3
    frame_bytes = SCREEN * SCREEN
    stack_bytes = FRAME_STACK * frame_bytes
    naive_gb = size * (2 * stack_bytes + 8 + 4 + 1 + 1) / 1e9  # obs + next_obs stacks, action, reward, flags
    figures = {
        "size": size,
        "frames_stored": buffer.frame_count,
        "frames_per_transition": round(buffer.frame_count / size, 4),
        "frame_data_gb": round(buffer.frame_count * frame_bytes / 1e9, 3),
        "rss_before_gb": round(before, 3),
        "rss_gb": round(after["rss_gb"], 3),
        "hwm_gb": round(after["hwm_gb"], 3),
        "buffer_gb": round(after["rss_gb"] - before, 3),
        "naive_gb": round(naive_gb, 3),
        "fill_s": round(fill_s, 1),
        "fill_transitions_per_s": round(size / fill_s),
        "sample32_ms": round(sample_ms, 3),
    }
    print(f"Atari replay: {size} transitions of uint8 {FRAME_STACK}x{SCREEN}x{SCREEN} obs + next_obs, "
          f"{ATARI_ENVS} envs interleaved, frame_stack='auto'")
    for key, value in figures.items():
        print(f"  {key:26s} {value}")
    print(f"  naive layout (computed, not allocated): {naive_gb:.1f} GB; this buffer: {figures['buffer_gb']:.2f} GB "
          f"({naive_gb / max(figures['buffer_gb'], 1e-9):.1f}x less)")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller buffer and fewer repeats (a few seconds)")
    parser.add_argument("--atari", action="store_true", help="measure the memory of an Atari replay buffer instead")
    parser.add_argument("--size", type=int, default=None,
                        help="with --atari: transitions to fill (default 1,000,000; 20,000 with --quick)")
    args = parser.parse_args()
    if args.atari:
        size = args.size or (20_000 if args.quick else 1_000_000)
        figures: dict[str, float] = atari_memory(size)
        if size == 1_000_000:
            figures["atari_1m_rss_gb"] = figures["rss_gb"]
        else:  # the buffer's part grows with its size; the interpreter's does not
            figures["atari_1m_rss_gb_projected"] = round(
                figures["rss_before_gb"] + figures["buffer_gb"] * 1_000_000 / size, 3)
        print_json_line(figures)
        return
    capacity, repeat, scale = (10_000, 5, 0.25) if args.quick else (100_000, 9, 1.0)
    random.seed(0)
    np.random.seed(0)

    figures = {"capacity": capacity}
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
    print_json_line(figures)


if __name__ == "__main__":
    main()
