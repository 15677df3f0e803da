"""Offline data loading: minibatches/s of ``offline_data_fetcher`` against indexing the same arrays directly.

Both sides hand out the same thing, in the same run: shuffled minibatches of ``batch_size`` rows over the
whole dataset, one permutation per epoch, as the ttorch batch learners take (``obs``, ``action``,
``reward``, ``next_obs``, ``terminated``, ``truncated``, ``index``). The baseline is the loop one writes by
hand with no middleware: ``perm = rng.permutation(N)``, then per batch ``np.take(arr, perm[i:i + B], axis=0)``
on each numpy array (the fastest CPU gather), ``torch.from_numpy`` and one tree build. Bar (issue 9): ``fetch_ratio`` = fetcher / baseline
minibatches per second >= 0.8. ``raw_ratio`` compares against indexing alone, returning a plain dict (no
tree: not a batch a learner takes), for information. Each figure is the best of many short rounds, the sides
taking turns round by round (the machines are shared).

    python -m benchmarks.offline_fetch [--quick] [--dataset ID_OR_PATH] [--batch-size 256]

``benchmarks._fetch.measure_fetch(dataset, batch_size=...)`` returns the figures as a dict (``benchmarks.offline``
calls it too).
The last line is JSON with ``fetch_ratio``, ``fetch_batches_per_s``, ``direct_batches_per_s``, ``raw_ratio``.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

import torch

from benchmarks._fetch import measure_fetch
from benchmarks._harness import print_json_line
from conveyor.data import load_dataset


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
    print_json_line(figures)
    return figures


if __name__ == "__main__":
    main()
